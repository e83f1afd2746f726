"""Compare two torchtitan trainer logs step by step (run.sh calls it): rank 0's
``step: N  loss: X ... grad_norm: Y`` lines of the default dispatcher's run and of
flexdispatch's, as a table with the absolute gaps, and the largest gaps.

Exit code 1 when a run failed (its log holds no step, or fewer steps than asked), else 0: the
gaps are a measurement, not a pass/fail threshold.

    python compare.py DEFAULT_LOG FLEXDISPATCH_LOG --steps N
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NUMBER = r"([-+0-9.eE]+|nan|inf)"
_STEP = re.compile(rf"step:\s*(\d+)\s+loss:\s*{_NUMBER}.*?grad_norm:\s*{_NUMBER}")


def steps(log: Path) -> dict[int, tuple[float, float]]:
    """step -> (loss, grad norm) from rank 0's lines (torchrun prefixes them ``[rank0]:``; a log
    of rank 0 alone has no prefix)."""
    out: dict[int, tuple[float, float]] = {}
    for line in log.read_text(errors="replace").splitlines():
        line = _ANSI.sub("", line)
        if line.startswith("[rank") and not line.startswith("[rank0]"):
            continue
        m = _STEP.search(line)
        if m:
            out[int(m.group(1))] = (float(m.group(2)), float(m.group(3)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("default", type=Path)
    ap.add_argument("flexdispatch", type=Path)
    ap.add_argument("--steps", type=int, required=True)
    args = ap.parse_args()
    a, b = steps(args.default), steps(args.flexdispatch)
    common = sorted(set(a) & set(b))
    print(f"steps compared: {len(common)} (default {len(a)}, flexdispatch {len(b)})")
    print(
        "| step | loss (default) | loss (flexdispatch) | abs diff "
        "| grad norm (default) | grad norm (flexdispatch) | abs diff |"
    )
    print("|---|---|---|---|---|---|---|")
    worst_loss = worst_norm = 0.0
    for s in common:
        (la, ga), (lb, gb) = a[s], b[s]
        dl, dg = abs(la - lb), abs(ga - gb)
        worst_loss, worst_norm = max(worst_loss, dl), max(worst_norm, dg)
        print(f"| {s} | {la:.7f} | {lb:.7f} | {dl:.2e} | {ga:.6f} | {gb:.6f} | {dg:.2e} |")
    print(f"largest |loss diff| = {worst_loss:.3e}, largest |grad norm diff| = {worst_norm:.3e}")
    short = [name for name, got in (("default", a), ("flexdispatch", b)) if len(got) < args.steps]
    if short:
        print(f"fewer than {args.steps} steps logged by: {', '.join(short)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
