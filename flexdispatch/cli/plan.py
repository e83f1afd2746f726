"""``flexdispatch plan``: size an expert-parallel cluster for a preset, in one process, no GPU.

Shape letters (ARCHITECTURE.md): T tokens per rank · H hidden · E experts · R ranks · e = E / R
local experts · k top-k · L ranks per node · N nodes · M received rows · W worst-case rows.

Usage::

    flexdispatch plan --preset deepseek_v3 --nodes 32 --ranks-per-node 8 [--tokens 4096]
        [--skew 0.5] [--seed 0] [--json] [--plot traffic.png] [--nvlink-gbps 155]
        [--rdma-gbps 50] [--dtype bf16] [--num-sms 20] [--ll-tokens 128]

It simulates the preset's routing on synthetic logits (``flexdispatch.planner.plan_cluster``) and
reports load, bytes per link class for the flat / hierarchical / DeepEP transports, estimated
times, DeepEP buffer hints (V1 ``Buffer``; V2 ``ElasticBuffer`` as ``deepep_api='v2'`` would
size it) and worst-case W suggestions. The default output is a compact table;
``--plot`` writes a rank x rank traffic heatmap and expert-load bars (needs
``pip install 'flexdispatch[plot]'``).

``--json`` prints one JSON object with these stable keys (schema ``flexdispatch.plan/1``):

- ``schema``, ``preset``, ``num_experts`` (E), ``topk`` (k), ``hidden_size`` (H), ``nodes`` (N),
  ``ranks_per_node`` (L), ``num_ranks`` (R), ``experts_per_rank`` (e), ``tokens_per_rank`` (T),
  ``total_tokens``, ``skew``, ``seed``, ``elem_size``, ``bandwidth_gbps`` {``nvlink``, ``rdma``},
  ``wall_s`` (simulation time), ``notes`` (list of strings).
- ``variants``: list, one per routing variant, each with ``name`` (``preset`` | ``ungrouped`` |
  ``node_limited``), ``num_groups``, ``group_topk`` (null = ungrouped), ``same_as`` (null or
  the name of a variant with the same grouping), ``note``, and:

  - ``load``: ``recv_rows``, ``recv_pairs``, ``tokens_per_expert``, ``node_recv_rows``,
    ``node_rdma_rows_in`` — each ``{min, mean, max, imbalance}`` (imbalance = max/mean);
    ``avg_ranks_per_token``, ``avg_nodes_per_token``; ``hot_ranks`` / ``hot_experts``
    (``[[id, count], ...]``, hottest first); ``per_rank_recv_rows`` ``[R]``,
    ``per_node_recv_rows`` ``[N]``, ``per_expert_tokens`` ``[E]``.
  - ``traffic``: ``flat``, ``hierarchical``, ``deepep``, each with ``dispatch_row_bytes``,
    ``combine_row_bytes``, ``row_format`` (what was counted), ``link_pattern`` (``flat`` |
    ``hierarchical``), ``overlap`` (``max`` | ``sum``) and ``dispatch`` / ``combine``:
    ``nvlink_bytes``, ``rdma_bytes``, ``nvlink_recv_bytes``, ``rdma_recv_bytes`` (each
    ``{min, mean, max, imbalance}`` over ranks), ``total_nvlink_bytes``, ``total_rdma_bytes``,
    ``time_us`` (slowest rank).
  - ``worst_case``: ``observed_max_recv_rows``, ``deepep_w`` (V1, intranode only),
    ``deepep_test_w``, ``torch_flat_w``, ``torch_hier_w``, ``deepep_v2_w`` (V2, ``T * R``:
    ``W / R`` must hold each rank's T tokens; intranode and across nodes).
- ``deepep``: ``supported``, ``reason``, ``num_sms``, ``hidden_bytes``, ``dispatch_config`` /
  ``combine_config`` (``[num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv]`` or null),
  ``num_nvl_bytes``, ``nvl_bytes_dispatch``, ``nvl_bytes_combine``, ``num_rdma_bytes``,
  ``rdma_bytes_dispatch``, ``rdma_bytes_combine`` (null without a tuned config), ``low_latency``
  {``max_tokens_per_rank``, ``rdma_bytes``}, and ``elastic``: DeepEP V2
  (``ElasticBuffer.get_buffer_size_hint``) as flexdispatch's ``deepep_api='v2'`` path sizes
  it: ``supported``, ``reason``, ``mode`` (``direct``), ``use_fp8_dispatch`` (false: a bf16-sized
  buffer), ``allow_hybrid_mode`` (false), ``allow_multiple_reduction`` (true); the domains
  ``num_rdma_ranks`` x ``num_nvl_ranks`` (physical: NVLink domains of L ranks) and
  ``num_scaleout_ranks`` x ``num_scaleup_ranks`` (logical, direct: 1 x R), ``scaleup_nvlink``
  (one NVLink domain); ``num_topk``, ``elem_size``, ``dispatch_hidden`` / ``combine_hidden`` /
  ``hidden`` (bf16 columns; the buffer is sized for the larger), ``dispatch_token_bytes``,
  ``combine_token_bytes``; ``dropless`` {``num_max_tokens_per_rank`` (= T), ``num_bytes``,
  ``dispatch_bytes``, ``combine_bytes``} and ``worst_case`` {``num_worst_tokens`` (= T * R),
  the same four at ``M = W / R``}.
"""

