"""Which device and process-group backend each rank of this machine gets, decided before any
process group exists.

One rule for ``flexdispatch demo``, the launch recipes in ``scripts/launch/`` and
``serve_hf_expert_parallel.*``: L ranks on this machine (ranks per node) with G GPUs visible.

- the CPU is asked for (``--cpu`` or ``FLEXDISPATCH_DEVICE=cpu``): gloo, every rank on the CPU;
- no GPU visible (and none asked for): gloo on the CPU, as on a laptop;
- L <= G: NCCL, local rank i on ``cuda:i``;
- L > G: refused with one line naming L, G and what to pass (fewer ranks, or the CPU) — two
  ranks on one GPU end in ``NCCL error ... invalid usage`` or ``invalid device ordinal``.

``FLEXDISPATCH_DEVICE=cuda`` asks for the GPUs (refused without one). ``FLEXDISPATCH_VISIBLE_GPUS``
overrides the GPU count (tests fake a GPU machine with it). The launch scripts call

    python -m flexdispatch.launch.devices --ranks L [--cpu]

before ``torchrun``: it prints the decision on one line and exits 2 when refused.

L ranks per node · G GPUs visible on this machine.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

from flexdispatch._checks.errors import InputError
from flexdispatch._checks.files import excerpt
from flexdispatch._checks.values import env_int

__all__ = [
    "DEVICE_ENV",
    "DEVICE_CHOICES",
    "VISIBLE_GPUS_ENV",
    "DevicePlan",
    "plan_devices",
    "requested_device",
    "visible_gpus",
]

DEVICE_ENV = "FLEXDISPATCH_DEVICE"
"""``cpu`` (gloo on the CPU even with GPUs visible), ``cuda`` (the GPUs, refused without) or
``auto`` (the default: the GPUs when there are enough, the CPU when there are none)."""
DEVICE_CHOICES = ("auto", "cpu", "cuda")
VISIBLE_GPUS_ENV = "FLEXDISPATCH_VISIBLE_GPUS"
"""Overrides the number of GPUs visible (an integer >= 0), for tests on a CPU machine."""
MAX_GPUS = 4096
"""The largest ``$FLEXDISPATCH_VISIBLE_GPUS`` read (more is a typo, not a machine)."""


@dataclass(frozen=True)
class DevicePlan:
    """The decision for the L ranks of this machine.

    Attributes:
        backend: ``"nccl"`` or ``"gloo"``.
        device_type: ``"cuda"`` or ``"cpu"``.
        ranks_per_node: L.
        gpus: G, the GPUs visible.
        reason: why, in words (printed by the demo and the launch check).
    """

    backend: str
    device_type: str
    ranks_per_node: int
    gpus: int
    reason: str

    @property
    def uses_gpus(self) -> bool:
        return self.device_type == "cuda"

    def device_index(self, local_rank: int) -> int | None:
        """The CUDA device of local rank ``local_rank`` (None on the CPU)."""
        if not self.uses_gpus:
            return None
        if not 0 <= local_rank < self.ranks_per_node:
            raise ValueError(
                f"local_rank={local_rank} is outside 0..{self.ranks_per_node - 1} "
                f"(ranks_per_node={self.ranks_per_node})"
            )
        return local_rank

    def child_env(self) -> dict[str, str]:
        """Environment for a rank process: on the CPU, no GPU at all (no CUDA context, no
        device memory taken from a GPU other jobs use)."""
        return {} if self.uses_gpus else {"CUDA_VISIBLE_DEVICES": ""}

    def line(self) -> str:
        L, G = self.ranks_per_node, self.gpus
        return f"{L} rank(s) on this machine, {G} GPU(s) visible: {self.reason}"


def visible_gpus() -> tuple[int, str]:
    """G and where it comes from: ``$FLEXDISPATCH_VISIBLE_GPUS``, else
    ``torch.cuda.device_count()`` when CUDA is available, else 0."""
    gpus = env_int(
        VISIBLE_GPUS_ENV, minimum=0, maximum=MAX_GPUS, fix="set a GPU count >= 0, or unset it"
    )
    if gpus is not None:
        return gpus, f"${VISIBLE_GPUS_ENV}"
    import torch

    if not torch.cuda.is_available():
        return 0, "torch.cuda.is_available() is False"
    return torch.cuda.device_count(), "torch.cuda.device_count()"


def requested_device(cpu_flag: bool = False) -> str:
    """``cpu`` when ``cpu_flag`` (a ``--cpu`` option), else ``$FLEXDISPATCH_DEVICE`` (default
    ``auto``)."""
    if cpu_flag:
        return "cpu"
    value = os.environ.get(DEVICE_ENV, "").strip().lower() or "auto"
    if value not in DEVICE_CHOICES:
        given = os.environ.get(DEVICE_ENV, "")
        fix = f"set it to {', '.join(DEVICE_CHOICES)} (or unset it for auto)"
        raise InputError(
            f"${DEVICE_ENV}={excerpt(given)} is not a device: {fix}",
            option=f"${DEVICE_ENV}",
            value=given,
            problem="is not a device",
            fix=fix,
        )
    return value


def plan_devices(
    ranks_per_node: int,
    *,
    device: str | None = None,
    gpus: int | None = None,
    gpus_source: str = "given",
    ranks_hint: str = "fewer ranks per node",
    cpu_hint: str = f"{DEVICE_ENV}=cpu",
) -> DevicePlan:
    """Backend and device for ``ranks_per_node`` ranks on this machine (see the module docstring).

    Args:
        ranks_per_node: L, the ranks this machine runs.
        device: ``auto``, ``cpu`` or ``cuda`` (default: ``requested_device()``).
        gpus: G (default: ``visible_gpus()``).
        gpus_source: where a given ``gpus`` comes from (for the messages).
        ranks_hint: how the caller's user asks for fewer ranks (e.g. ``--ranks-per-node 1``
            style text, ``NPROC_PER_NODE``); ``{gpus}`` is replaced by G.
        cpu_hint: how the caller's user asks for the CPU (e.g. ``--cpu``).

    Raises:
        ValueError: L < 1; more ranks than GPUs with the GPUs in use; ``cuda`` without a GPU.
            The message is one line: L, G, what to pass.
    """
    if ranks_per_node < 1:
        raise ValueError(f"ranks per node must be >= 1, got {ranks_per_node}")
    device = requested_device() if device is None else device
    if device not in DEVICE_CHOICES:
        raise ValueError(f"device={device!r} is not one of {', '.join(DEVICE_CHOICES)}")
    source = gpus_source
    if gpus is None:
        gpus, source = visible_gpus()
    L, G = ranks_per_node, gpus
    if device == "cpu":
        return DevicePlan("gloo", "cpu", L, G, "the CPU was asked for: gloo, ranks on the CPU")
    if G == 0:
        if device == "cuda":
            raise InputError(
                f"{L} rank(s) on this machine asked for the GPUs, but no GPU is visible "
                f"({source}): unset {DEVICE_ENV} or pass {cpu_hint} to run on gloo/CPU",
                option=f"${DEVICE_ENV}",
                value="cuda",
                problem=f"no GPU is visible ({source})",
                fix=f"unset it, or pass {cpu_hint}",
            )
        return DevicePlan("gloo", "cpu", L, G, f"no GPU visible ({source}): gloo on the CPU")
    if L > G:
        fewer = ranks_hint.replace("{gpus}", str(G))
        raise InputError(
            f"{L} rank(s) on this machine but only {G} GPU(s) visible ({source}): pass {fewer} "
            f"for one rank per GPU, or {cpu_hint} to run on gloo/CPU",
            problem=f"{L} rank(s) on this machine but only {G} GPU(s) visible ({source})",
            fix=f"pass {fewer}, or {cpu_hint.split(' (')[0]}",
        )
    gpus_used = "cuda:0" if L == 1 else f"cuda:0..cuda:{L - 1}"
    return DevicePlan("nccl", "cuda", L, G, f"NCCL, one rank per GPU ({gpus_used})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m flexdispatch.launch.devices",
        description="Check that L ranks per node fit the GPUs of this machine, before torchrun.",
    )
    p.add_argument("--ranks", type=int, required=True, help="ranks (processes) on this node")
    p.add_argument("--cpu", action="store_true", help="run on gloo/CPU even with GPUs visible")
    p.add_argument(
        "--ranks-hint",
        default="NPROC_PER_NODE={gpus}",
        help="how to ask for fewer ranks, in the refusal ({gpus} is replaced by the GPU count)",
    )
    p.add_argument(
        "--cpu-hint", default=f"{DEVICE_ENV}=cpu", help="how to ask for the CPU, in the refusal"
    )
    p.add_argument("--quiet", action="store_true", help="print nothing unless refused")
    args = p.parse_args(argv)
    try:
        plan = plan_devices(
            args.ranks,
            device=requested_device(args.cpu),
            ranks_hint=args.ranks_hint,
            cpu_hint=args.cpu_hint,
        )
    except ValueError as exc:
        print(f"flexdispatch: refused: {exc}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(f"flexdispatch: {plan.line()}", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
