"""``flexdispatch demo``: an expert-parallel MoE layer, forward and backward, checked end to end.

By default it spawns a simulated group on this machine: on a GPU machine one rank per GPU over
NCCL, else 2 nodes × 2 ranks over gloo on the CPUs (``--cpu`` forces that). Under ``torchrun``
it joins the group the launcher set up (NCCL on GPUs, gloo otherwise). More ranks than GPUs is
refused before any process starts (``flexdispatch.launch.devices``). Each rank runs ``MoELayer``
forward and backward in the flat and the hierarchical mode; the results are compared with a
single-process dense reference (every rank's tokens routed by the same router and sent through
every expert in one process), and a report is printed.

R ranks · L ranks per node · N nodes · T tokens per rank · H hidden · E experts · e = E / R.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Iterable
from typing import Any

import torch

from flexdispatch._checks.errors import InputError
from flexdispatch._checks.sysmem import format_bytes
from flexdispatch.cli._common import int_range, json_text, memory_size, timeout_seconds
from flexdispatch.cli.demo_inputs import (
    _MODES,
    DemoSpec,
    _layer_config,
    demo_config,
    global_inputs,
    global_token_ids,
)

__all__ = ["DemoSpec", "register", "run", "run_rank", "check_against_reference"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run an expert-parallel MoE layer on a simulated group and check it",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument(
        "--nodes",
        type=int_range(1),
        default=None,
        help="simulated nodes (default 2 on the CPU; on GPUs see --ranks-per-node)",
    )
    p.add_argument(
        "--ranks-per-node",
        type=int_range(1),
        default=None,
        help="ranks per node (default 2 on the CPU; on a GPU machine, without --nodes either: "
        "one rank per GPU, as 2 nodes when the GPUs split evenly)",
    )
    p.add_argument(
        "--cpu",
        action="store_true",
        help="run on gloo/CPU even when GPUs are visible (also: FLEXDISPATCH_DEVICE=cpu)",
    )
    p.add_argument("--preset", default="tiny_cpu", help="preset name or YAML path")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "deepep"))
    p.add_argument("--tokens", type=int_range(0), default=64, help="tokens per rank (default 64)")
    p.add_argument("--seed", type=int_range(0), default=0, help="random seed, >= 0 (default 0)")
    p.add_argument(
        "--iters", type=int_range(1), default=3, help="timed iterations per mode (default 3)"
    )
    p.add_argument(
        "--worst-case",
        action="store_true",
        help="use the static-shape worst-case mode (num_worst_tokens = R * T)",
    )
    p.add_argument(
        "--timeout",
        type=timeout_seconds,
        default=300.0,
        help="seconds before giving up (0.001 to 2147483)",
    )
    p.add_argument(
        "--max-memory",
        type=memory_size,
        default=None,
        metavar="SIZE",
        help="memory the whole demo may use, runtime included, e.g. 4GiB or 512MiB (default "
        "4GiB, never more than 80%% of the memory available): larger presets are shrunk to fit "
        "(hidden and expert sizes, then tokens), and refused up front when they cannot",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


_VERBOSE = {"on": False}  # NOTE: set by run() from --verbose; read by the progress lines


def _progress(msg: str) -> None:
    """A step of the demo on stderr: a line with ``--verbose``, else a status line on a terminal
    (``flexdispatch.cli._common.status``), nothing otherwise."""
    from flexdispatch.cli._common import status

    status("demo", msg, _VERBOSE["on"])


# --------------------------------------------------------------------------- one rank


def run_rank(spec: DemoSpec) -> dict[str, Any]:
    """Body of one rank (the process group is already initialised). Returns CPU tensors."""
    import torch.distributed as dist

    from flexdispatch.distributed import collective_guard, local_world_size
    from flexdispatch.moe import MoELayer

    R, rank = dist.get_world_size(), dist.get_rank()
    L = local_world_size() or R
    device = torch.device("cpu")
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        # NOTE: bound by whoever started the rank (spawn_group: cuda:rank; torchrun: LOCAL_RANK).
        device = torch.device("cuda", torch.cuda.current_device())
    out: dict[str, Any] = {"rank": rank, "world": R, "ranks_per_node": L, "modes": {}}
    out["device_type"] = device.type  # NOTE: the layers draw their experts there
    for mode in _MODES:
        cfg = _layer_config(spec, mode, R, L)
        layer = MoELayer(cfg, seed=spec.seed, device=device)
        x_all, g_all = global_inputs(spec, R, cfg.hidden_size)
        x = x_all[rank].to(device).requires_grad_(True)
        g = g_all[rank].to(device)
        ids = global_token_ids(spec, R)[rank].to(device)
        del x_all, g_all
        times_f, times_b = [], []
        for it in range(spec.iters):
            layer.zero_grad(set_to_none=True)
            x.grad = None
            with collective_guard("barrier (demo timing loop)"):
                dist.barrier()
            t0 = time.perf_counter()
            res = layer(x, token_ids=ids)
            t1 = time.perf_counter()
            (res.output * g).sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            if it > 0 or spec.iters == 1:
                times_f.append(t1 - t0)
                times_b.append(t2 - t1)
        stats = layer.dispatcher.stats.as_dict()
        calls = max(1, stats["dispatch_calls"])
        out["backend"] = layer.dispatcher.backend_name
        out["backend_reason"] = layer.dispatcher.backend_reason
        out["modes"][mode] = {
            "output": res.output.detach().cpu(),
            "grad_x": x.grad.detach().cpu(),
            "grad_router": _grads(layer.router),
            "grad_experts": _grads(layer.experts),
            "grad_shared": {} if layer.shared_experts is None else _grads(layer.shared_experts),
            "tokens_per_expert": res.routing.tokens_per_expert.cpu(),
            "recv_rows": int((res.dispatch.recv_topk_idx >= 0).any(1).sum()),
            "stats_per_iter": {k: v / calls for k, v in stats.items()},
            "forward_ms": 1e3 * statistics.median(times_f),
            "backward_ms": 1e3 * statistics.median(times_b),
        }
        layer.dispatcher.close()
        del layer, res  # NOTE: the next mode's layer must not coexist with this one (memory).
    out["peak_rss"] = _peak_rss("self")
    return out


def _peak_rss(who: str) -> int | None:
    """Peak resident bytes of this process (``self``) or of its largest waited-for child.

    ``self`` reads Linux's ``VmHWM`` (the high-water mark of this process's own memory map):
    ``ru_maxrss`` also keeps the size of the process it was forked from before ``exec``, so a
    demo started from a large process (a test runner) would report that process's size.
    """
    if who == "self":
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    which = resource.RUSAGE_SELF if who == "self" else resource.RUSAGE_CHILDREN
    peak = resource.getrusage(which).ru_maxrss
    return int(peak) * (1 if sys.platform == "darwin" else 1024)


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().cpu() for n, p in module.named_parameters() if p.grad is not None}


def _launcher_entry(
    planned: tuple[DemoSpec | None, Any, str | None], timeout_s: float, backend: str
) -> tuple[DemoSpec, Any, list[dict[str, Any]] | None]:
    """Under torchrun: join the launcher's group, take rank 0's plan (so that every rank runs
    the same sizes, or every rank refuses), run, gather everything on rank 0."""
    import torch.distributed as dist

    from flexdispatch.distributed import join_launcher_group, launcher_env
    from flexdispatch.launch import broadcast_object, gather_objects

    if backend == "nccl":
        torch.cuda.set_device(launcher_env()["LOCAL_RANK"])
    join_launcher_group(backend, timeout_s)
    try:
        spec, plan, refusal = broadcast_object(planned, src=0)
        if refusal is not None:  # NOTE: rank 0's refusal, raised alike on every rank
            message, parts = refusal
            raise InputError(message, **parts)
        if dist.get_rank() == 0:
            _progress(plan[1])
        mine = run_rank(spec)
        gathered = gather_objects(mine)  # NOTE: tensors, never unrestricted pickles
        return spec, plan, (gathered if dist.get_rank() == 0 else None)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- the reference


def _reference_model(cfg, seed: int, device: str = "cpu"):
    """The router, all E experts' weights stacked (``w1`` ``[E, H, F]`` ... , None where the
    config has none) and the shared experts, with the values every rank's ``MoELayer`` draws
    (on ``device``, the ranks' device type: the weights are drawn there), on the CPU."""
    from flexdispatch.experts import SharedExperts, init_expert_weights
    from flexdispatch.routing import TopKRouter

    E, H = cfg.router.num_experts, cfg.hidden_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        router = TopKRouter(cfg.router, H)
    experts: dict[str, torch.Tensor | None] = {}
    for g in range(E):
        # NOTE: filled expert by expert, so the full weights exist once, not twice.
        w = init_expert_weights(
            g,
            seed,
            hidden_size=H,
            ffn_hidden_size=cfg.ffn_hidden_size,
            activation=cfg.activation,
            bias=cfg.expert_mlp_bias,
            device=device,
        )
        for name in ("w1", "w2", "w3", "b1", "b2", "b3"):
            t = getattr(w, name)
            if t is None:
                experts[name] = None
                continue
            if g == 0:
                experts[name] = torch.empty((E, *t.shape), dtype=t.dtype)
            experts[name][g] = t  # type: ignore[index]
    for t in experts.values():
        if t is not None:
            t.requires_grad_(True)
    shared = None
    if cfg.num_shared_experts > 0:
        fs = cfg.shared_expert_ffn_hidden_size or cfg.num_shared_experts * cfg.ffn_hidden_size
        shared = SharedExperts(
            H,
            fs,
            activation=cfg.activation,
            swiglu_limit=cfg.swiglu_limit,
            swiglu_alpha=cfg.swiglu_alpha,
            gate=cfg.shared_expert_gate,
            device=device,
            seed=seed,
            expert_id=E,
        ).cpu()
    return router, experts, shared


def check_against_reference(spec: DemoSpec, results: list[dict[str, Any]]) -> dict[str, float]:
    """Max abs difference per quantity between the EP run and the single-process reference.

    The reference routes every rank's tokens with the same router and runs them through all E
    experts and the shared experts in one process (``dense_moe_reference``); replicated
    parameters (router, shared experts) are compared with the sum of the ranks' gradients.
    """
    from flexdispatch.reference import dense_moe_reference

    R = results[0]["world"]
    cfg = demo_config(spec)
    E, H = cfg.router.num_experts, cfg.hidden_size
    router, experts, shared = _reference_model(cfg, spec.seed, results[0].get("device_type", "cpu"))
    sp = {} if shared is None else dict(shared.named_parameters())
    x_all, g_all = global_inputs(spec, R, H)
    ids_all = global_token_ids(spec, R)
    x_all = x_all.clone().requires_grad_(True)
    outs = []
    for r in range(R):
        routing = router(x_all[r], token_ids=ids_all[r])
        y = dense_moe_reference(
            x_all[r],
            routing.topk_idx,
            routing.topk_probs,
            experts["w1"],  # type: ignore[arg-type]
            experts["w2"],  # type: ignore[arg-type]
            experts["w3"],
            cfg.activation,
            b1=experts["b1"],
            b2=experts["b2"],
            b3=experts["b3"],
            swiglu_limit=cfg.swiglu_limit,
            swiglu_alpha=cfg.swiglu_alpha,
            probs_on_input=cfg.probs_on_input,
            shared_w1=sp.get("w1"),
            shared_w2=sp.get("w2"),
            shared_w3=sp.get("w3"),
            shared_gate_weight=sp.get("gate_weight"),
        )
        outs.append(y.detach())
        if y.requires_grad:  # NOTE: not with --tokens 0 (nothing to differentiate)
            (y * g_all[r]).sum().backward()
    e = E // R

    def md(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.sub(a.float(), b.float()).abs_().max()) if a.numel() else 0.0

    def grad(p: torch.Tensor) -> torch.Tensor:  # a parameter that got no gradient: zeros
        return torch.zeros_like(p) if p.grad is None else p.grad

    def replicated(got: list[dict[str, Any]], key: str, ref: dict[str, torch.Tensor]) -> float:
        diffs = [
            md(torch.stack([g[key].get(n, torch.zeros_like(p)) for g in got]).sum(0), grad(p))
            for n, p in ref.items()
        ]
        return _worst(diffs)

    router_params = {n: p for n, p in router.named_parameters() if p.requires_grad}
    diffs: dict[str, float] = {}
    for mode in _MODES:
        got = [res["modes"][mode] for res in results]
        diffs[f"{mode}.output"] = _worst(md(got[r]["output"], outs[r]) for r in range(R))
        gx = grad(x_all)
        diffs[f"{mode}.grad_x"] = _worst(md(got[r]["grad_x"], gx[r]) for r in range(R))
        diffs[f"{mode}.grad_router"] = replicated(got, "grad_router", router_params)
        expert_diffs = []
        for name, ref in experts.items():
            if ref is None:
                continue
            # NOTE: one parameter at a time, so the concatenated copy is one tensor's size.
            zero = torch.zeros_like(ref[:e])
            full = torch.cat([g["grad_experts"].get(name, zero) for g in got])
            expert_diffs.append(md(full, grad(ref)[: R * e]))
            del full
        diffs[f"{mode}.grad_experts"] = _worst(expert_diffs)
        if sp:
            diffs[f"{mode}.grad_shared"] = replicated(got, "grad_shared", sp)
    return diffs


def _worst(values: Iterable[float]) -> float:
    """The largest of ``values`` (0 for none), NaN when any is NaN: Python's ``max`` keeps
    whichever of NaN and a number comes first, so a NaN gradient could pass as a small diff."""
    values = list(values)
    if any(math.isnan(v) for v in values):
        return math.nan
    return max(values, default=0.0)


# --------------------------------------------------------------------------- the report


def build_report(
    spec: DemoSpec, results: list[dict[str, Any]], diffs: dict[str, float], tol: float
) -> dict[str, Any]:
    R, L = results[0]["world"], results[0]["ranks_per_node"]
    cfg = demo_config(spec)
    flat = [r["modes"]["flat"] for r in results]
    per_expert = torch.stack([f["tokens_per_expert"] for f in flat]).sum(0)
    report: dict[str, Any] = {
        "preset": spec.preset,
        "world_size": R,
        "nodes": R // L,
        "ranks_per_node": L,
        "tokens_per_rank": spec.tokens,
        "worst_case": spec.worst_case,
        "hidden_size": cfg.hidden_size,
        "ffn_hidden_size": cfg.ffn_hidden_size,
        "backend": results[0]["backend"],
        "backend_reason": results[0]["backend_reason"],
        "rows_received_per_rank": [f["recv_rows"] for f in flat],
        "tokens_per_expert": per_expert.tolist(),
        "modes": {},
        "max_abs_diff": diffs,
        "nonfinite_diffs": [k for k, v in diffs.items() if not math.isfinite(v)],
        "tolerance": tol,
        "ok": all(math.isfinite(v) and v <= tol for v in diffs.values()),
    }
    for mode in _MODES:
        ms = [r["modes"][mode] for r in results]
        report["modes"][mode] = {
            "bytes_intra_node": sum(m["stats_per_iter"]["bytes_sent_intra_node"] for m in ms),
            "bytes_inter_node": sum(m["stats_per_iter"]["bytes_sent_inter_node"] for m in ms),
            "host_syncs_per_step": max(m["stats_per_iter"]["host_syncs"] for m in ms),
            "forward_ms": max(m["forward_ms"] for m in ms),
            "backward_ms": max(m["backward_ms"] for m in ms),
        }
    return report


def print_report(report: dict[str, Any]) -> None:
    R, N, L = report["world_size"], report["nodes"], report["ranks_per_node"]
    print(
        f"flexdispatch demo — preset {report['preset']}, {N} node(s) × {L} rank(s) = {R} ranks, "
        f"{report['tokens_per_rank']} tokens per rank"
        + (", worst-case mode" if report["worst_case"] else "")
    )
    if report.get("fit_line"):
        print(report["fit_line"])
    if report.get("devices"):
        print(f"devices: {report['devices']['line']}")
    print(f"backend: {report['backend']} ({report['backend_reason']})")
    rows = report["rows_received_per_rank"]
    print("rows received per rank: " + "  ".join(f"r{i}={n}" for i, n in enumerate(rows)))
    tpe = report["tokens_per_expert"]
    mean = sum(tpe) / max(1, len(tpe))
    print(
        f"tokens per expert (max/mean {max(tpe) / mean if mean else 0:.2f}): "
        + " ".join(str(n) for n in tpe)
    )
    print(
        f"{'mode':<13} {'intra-node':>11} {'inter-node':>11} {'syncs/step':>10} "
        f"{'fwd ms':>8} {'bwd ms':>8}"
    )
    for mode, m in report["modes"].items():
        print(
            f"{mode:<13} {format_bytes(m['bytes_intra_node']):>11} "
            f"{format_bytes(m['bytes_inter_node']):>11} {m['host_syncs_per_step']:>10.0f} "
            f"{m['forward_ms']:>8.1f} {m['backward_ms']:>8.1f}"
        )
    flat, hier = report["modes"]["flat"], report["modes"]["hierarchical"]
    if flat["bytes_inter_node"]:
        ratio = hier["bytes_inter_node"] / flat["bytes_inter_node"]
        print(f"hierarchical / flat inter-node bytes: {ratio:.2f}")
    bad = report.get("nonfinite_diffs") or []
    worst = _worst(v for v in report["max_abs_diff"].values() if v is not None)
    verdict = "OK" if report["ok"] else "MISMATCH"
    shared = ", shared experts" if "flat.grad_shared" in report["max_abs_diff"] else ""
    what = f"NaN/inf in {', '.join(bad)}" if bad else f"max abs diff {worst:.2e}"
    print(
        f"check vs single-process reference (output, grads of input, router, experts{shared}): "
        f"{verdict} ({what}, tolerance {report['tolerance']:.0e})"
    )


def _plan(
    args: argparse.Namespace,
    num_ranks: int,
    *,
    launcher: bool,
    local_ranks: int,
    runtime: tuple[int, int | None, str] | None = None,
):
    """The spec with the sizes that fit (see ``flexdispatch.cli.demo_fit``) and the plan;
    ``runtime`` is ``demo_machine.measure_runtime``'s answer (None: the fixed allowance)."""
    from flexdispatch.cli import demo_fit
    from flexdispatch.config import load_config

    cfg = load_config(args.preset)
    cfg.check_world(num_ranks, local_ranks if launcher else args.ranks_per_node)
    max_memory = args.max_memory
    if isinstance(max_memory, str):  # NOTE: a caller's namespace, not parsed by argparse
        max_memory = demo_fit.parse_size(max_memory)
    limit, why = demo_fit.memory_limit(max_memory)
    largest, largest_why = demo_fit.process_limit()
    try:
        plan = demo_fit.fit_demo(
            cfg,
            num_ranks,
            args.tokens,
            worst_case=args.worst_case,
            limit=limit,
            limit_reason=why,
            launcher=launcher,
            local_ranks=local_ranks,
            runtime=demo_fit.RUNTIME_BYTES if runtime is None else runtime[0],
            largest_limit=largest,
            largest_reason=largest_why,
        )
    except demo_fit.DemoTooBig as exc:
        _name_the_option(exc, args, why, launcher)
        raise

    spec = DemoSpec(
        preset=args.preset,
        backend=args.backend,
        tokens=plan.tokens,
        seed=args.seed,
        iters=args.iters,
        worst_case=args.worst_case,
        hidden_size=plan.hidden_size if plan.shrunk else None,
        ffn_hidden_size=plan.ffn_hidden_size if plan.shrunk else None,
        shared_expert_ffn_hidden_size=plan.shared_expert_ffn_hidden_size if plan.shrunk else None,
    )
    return spec, plan, plan.shrink_line(cfg)


def _name_the_option(exc, args: argparse.Namespace, limit_reason: str, launcher: bool) -> None:
    """Name the option at fault in the demo's memory refusal (``demo_fit.DemoTooBig``): the
    address-space limit when one process does not fit; ``--max-memory`` when it is the binding
    limit (given or its default: raising it helps where the machine has more); else the ranks,
    ``--nodes`` or ``--ranks-per-node`` (the larger; under a launcher, its ranks per node)."""
    import resource

    if exc.which == "largest":
        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        exc.option, exc.value, exc.has_value = (
            "ulimit -v",
            format_bytes(soft).replace(" ", ""),
            True,
        )
        exc.fix = "raise the address-space limit (ulimit -v unlimited)"
    elif "--max-memory" in limit_reason and "available" not in limit_reason:
        exc.option, exc.value = "--max-memory", format_bytes(args.max_memory or 0).replace(" ", "")
        exc.has_value = args.max_memory is not None
        exc.fix = "raise --max-memory if the machine has it, or use fewer ranks"
    elif launcher:
        exc.option, exc.fix = "--nproc-per-node", "start fewer ranks on this machine"
    else:
        nodes, per_node = args.nodes or 2, args.ranks_per_node or 2
        flag, value = ("--nodes", nodes) if nodes >= per_node else ("--ranks-per-node", per_node)
        exc.option, exc.value, exc.has_value = flag, value, True
        exc.fix = "use fewer ranks"


def run(args: argparse.Namespace) -> int:
    from flexdispatch.cli import demo_machine
    from flexdispatch.cli._common import (
        check_backend,
        check_open_files,
        clear_status,
        group_failure,
        option_scope,
        verbose_enabled,
    )
    from flexdispatch.config import load_config
    from flexdispatch.distributed import launcher_env
    from flexdispatch.launch import GroupError, spawn_group, under_launcher

    if args.tokens < 0 or args.iters < 1:  # NOTE: parse-time types check these on the CLI
        raise ValueError("--tokens must be >= 0 and --iters >= 1")
    _VERBOSE["on"] = verbose_enabled(args)
    with option_scope("--preset", args.preset):
        load_config(args.preset)  # fail fast on a bad preset, before spawning anything
    check_backend(args.backend)
    t0 = time.perf_counter()
    if under_launcher():
        env = launcher_env()  # NOTE: every variable checked, each error naming its variable
        world, local = env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]
        mismatch = args.nodes not in (None, world // local) or args.ranks_per_node not in (
            None,
            local,
        )
        if mismatch and os.environ.get("RANK") == "0":
            print(
                f"[demo] under a launcher: using its {world // local} node(s) × {local} "
                f"rank(s); --nodes/--ranks-per-node are ignored",
                file=sys.stderr,
            )
        planned: tuple[Any, Any, tuple[str, dict[str, str]] | None]
        devices = demo_machine.launcher_devices(args, local)
        runtime = None
        try:
            if os.environ.get("RANK") == "0":  # NOTE: only rank 0's plan is used
                runtime = demo_machine.measure_runtime(devices.device_type, progress=_progress)
            spec, plan, line = _plan(args, world, launcher=True, local_ranks=local, runtime=runtime)
            planned = (spec, (plan, line, runtime), None)
        except ValueError as exc:
            parts = {k: getattr(exc, k, "") for k in ("problem", "option", "fix")}
            if getattr(exc, "has_value", False):
                parts["value"] = str(exc.value)  # type: ignore[attr-defined]
            planned = (None, None, (str(exc), parts))
        _progress(f"devices: {devices.line()}; joining the launcher's process group")
        spec, (plan, line, runtime), results = _launcher_entry(
            planned, args.timeout, devices.backend
        )
        if results is None:
            return 0
        peaks = {"largest_rank": max((r.get("peak_rss") or 0) for r in results) or None}
    else:
        preset = load_config(args.preset)
        given = {} if args.ranks_per_node is None else {"value": args.ranks_per_node}
        with option_scope("--ranks-per-node", **given):
            nodes, per_node, devices = demo_machine.spawned_topology(
                args, preset.router.num_experts, preset.check_world
            )
        R = nodes * per_node
        check_open_files(R)  # NOTE: before the runtime probe (seconds) and the spawn
        runtime = demo_machine.measure_runtime(devices.device_type, progress=_progress)
        spec, plan, line = _plan(args, R, launcher=False, local_ranks=R, runtime=runtime)
        _layer_config(spec, "hierarchical", R, per_node).check_world(R, per_node)
        _progress(line)
        _progress(f"devices: {devices.line()}")
        _progress(
            f"[1/3] spawning {R} ranks ({nodes} nodes × {per_node}, {devices.backend} on "
            f"{devices.device_type})"
        )
        try:
            results = spawn_group(
                run_rank,
                R,
                args=(spec,),
                ranks_per_node=per_node,
                timeout_s=args.timeout,
                backend=devices.backend,
            )
        except GroupError as exc:
            phase = "[2/3] running forward+backward on the spawned ranks"
            raise group_failure(exc, phase=phase, timeout_s=args.timeout) from exc
        _progress(f"[2/3] {R} ranks finished forward+backward in flat and hierarchical modes")
        # NOTE: the largest child includes a rank's serialisation of its results on the way back.
        peaks = {"largest_rank": _peak_rss("children")}
    _progress("[3/3] checking against the single-process reference")
    diffs = check_against_reference(spec, results)
    report = build_report(spec, results, diffs, tol=1e-4)
    peaks["this_process"] = _peak_rss("self")
    report["fit_line"] = line
    report["devices"] = {
        "process_group": devices.backend,
        "device": devices.device_type,
        "gpus_visible": devices.gpus,
        "line": devices.line(),
    }
    report["fit"] = {**plan.as_dict(), "measured_peak_rss": peaks}
    if runtime is not None:
        report["fit"]["runtime"] = {"allowance": runtime[0], "measured": runtime[1]}
        report["fit"]["runtime"]["source"] = runtime[2]
    report["wall_s"] = round(time.perf_counter() - t0, 2)
    clear_status()
    if args.json:
        print(json_text(report))
    else:
        print_report(report)
        print(f"wall time {report['wall_s']:.1f} s")
    return 0 if report["ok"] else 1
