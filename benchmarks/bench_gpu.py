"""GPU benchmark of flexdispatch's hot path against its peers and the hardware (issue 26, item 7).

Shape letters: T tokens · H hidden · E experts · k top-k · R ranks · W worst-case rows.

Sections (each row of the one table is a median of interleaved repetitions, CUDA events; every
call starts from an idle GPU, so the host's launch cost is included, as in
``shared/measurements/gpu-h200-2026-12-04.md``; "host ms" is the wall time of the call itself,
before the GPU finishes):

- ``routing``: ``topk_routing`` with the fused Triton kernel (``impl="triton"``) and the torch path
  (``impl="torch"``) against Megatron-Core's ``topk_routing_with_score_function`` in both its
  forms: sparse ``[T, E]`` probs + ``torch.topk`` (what its flex dispatcher feeds DeepEP) and
  ``dense_output=True``. Shapes: DeepSeek-V3 (E=256, k=8, sigmoid + bias, 8 groups / 4,
  scale 2.5), Qwen3 (E=128, k=8, softmax), Mixtral (E=8, k=2, softmax); T = 4,096 .. 65,536.
  Fp32 logits, no grad. "agree" = share of tokens with the same experts as the Triton kernel.
- ``permute``: ``permute`` + ``unpermute`` with probs (bf16 rows, fp32 probs, the expert sort
  included), Triton and torch, the static ``static_rows`` mode, Megatron's unfused ``permute`` /
  ``unpermute`` (``routing_map`` form, probs applied in ``unpermute``), and two plain copies of
  the ``[T*k, H]`` rows (``dst.copy_(src); src.copy_(dst)``): the bandwidth bound.
- ``dispatch``: ``FlexDispatcher`` (torch backend) in an NCCL world of one, E=256, k=8, H=7,168
  bf16: dispatch + combine dropless, worst-case (W = T*R, DeepEP's choice) eager and replayed from
  a CUDA graph, against the two bare ``all_to_all_single`` calls of the same ``[T, H]`` rows;
  dropless and worst-case eager also with the dispatcher's own Triton kernels off (their torch
  ops), side by side, for the host time they save or cost. A world of one runs no collective
  inside the dispatcher (the torch backend treats a group of one rank as no group), so these
  rows time its host work and kernels; "collectives forced" rows run the paths of R ranks with
  R = 1 (``TorchA2ABackend.distributed`` set: NCCL's all-to-alls of one rank; ``--quick``: at
  T = 128 only). The collectives' cost across ranks needs more GPUs.
- ``layer``: ``MoELayer`` with the ``deepseek_v3`` preset on one GPU (bf16): build time, and one
  forward + backward at T = 4,096.

Megatron-Core is optional: without it (or where its call fails) those rows say why, the rest run.

    python benchmarks/bench_gpu.py                       # everything (a few minutes on an H200)
    python benchmarks/bench_gpu.py --quick --json out.json   # fewer shapes and reps
    python benchmarks/bench_gpu.py --sections routing,permute

``--quick`` is sized for 90 s on one H200 with the layer built on the device (issue 26, item 6);
while ``MoELayer(deepseek_v3)`` still draws its weights on the CPU (about 60 s measured), the
``layer`` section alone takes that long: leave it out with ``--sections routing,permute,dispatch``.
Kernel compilation (first call of each Triton kernel, cached on disk after) is included.

Without CUDA it prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SECTIONS = ("routing", "permute", "dispatch", "layer")

ROUTING_SHAPES = {
    "DeepSeek-V3": {
        "E": 256,
        "topk": 8,
        "score_function": "sigmoid",
        "num_groups": 8,
        "group_topk": 4,
        "scaling_factor": 2.5,
        "bias": True,
    },
    "Qwen3": {"E": 128, "topk": 8, "score_function": "softmax"},
    "Mixtral": {"E": 8, "topk": 2, "score_function": "softmax"},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="fewer shapes and reps (<= 90 s)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON here")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (20; quick 7)")
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)}",
    )
    args = parser.parse_args(argv)
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in chosen if s not in SECTIONS]
    if bad or not chosen:
        parser.error(f"--sections takes a subset of {','.join(SECTIONS)}, got {args.sections!r}")
    args.sections = chosen
    if args.reps is None:
        args.reps = 7 if args.quick else 20
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    return args


# ----------------------------------------------------------------------------- timing


class Timer:
    """Interleaved timing: every repetition runs each variant once, from an idle GPU."""

    def __init__(self, torch: Any, reps: int, warmup: int = 2) -> None:
        self.torch, self.reps, self.warmup = torch, reps, warmup

    def run(self, fns: dict[str, Callable[[], object]]) -> dict[str, dict[str, float]]:
        torch = self.torch
        for _ in range(self.warmup):
            for fn in fns.values():
                fn()
        torch.cuda.synchronize()
        gpu: dict[str, list[float]] = {k: [] for k in fns}
        host: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(self.reps):
            for name, fn in fns.items():
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                start.record()
                fn()
                end.record()
                host[name].append((time.perf_counter() - t0) * 1e3)
                end.synchronize()
                gpu[name].append(start.elapsed_time(end))
        return {
            k: {"ms": statistics.median(gpu[k]), "host_ms": statistics.median(host[k])} for k in fns
        }


def _row(section: str, case: str, what: str, m: dict | None, **extra: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"section": section, "case": case, "what": what}
    if m is not None:
        row.update(ms=round(m["ms"], 4), host_ms=round(m["host_ms"], 4))
    row.update(extra)
    return row


def _import_megatron() -> tuple[Any, str]:
    """Megatron-Core's moe_utils, or None and why (benchmarks/bench_routing.py's import)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        from bench_routing import _import_megatron as imp  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    fns, reason = imp()
    if fns is None:
        return None, reason
    from megatron.core.transformer.moe import moe_utils

    return moe_utils, reason


