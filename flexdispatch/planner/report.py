"""Human-readable report and plot of a ``ClusterPlan``.

Shape letters (ARCHITECTURE.md): T tokens per rank · H hidden · E experts · R ranks · e = E / R ·
k top-k · L ranks per node · N nodes · M received rows · W worst-case rows.

The table summarises over ranks (min / mean / max and the hottest few) instead of printing one row
per rank, so it stays readable at EP=256. ``plot_plan`` needs the optional ``plot`` extra
(matplotlib); it is imported lazily and draws on an Agg canvas (no global backend change).
"""

from __future__ import annotations

import io
from pathlib import Path

import torch

from flexdispatch._checks.files import check_output_path, write_file
from flexdispatch._checks.sysmem import format_bytes
from flexdispatch.planner.results import ClusterPlan, Stat, VariantPlan

__all__ = ["format_plan", "plot_plan", "format_bytes", "MAX_BARS", "MAX_MAP_RANKS"]

MAX_BARS = 256
"""``plot_plan`` draws at most this many expert bars (more experts: bins of consecutive ones)."""
MAX_MAP_RANKS = 256
"""``plot_plan``'s heatmap has at most this many rows and columns (more ranks: groups, summed)."""
MAX_NODE_LINES = 64
"""Node boundaries are drawn on the heatmap up to this many nodes."""

_PER_NODE_LIMIT = 16


def _grouping(v: VariantPlan) -> str:
    return "-" if v.num_groups is None else f"{v.group_topk} of {v.num_groups}"


def _mmm(s: Stat, digits: int = 0) -> str:
    return f"{s.min:,.{digits}f}/{s.mean:,.{digits}f}/{s.max:,.{digits}f}"


def _load_table(plan: ClusterPlan) -> list[str]:
    lines = [
        "Load per routing variant (rows: one per (token, destination rank); imb = max/mean)",
        f"{'variant':<13} {'groups':<9} {'ranks/tok':>9} {'nodes/tok':>9}  "
        f"{'rows/rank min/mean/max':>26} {'imb':>5} {'pairs imb':>9} {'expert imb':>10}",
    ]
    for v in plan.variants:
        rows = Stat.of(torch.tensor(v.recv_rows))
        pairs = Stat.of(torch.tensor(v.recv_pairs))
        experts = Stat.of(torch.tensor(v.tokens_per_expert))
        lines.append(
            f"{v.name:<13} {_grouping(v):<9} {v.avg_ranks_per_token:>9.2f} "
            f"{v.avg_nodes_per_token:>9.2f}  {_mmm(rows):>26} {rows.imbalance:>5.2f} "
            f"{pairs.imbalance:>9.2f} {experts.imbalance:>10.2f}"
        )
    return lines


def _traffic_table(plan: ClusterPlan) -> list[str]:
    lines = [
        "Bytes sent per rank (max over ranks) and estimated time of the slowest rank",
        f"  NVLink {plan.nvlink_gbps:g} GB/s, RDMA {plan.rdma_gbps:g} GB/s per rank; flat and "
        "deepep overlap the links (max), hierarchical runs its two hops in turn (sum)",
        f"{'variant':<13} {'transport':<12} {'row B d/c':>11}  {'disp NVL':>10} {'disp RDMA':>10}"
        f"  {'comb NVL':>10} {'comb RDMA':>10}  {'disp us':>8} {'comb us':>8}",
    ]
    for v in plan.variants:
        if v.same_as is not None:
            lines.append(f"{v.name:<13} same grouping as {v.same_as}")
            continue
        for m in v.traffic:
            fmt = m.row_format
            d, c = m.dispatch, m.combine
            lines.append(
                f"{v.name:<13} {m.mode:<12} {fmt.dispatch_bytes:>5}/{fmt.combine_bytes:<5}  "
                f"{format_bytes(max(d.nvlink_bytes)):>10} {format_bytes(max(d.rdma_bytes)):>10}  "
                f"{format_bytes(max(c.nvlink_bytes)):>10} {format_bytes(max(c.rdma_bytes)):>10}  "
                f"{d.time_us:>8.1f} {c.time_us:>8.1f}"
            )
    return lines