from __future__ import annotations

import argparse
import json
import sys

from flexdispatch.cli._common import (
    CliError,
    check_output_path,
    int_range,
    nonnegative_float,
    one_line,
    option_scope,
    positive_float,
)
from flexdispatch.config import load_config

__all__ = ["register", "run"]

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``plan`` sub-command to ``sub``."""
    from flexdispatch.planner import DEFAULT_NVLINK_GBPS, DEFAULT_RDMA_GBPS

    p = sub.add_parser(
        "plan",
        help="simulate a preset's routing on a cluster: load, bytes per link, buffer sizes",
        description="Simulate routing at cluster scale (one process, no GPU) and report load, "
        "NVLink/RDMA bytes per rank for flat, hierarchical and DeepEP transports, estimated "
        "times, DeepEP buffer hints (V1 Buffer and V2 ElasticBuffer) and worst-case W.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="preset name (see `flexdispatch presets`)")
    src.add_argument("--config", help="path of a MoEConfig YAML file")
    p.add_argument("--nodes", type=int_range(1), required=True, help="N, number of nodes")
    p.add_argument(
        "--ranks-per-node", type=int_range(1), required=True, help="L, EP ranks per node"
    )
    p.add_argument(
        "--tokens",
        type=int_range(1, 10**15),
        default=4096,
        help="T, tokens per rank (default 4096)",
    )
    p.add_argument(
        "--skew",
        type=nonnegative_float,
        default=0.0,
        help="expert-popularity skew added to the logits (0 = uniform; default 0)",
    )
    p.add_argument("--seed", type=int_range(0), default=0, help="random seed, >= 0 (default 0)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="write a traffic heatmap + expert bars")
    p.add_argument(
        "--nvlink-gbps",
        type=positive_float,
        default=DEFAULT_NVLINK_GBPS,
        help=f"NVLink GB/s per rank (default {DEFAULT_NVLINK_GBPS:g}, DeepEP H800)",
    )
    p.add_argument(
        "--rdma-gbps",
        type=positive_float,
        default=DEFAULT_RDMA_GBPS,
        help=f"RDMA GB/s per rank (default {DEFAULT_RDMA_GBPS:g}, DeepEP H800 EP16-64)",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(_DTYPE_BYTES),
        default="bf16",
        help="dtype of the rows the torch backend and the DeepEP V2 path move (default bf16)",
    )
    p.add_argument("--num-sms", type=int, default=20, help="DeepEP Buffer.num_sms (default 20)")
    p.add_argument(
        "--ll-tokens",
        type=int_range(1),
        default=128,
        help="low-latency num_max_dispatch_tokens_per_rank for its buffer hint (default 128)",
    )
    p.add_argument(
        "--exact",
        action="store_true",
        help="route every token (default: above 2^24 simulated logits, each rank routes a sample "
        "of its tokens and the counts are scaled; the notes say so)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


class LateProgress:
    """A progress bar on stderr that appears only once the work has taken ``after_s`` seconds
    (on a terminal, or with ``FLEXDISPATCH_PROGRESS=1``)."""

    def __init__(self, label: str, *, after_s: float = 2.0, enabled: bool = True) -> None:
        import os
        import time

        self._clock = time.perf_counter
        self._t0 = self._clock()
        self.after_s = after_s
        self.label = label
        forced = os.environ.get("FLEXDISPATCH_PROGRESS", "") == "1"
        self.enabled = enabled and (forced or sys.stderr.isatty())
        self.drawn = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or self._clock() - self._t0 < self.after_s:
            return
        width = 30
        filled = width * done // max(1, total)
        bar = "#" * filled + "." * (width - filled)
        elapsed = self._clock() - self._t0
        sys.stderr.write(f"\r[{self.label}] |{bar}| {done}/{total} {elapsed:5.1f}s")
        sys.stderr.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            sys.stderr.write("\n")
            sys.stderr.flush()


def run(args: argparse.Namespace) -> int:
    """Run ``flexdispatch plan``; ValueError (printed by the CLI) on bad input."""
    from flexdispatch.planner import MAX_LOGITS, format_plan, plan_cluster, plot_plan

    if args.plot:
        check_output_path(args.plot, "--plot", "out.png")
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:  # NOTE: before the work, not after
            raise CliError(
                "needs matplotlib",
                option="--plot",
                value=args.plot,
                fix="pip install 'flexdispatch[plot]'",
                exit_code=2,
            )
    source = ("--preset", args.preset) if args.preset is not None else ("--config", args.config)
    with option_scope(*source):
        cfg = load_config(source[1])
    if args.num_sms <= 0 or args.num_sms % 2:
        raise ValueError(f"--num-sms must be a positive even number, got {args.num_sms}")
    if args.ll_tokens <= 0:
        raise ValueError(f"--ll-tokens must be positive, got {args.ll_tokens}")
    R = args.nodes * args.ranks_per_node
    if cfg.router.num_experts % R:
        raise CliError(
            f"num_experts={cfg.router.num_experts} is not divisible by R = nodes x "
            f"ranks_per_node = {args.nodes} x {args.ranks_per_node} = {R}",
            option=f"--nodes {args.nodes} --ranks-per-node",
            value=args.ranks_per_node,
            fix="pick a cluster whose rank count divides the experts",
            exit_code=2,
        )
    bar = LateProgress("plan", enabled=not getattr(args, "no_progress", False))
    scope = option_scope(
        "--tokens",
        args.tokens,
        args={"nodes x ranks_per_node": ("--nodes", args.nodes), "num_experts": source},
    )
    with scope:
        plan = plan_cluster(
            cfg,
            nodes=args.nodes,
            ranks_per_node=args.ranks_per_node,
            tokens=args.tokens,
            skew=args.skew,
            seed=args.seed,
            elem_size=_DTYPE_BYTES[args.dtype],
            nvlink_gbps=args.nvlink_gbps,
            rdma_gbps=args.rdma_gbps,
            num_sms=args.num_sms,
            ll_max_tokens=args.ll_tokens,
            max_logits=None if getattr(args, "exact", False) else MAX_LOGITS,
            progress=bar,
        )
    bar.close()
    if args.plot:
        try:
            with option_scope("--plot", args.plot):
                path = plot_plan(plan, args.plot)
        except ImportError as exc:
            raise CliError(
                one_line(exc),
                option="--plot",
                value=args.plot,
                fix="pip install 'flexdispatch[plot]'",
                exit_code=2,
            ) from None
        if not args.json:
            print(f"plot written to {path}")
    if args.json:
        print(json.dumps(plan.as_dict(), indent=1))
    else:
        print(format_plan(plan), end="")
    return 0