# ----------------------------------------------------------------------------- sections


def bench_routing(torch: Any, timer: Timer, quick: bool, rows: list, mc: Any, why: str) -> None:
    from flexdispatch import topk_routing

    Ts = (4096, 16384) if quick else (4096, 16384, 65536)
    dev = torch.device("cuda")
    for name, spec in ROUTING_SHAPES.items():
        spec = dict(spec)
        E, k, bias_on = spec.pop("E"), spec["topk"], spec.pop("bias", False)
        for T in Ts:
            g = torch.Generator(device=dev).manual_seed(T + E)
            logits = torch.randn(T, E, device=dev, generator=g)
            bias = (torch.randn(E, device=dev, generator=g) * 0.01) if bias_on else None
            kw = dict(spec, expert_bias=bias, checks=False)
            fns: dict[str, Callable[[], object]] = {
                "triton": lambda kw=kw, x=logits: topk_routing(x, impl="triton", **kw),
                "torch": lambda kw=kw, x=logits: topk_routing(x, impl="torch", **kw),
            }
            mkw = {
                "topk": k,
                "score_function": spec["score_function"],
                "num_groups": spec.get("num_groups"),
                "group_topk": spec.get("group_topk"),
                "scaling_factor": spec.get("scaling_factor"),
                "expert_bias": bias,
            }
            mc_note = why
            if mc is not None:
                f = mc.topk_routing_with_score_function

                def sparse(x=logits, f=f, mkw=mkw, k=k):
                    probs, _ = f(x, **mkw)
                    return torch.topk(probs, k, dim=-1)

                def dense(x=logits, f=f, mkw=mkw):
                    return f(x, dense_output=True, **mkw)

                try:
                    sparse()
                    dense()
                    fns["megatron sparse+topk"] = sparse
                    fns["megatron dense"] = dense
                except Exception as exc:  # an API this script does not know: say so, go on
                    mc_note = f"megatron call failed: {type(exc).__name__}: {exc}"
            with torch.no_grad():
                ref = topk_routing(logits, impl="triton", **kw).topk_idx.sort(dim=-1).values
                agree = {}
                other = topk_routing(logits, impl="torch", **kw).topk_idx
                agree["torch"] = float((other.sort(-1).values == ref).all(-1).float().mean())
                if "megatron dense" in fns:
                    out = fns["megatron dense"]()
                    idx = out[1] if out[1].dtype == torch.int64 else out[0]
                    if idx.dtype == torch.int64:
                        same = (idx.sort(-1).values == ref).all(-1).float().mean()
                        agree["megatron dense"] = float(same)
                m = timer.run(fns)
            case = f"{name} T={T}"
            best_mc = min(
                (m[v]["ms"] for v in ("megatron sparse+topk", "megatron dense") if v in m),
                default=None,
            )
            for what, mm in m.items():
                extra: dict[str, Any] = {}
                if what in agree:
                    extra["agree"] = round(agree[what], 4)
                if best_mc is not None:
                    extra["vs_megatron_best"] = round(best_mc / mm["ms"], 3)
                rows.append(_row("routing", case, what, mm, **extra))
            if mc is None or "megatron dense" not in fns:
                rows.append(_row("routing", case, "megatron", None, skipped=mc_note))