def _variant_details(plan: ClusterPlan, v: VariantPlan, top: int) -> list[str]:
    lines = [f"Variant {v.name} ({_grouping(v)} groups) in detail"]
    if plan.nodes <= _PER_NODE_LIMIT:
        per_node = ", ".join(
            f"n{n}: {rows:,} ({rdma:,} via RDMA)"
            for n, (rows, rdma) in enumerate(
                zip(v.node_recv_rows, v.node_rdma_rows_in, strict=True)
            )
        )
        lines.append(f"  rows received per node: {per_node}")
    else:
        node = Stat.of(torch.tensor(v.node_recv_rows))
        rdma = Stat.of(torch.tensor(v.node_rdma_rows_in))
        lines.append(
            f"  rows received per node min/mean/max: {_mmm(node)} (imb {node.imbalance:.2f}); "
            f"entering over RDMA: {_mmm(rdma)}"
        )
    hot_ranks = ", ".join(f"r{r}: {n:,}" for r, n in v.hot_ranks(top))
    hot_experts = ", ".join(f"x{x}: {n:,}" for x, n in v.hot_experts(top))
    lines.append(f"  hottest ranks (rows): {hot_ranks}")
    lines.append(f"  hottest experts (pairs): {hot_experts}")
    w = v.worst_case
    lines.append(
        f"  worst-case W: observed max M = {w.observed_max_recv_rows:,} rows -> DeepEP "
        f"W >= {w.deepep_w:,} (intranode only; its test uses T*R = {w.deepep_test_w:,}); "
        f"torch flat W >= {w.torch_flat_w:,}; torch hierarchical W >= {w.torch_hier_w:,} "
        f"(add headroom)"
    )
    T = plan.tokens_per_rank
    v1_per_rank = w.deepep_w // plan.num_ranks
    v1 = (
        f"; V1's W = {w.deepep_w:,} gives W/R = {v1_per_rank:,} < T: refused"
        if v1_per_rank < T
        else ""
    )
    lines.append(
        f"  DeepEP V2 (deepep_api='v2') worst-case W >= T*R = {w.deepep_v2_w:,} "
        f"(W/R = {T:,} slots per source rank must hold its T tokens; intranode and across "
        f"nodes{v1})"
    )
    return lines


def _deepep_lines(plan: ClusterPlan) -> list[str]:
    d = plan.deepep
    head = (
        f"DeepEP buffers (hidden_bytes = H*{d.hidden_bytes // plan.hidden_size} = "
        f"{d.hidden_bytes}, {d.num_sms} SMs)"
    )
    lines = [head]
    if d.num_nvl_bytes is None or d.num_rdma_bytes is None:
        lines.append(f"  normal kernels: no tuned config for R={plan.num_ranks}")
    else:
        lines.append(
            f"  num_nvl_bytes = {d.num_nvl_bytes:,} ({format_bytes(d.num_nvl_bytes)}; dispatch "
            f"{d.nvl_bytes_dispatch:,}, combine {d.nvl_bytes_combine:,}); num_rdma_bytes = "
            f"{d.num_rdma_bytes:,} ({format_bytes(d.num_rdma_bytes)})"
        )
    lines.append(
        f"  low-latency ({d.ll_max_tokens} tokens/rank): num_rdma_bytes = {d.ll_rdma_bytes:,} "
        f"({format_bytes(d.ll_rdma_bytes)})"
    )
    if not d.supported:
        lines.append(f"  normal kernels do not fit this cluster: {d.reason}")
    return lines


def _elastic_lines(plan: ClusterPlan) -> list[str]:
    v2 = plan.deepep_elastic
    s, w = v2.dropless, v2.worst_case
    links = "one NVLink domain" if s.scaleup_nvlink else "not one NVLink domain: RDMA too"
    lines = [
        "DeepEP V2 buffer (ElasticBuffer.get_buffer_size_hint as deepep_api='v2' sizes it: "
        "direct mode, multiple reduction, bf16-sized)",
        f"  domains: physical {s.num_rdma_ranks} x {s.num_nvl_ranks} (NVLink domains x ranks), "
        f"logical {s.num_scaleout_ranks} scale-out x {s.num_scaleup_ranks} scale-up ({links}); "
        f"hidden = {v2.hidden} bf16 columns (dispatch {v2.dispatch_hidden}, combine "
        f"{v2.combine_hidden}), k = {s.num_topk}",
        f"  dropless (M = num_max_dispatch_tokens_per_rank = T = {s.num_max_tokens_per_rank:,}): "
        f"num_bytes = {s.num_bytes:,} ({format_bytes(s.num_bytes)}; dispatch "
        f"{s.dispatch_bytes:,}, combine {s.combine_bytes:,})",
        f"  worst-case (num_worst_tokens = T*R = {v2.worst_case_w:,}, M = W/R = "
        f"{w.num_max_tokens_per_rank:,}; intranode and across nodes, unlike V1): num_bytes = "
        f"{w.num_bytes:,} ({format_bytes(w.num_bytes)})",
    ]
    if not v2.supported:
        lines.append(f"  V2 kernels do not fit this shape: {v2.reason}")
    return lines


def format_plan(plan: ClusterPlan, *, top: int = 5) -> str:
    """The compact human report printed by ``flexdispatch plan`` (no per-rank rows)."""
    head = [
        f"flexdispatch plan: {plan.preset} on {plan.nodes} node(s) x {plan.ranks_per_node} "
        f"ranks = R {plan.num_ranks}, e = {plan.experts_per_rank} expert(s)/rank (E = "
        f"{plan.num_experts}, k = {plan.topk}, H = {plan.hidden_size})",
        f"  T = {plan.tokens_per_rank:,} tokens/rank ({plan.total_tokens:,} total), skew "
        f"{plan.skew:g}, seed {plan.seed}, rows of {plan.elem_size} B/elem; simulated in "
        f"{plan.wall_s:.1f} s",
    ]
    blocks = [head, _load_table(plan), _traffic_table(plan)]
    for v in plan.variants:
        if v.same_as is None:
            blocks.append(_variant_details(plan, v, top))
    blocks.append(_deepep_lines(plan))
    blocks.append(_elastic_lines(plan))
    if plan.notes:
        blocks.append(["Notes", *(f"  {n}" for n in plan.notes)])
    return "\n\n".join("\n".join(b) for b in blocks) + "\n"


