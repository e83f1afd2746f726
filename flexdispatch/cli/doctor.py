"""``flexdispatch doctor``: what this machine offers and which backend ``auto`` would pick.

Shape letters (ARCHITECTURE.md): H hidden · R ranks · L ranks per node · N = R / L nodes.

Usage::

    flexdispatch doctor [--json] [--world-size R] [--ranks-per-node L]
        [--backend auto|torch|deepep] [--hidden H]

Reports torch, CUDA, NCCL, gloo, the GPUs, whether ``deep_ep`` imports (with the exact error when
it does not), which DeepEP generations import (V1, V2, V2.5) and DeepEP 2.5's run-time needs
(nvcc, a C++20 compiler, NCCL, ibstat / nvidia-smi, each with its fix), NVSHMEM through
nvshmem4py (imported, never initialised), the launcher's environment, and what ``--backend``
would run for R ranks with L per node and why. Exits 0 when
the requested backend can work, 1 when it cannot, 2 on bad arguments. ``--json`` prints the report
of ``flexdispatch.doctor.run_doctor`` (schema ``flexdispatch.doctor/1``; the keys are listed in
that module's docstring and in docs/cli.md).
"""

from __future__ import annotations

import argparse
import json

from flexdispatch.cli._common import int_range

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``doctor`` sub-command to ``sub``."""
    from flexdispatch.doctor import BACKEND_CHOICES, DEEPEP_API_CHOICES

    p = sub.add_parser(
        "doctor",
        help="report torch/CUDA/NCCL/gloo/GPUs/deep_ep/NVSHMEM and the backend auto would pick",
        description="Probe this machine (torch, CUDA, NCCL, gloo, GPUs, deep_ep, NVSHMEM) and say "
        "which backend the request would run for R ranks with L per node, and why. Exit 1 when "
        "the requested backend cannot work.",
    )
    p.add_argument(
        "--world-size",
        type=int_range(1),
        default=None,
        help="R, expert-parallel ranks (default: $WORLD_SIZE, else the local GPU count, else 1)",
    )
    p.add_argument(
        "--ranks-per-node",
        type=int_range(1),
        default=None,
        help="L (default: $LOCAL_WORLD_SIZE, else the local GPU count, else R)",
    )
    p.add_argument("--backend", default="auto", choices=BACKEND_CHOICES)
    p.add_argument(
        "--hidden",
        type=int_range(1),
        default=None,
        help="H, to check DeepEP's row-size rule (bf16 rows)",
    )
    p.add_argument(
        "--deepep-api",
        default="auto",
        choices=[*DEEPEP_API_CHOICES, "legacy", "elastic", "ep"],
        help="DispatchConfig.deepep_api: which DeepEP release (v1 / v2 / v25; the names before "
        "0.1, legacy / elastic / ep, are read as these) to report on",
    )
    p.add_argument(
        "--num-worst-tokens",
        type=int_range(0),
        default=0,
        help="DispatchConfig.num_worst_tokens W of the dispatch to report on (deepep_api='auto' "
        "runs DeepEP V2 in worst-case mode where deep_ep has ElasticBuffer)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the report; 0 when the requested backend can work, else 1."""
    from flexdispatch.doctor import format_report, run_doctor

    report = run_doctor(
        world_size=args.world_size,
        ranks_per_node=args.ranks_per_node,
        backend=args.backend,
        hidden=args.hidden,
        deepep_api=args.deepep_api,
        num_worst_tokens=args.num_worst_tokens,
    )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    return 0 if report["ok"] else 1