def bench_permute(torch: Any, timer: Timer, quick: bool, rows: list, mc: Any, why: str) -> None:
    from flexdispatch import permute, unpermute

    dev = torch.device("cuda")
    shapes = [(4096, 7168, 256, 8), (16384, 7168, 256, 8)]
    if not quick:
        shapes += [(4096, 4096, 256, 8), (16384, 4096, 128, 8), (16384, 4096, 8, 2)]
    for T, H, E, k in shapes:
        g = torch.Generator(device=dev).manual_seed(T + H)
        x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
        idx = torch.rand(T, E, device=dev, generator=g).argsort(dim=1)[:, :k].contiguous()
        probs = torch.rand(T, k, device=dev, generator=g)
        src = torch.empty(T * k, H, device=dev, dtype=torch.bfloat16)
        dst = torch.empty_like(src)

        def run(impl: str, static: bool = False, x=x, idx=idx, probs=probs, E=E, T=T, k=k):
            perm = permute(
                x, idx, E, topk_probs=probs, static_rows=T * k if static else None, impl=impl
            )
            return unpermute(perm.x, perm, probs=perm.probs, impl=impl)

        def copies(src=src, dst=dst):
            dst.copy_(src)
            src.copy_(dst)

        fns: dict[str, Callable[[], object]] = {
            "triton": lambda: run("triton"),
            "triton static": lambda: run("triton", True),
            "torch": lambda: run("torch"),
            "2 copies": copies,
        }
        mc_note = why
        if mc is not None:
            routing_map = torch.zeros(T, E, dtype=torch.bool, device=dev)
            routing_map.scatter_(1, idx, True)
            probs_TE = torch.zeros(T, E, device=dev).scatter_(1, idx, probs)

            def megatron(x=x, rm=routing_map, p=probs_TE, n=T * k):
                out = mc.permute(x, rm, probs=p, num_out_tokens=n)
                return mc.unpermute(out[0], out[2], x.shape, probs=p, routing_map=rm)

            try:
                megatron()
                fns["megatron"] = megatron
            except Exception as exc:
                mc_note = f"megatron call failed: {type(exc).__name__}: {exc}"
        with torch.no_grad():
            a, b = run("triton"), run("torch")
            close = bool(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2))
            m = timer.run(fns)
        case = f"T={T} H={H} E={E} k={k}"
        for what, mm in m.items():
            extra: dict[str, Any] = {"copies_share": round(m["2 copies"]["ms"] / mm["ms"], 3)}
            if "megatron" in m:
                extra["vs_megatron"] = round(m["megatron"]["ms"] / mm["ms"], 3)
            if what == "triton":
                extra["matches_torch"] = close
            rows.append(_row("permute", case, what, mm, **extra))
        if "megatron" not in fns:
            rows.append(_row("permute", case, "megatron", None, skipped=mc_note))


def _init_world_of_one(torch: Any) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=120),
    )


def _kernels_off(step: Callable[[Any], object], d: Any) -> object:
    """``step(d)`` with the dispatcher's own Triton kernels off (as with
    ``FLEXDISPATCH_DISPATCH_KERNELS=0``): their torch ops instead, side by side, since a Triton
    launch costs the host more than an ATen op and fewer launches need not mean less host time."""
    from flexdispatch.kernels import _triton

    saved = _triton.dispatch_kernels()
    _triton._DISPATCH_KERNELS = False
    try:
        return step(d)
    finally:
        _triton._DISPATCH_KERNELS = saved