def plot_plan(plan: ClusterPlan, path: str | Path, *, variant: str = "preset") -> Path:
    """Save a rank x rank heatmap of flat dispatch bytes and the per-expert load bars as PNG.

    Args:
        plan: the plan to draw.
        path: output file (``.png``; a name without an extension gets ``.png``).
        variant: which routing variant to draw.

    Returns:
        The path written.

    Raises:
        ImportError: matplotlib is not installed (``pip install flexdispatch[plot]``).
        ValueError: unknown variant; ``path`` is not a regular file (a folder, a device such as
            ``/dev/null``, a FIFO, a ``/proc`` file) or cannot be written.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise ImportError(
            "flexdispatch plan --plot needs matplotlib: pip install 'flexdispatch[plot]'"
        ) from exc
    v = plan.variant(variant)
    flat = v.mode("flat")
    bytes_RR = (v.rows_SR * flat.row_format.dispatch_bytes).double()
    bytes_RR.fill_diagonal_(0.0)  # self-sends are not traffic
    R, L = plan.num_ranks, plan.ranks_per_node
    # NOTE: a large cluster is drawn in groups of g ranks (sums), at most MAX_MAP_RANKS a side
    g = -(-R // MAX_MAP_RANKS)
    if g > 1:
        pad = -R % g
        padded = torch.nn.functional.pad(bytes_RR, (0, pad, 0, pad))
        bytes_RR = padded.view(-(-R // g), g, -(-R // g), g).sum((1, 3))
    fig = Figure(figsize=(13, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_map, ax_bar = fig.subplots(1, 2, width_ratios=[1, 1.3])
    image = ax_map.imshow(bytes_RR.numpy() / 2**20, cmap="viridis", interpolation="nearest")
    ax_map.set_title(f"flat dispatch MiB, source rank -> destination ({v.name})")
    ax_map.set_xlabel("destination rank" if g == 1 else f"destination ranks, {g} a cell (sum)")
    ax_map.set_ylabel("source rank" if g == 1 else f"source ranks, {g} a cell")
    if g == 1 and R // L <= MAX_NODE_LINES:
        for b in range(L, R, L):
            ax_map.axhline(b - 0.5, color="white", linewidth=0.4)
            ax_map.axvline(b - 0.5, color="white", linewidth=0.4)
    ax_map.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_map.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.colorbar(image, ax=ax_map, shrink=0.8)
    per_expert = torch.tensor(v.tokens_per_expert, dtype=torch.float64)
    E, e = plan.num_experts, plan.experts_per_rank
    mean = float(per_expert.mean()) if E else 0.0
    # NOTE: many experts are drawn as MAX_BARS bars of b consecutive experts each (the hottest
    # one's load, the bin's mean as a step line): one bar each would take minutes to draw
    b = -(-E // MAX_BARS)
    if b > 1:
        pad = -E % b
        bins = torch.nn.functional.pad(per_expert, (0, pad), value=float("nan")).view(-1, b)
        heights = bins.nan_to_num(float("-inf")).amax(1)
        means = bins.nanmean(1)
        firsts = range(0, E, b)
        colors = [f"C{(x // e) // L % 10}" for x in firsts]
        ax_bar.bar(range(len(heights)), heights.tolist(), width=1.0, color=colors)
        ax_bar.stairs(means.tolist(), [i - 0.5 for i in range(len(means) + 1)], color="black",
                      linewidth=0.6)  # fmt: skip
        ax_bar.set_title(f"pairs per expert, {b} experts a bar: max (bar), mean (steps)")
        ax_bar.set_xlabel(f"experts / {b}")
    else:
        colors = [f"C{(x // e) // L % 10}" for x in range(E)]
        ax_bar.bar(range(E), per_expert.tolist(), width=1.0, color=colors)
        ax_bar.set_title("(token, expert) pairs per expert (colour = node; line = mean)")
        ax_bar.set_xlabel("expert")
    ax_bar.axhline(mean, color="black", linewidth=0.8)
    ax_bar.set_ylabel("pairs")
    fig.suptitle(
        f"{plan.preset}: {plan.nodes} x {plan.ranks_per_node} ranks, T={plan.tokens_per_rank}, "
        f"skew {plan.skew:g}"
    )
    # NOTE: the path as given, before the suffix: `/dev/null` is refused, not `/dev/null.png`
    out = check_output_path(path, f"plot file {path}", "out.png")
    if not out.suffix:  # NOTE: matplotlib would write NAME.png; say so
        out = out.with_name(out.name + ".png")
    # NOTE: rendered in memory, then written to a regular file only: never /dev/null.png, a FIFO
    # or a /proc file (flexdispatch._checks.files.write_file)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format=out.suffix[1:].lower())
    write_file(out, buf.getvalue(), f"plot file {out}")
    return out