def bench_dispatch(torch: Any, timer: Timer, quick: bool, rows: list) -> None:
    import torch.distributed as dist

    from flexdispatch import DispatchConfig, FlexDispatcher

    _init_world_of_one(torch)
    dev = torch.device("cuda", 0)
    E, k, H = 256, 8, 7168
    for T in (128, 16384) if quick else (128, 4096, 16384):
        g = torch.Generator(device=dev).manual_seed(T)
        x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
        idx = torch.rand(T, E, device=dev, generator=g).argsort(dim=1)[:, :k].contiguous()
        probs = torch.rand(T, k, device=dev, generator=g)
        dropless = FlexDispatcher(DispatchConfig(backend="torch"), num_experts=E)
        worst = FlexDispatcher(
            DispatchConfig(backend="torch", num_worst_tokens=T, cuda_graph=True), num_experts=E
        )
        # NOTE: a group of one runs no collective; these two run the paths of R ranks (NCCL)
        forced = {
            "dropless": FlexDispatcher(DispatchConfig(backend="torch"), num_experts=E),
            "worst-case eager": FlexDispatcher(
                DispatchConfig(backend="torch", num_worst_tokens=T), num_experts=E
            ),
        }
        for d in forced.values():
            d.backend.distributed = True

        def step(d: Any, x=x, idx=idx, probs=probs) -> Any:
            res = d.dispatch(x, idx, probs)
            return d.combine(res.recv_x, res.handle)

        send = x.clone()
        recv = torch.empty_like(send)

        def bare(send=send, recv=recv):
            dist.all_to_all_single(recv, send)
            dist.all_to_all_single(send, recv)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step(worst)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(worst)
        fns = {
            "bare 2x all_to_all_single": bare,
            "dropless": lambda d=dropless: step(d),
            "dropless, dispatcher kernels off": lambda d=dropless: _kernels_off(step, d),
            "worst-case eager": lambda d=worst: step(d),
            "worst-case eager, dispatcher kernels off": lambda d=worst: _kernels_off(step, d),
            "worst-case graph replay": graph.replay,
        }
        if not quick or T == 128:  # NOTE: --quick keeps them where host time is the question
            fns.update({f"{w}, collectives forced": lambda d=d: step(d) for w, d in forced.items()})
        m = timer.run(fns)
        base = m["bare 2x all_to_all_single"]["ms"]
        for what, mm in m.items():
            rows.append(
                _row(
                    "dispatch",
                    f"T={T} H={H} E={E} k={k} W={T}",
                    what,
                    mm,
                    vs_bare=round(mm["ms"] / base, 3),
                )
            )
        del graph


def bench_layer(torch: Any, timer: Timer, quick: bool, rows: list) -> None:
    from flexdispatch import MoELayer, load_config

    _init_world_of_one(torch)
    cfg = load_config("deepseek_v3")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    layer = MoELayer(cfg, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    rows.append(
        _row("layer", "deepseek_v3 build", "MoELayer(...)", None, seconds=round(build_s, 2))
    )
    T = 4096
    h = torch.randn(T, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        out = layer(h)
        out.output.float().square().mean().backward()

    m = Timer(torch, reps=3 if quick else 10, warmup=1).run({"forward + backward": step})
    rows.append(_row("layer", f"deepseek_v3 T={T}", "forward + backward", m["forward + backward"]))


# ----------------------------------------------------------------------------- main


def _print_table(rows: list[dict[str, Any]]) -> None:
    print("| section | case | what | ms | host ms | notes |")
    print("|---|---|---|---:|---:|---|")
    for r in rows:
        notes = ", ".join(
            f"{k}={v}"
            for k, v in r.items()
            if k not in ("section", "case", "what", "ms", "host_ms")
        )
        ms = f"{r['ms']:.3f}" if "ms" in r else "-"
        host = f"{r['host_ms']:.3f}" if "host_ms" in r else "-"
        print(f"| {r['section']} | {r['case']} | {r['what']} | {ms} | {host} | {notes} |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(
            "bench_gpu: needs a CUDA GPU (torch.cuda.is_available() is False): nothing measured",
            file=sys.stderr,
        )
        return 2
    from flexdispatch.kernels import triton_status

    ok, triton_why = triton_status()
    if not ok and ("routing" in args.sections or "permute" in args.sections):
        print(f"bench_gpu: the Triton rows need triton: {triton_why}", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    timer = Timer(torch, args.reps)
    mc, why = (None, "")
    if "routing" in args.sections or "permute" in args.sections:
        mc, why = _import_megatron()
        if mc is None:
            why = f"megatron-core not importable: {why}"
    rows: list[dict[str, Any]] = []
    if "routing" in args.sections:
        bench_routing(torch, timer, args.quick, rows, mc, why)
    if "permute" in args.sections:
        bench_permute(torch, timer, args.quick, rows, mc, why)
    if "dispatch" in args.sections:
        bench_dispatch(torch, timer, args.quick, rows)
    if "layer" in args.sections:
        bench_layer(torch, timer, args.quick, rows)
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton_why,
        "megatron": why if mc is None else "megatron-core importable",
        "quick": args.quick,
        "reps": args.reps,
        "seconds": round(time.perf_counter() - t_start, 1),
        "command": " ".join(["python", "benchmarks/bench_gpu.py", *(argv or sys.argv[1:])]),
    }
    print(
        f"# bench_gpu on {meta['device']}: torch {meta['torch']}, {meta['triton']}, "
        f"{meta['megatron']}; medians of {args.reps} interleaved reps, CUDA events from an "
        f"idle GPU; {meta['seconds']} s"
    )
    _print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if "dispatch" in args.sections or "layer" in args.sections:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when it is unset
    sys.exit(main())
