"""Compile flexdispatch's Triton kernels for a GPU target on a machine without a GPU.

Triton's interpreter (how the unit tests run the kernels on CPU) accepts code that the compiler
rejects (a global that is not a ``tl.constexpr``, a type the GPU does not take), so this script
compiles the kernels the way real calls launch them: it calls ``topk_routing``, ``permute`` and
``unpermute`` (forward and backward), the dispatcher's value screen (``kernels.screen``) and the
in-band pack and unpack (``kernels.inband``) on small CPU tensors with every launch recorded
instead of run, then compiles each recorded launch with ``triton.compile`` for ``--arch``
(default sm_90, the H100/H200) down to a cubin (Triton's bundled ``ptxas``; no driver
needed). Pointer and integer arguments get the 16-byte divisibility hints Triton's launcher
gives them at run time.

    python scripts/compile_kernels.py            # the real variants (DeepSeek, Qwen3, ...)
    python scripts/compile_kernels.py --quick    # every kernel branch once, on small tiles

Exit status 0 when every launch compiles; the failures are printed otherwise. Run it without
``TRITON_INTERPRET`` (an interpreting process cannot compile): the script refuses otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

_DTYPES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float64: "fp64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.uint8: "u8",
}


class _Recorder:
    """Stands in for a built kernel: ``rec[grid](*args, **constexprs)`` records the launch."""

    def __init__(self, fn: Any, log: list) -> None:
        self.fn, self.log = fn, log

    def __getitem__(self, grid: tuple) -> Any:
        def launch(*args: Any, **constexprs: Any) -> None:
            self.log.append((self.fn, args, constexprs))

        return launch


def _record(quick: bool) -> list:
    from flexdispatch import permute, topk_routing, unpermute
    from flexdispatch.kernels import _triton

    log: list = []
    _triton._INTERPRETING = True  # let impl="triton" take CPU tensors (nothing runs)
    _triton.Kernel.get = lambda self: _Recorder(self.fn, log)  # type: ignore[method-assign]
    # NOTE: no kernel runs, so outputs keep what they were made with: zeros, valid as indices.
    torch.empty = torch.zeros  # type: ignore[assignment]

    if quick:
        # every branch of the kernels once, on small tiles (the tile size does not change the
        # code, only how long the compiler takes); 10 experts: padded groups
        routing = [
            (
                16,
                4,
                {
                    "score_function": "sigmoid",
                    "num_groups": 4,
                    "group_topk": 2,
                    "scaling_factor": 2.5,
                    "bias": True,
                },
            ),
            (8, 2, {"score_function": "softmax"}),
            (
                10,
                2,
                {
                    "score_function": "softmax",
                    "use_pre_softmax": True,
                    "num_groups": 2,
                    "group_topk": 1,
                    "group_score": "max",
                    "normalize_topk": True,
                },
            ),
            (8, 2, {"score_function": "softmax", "normalize_topk": False}),
            (8, 2, {"score_function": "sqrtsoftplus", "dtype": "bf16"}),
        ]
    else:
        routing = [
            # DeepSeek-V3: sigmoid + bias, 8 groups / 4 by the sum rule, scaling
            (
                256,
                8,
                {
                    "score_function": "sigmoid",
                    "num_groups": 8,
                    "group_topk": 4,
                    "scaling_factor": 2.5,
                    "bias": True,
                },
            ),
            # Qwen3: softmax after the top-k
            (128, 8, {"score_function": "softmax"}),
            # DeepSeek-V2: softmax before, max rule, scaling (160 experts: padded groups)
            (
                160,
                6,
                {
                    "score_function": "softmax",
                    "use_pre_softmax": True,
                    "num_groups": 8,
                    "group_topk": 3,
                    "group_score": "max",
                    "scaling_factor": 16.0,
                },
            ),
            # Mixtral without renormalisation; DeepSeek-V4-like; the largest E and k
            (8, 2, {"score_function": "softmax", "normalize_topk": False}),
            (256, 6, {"score_function": "sqrtsoftplus", "bias": True}),
            (512, 32, {"score_function": "sqrtsoftplus", "num_groups": 16, "group_topk": 8}),
            (64, 4, {"score_function": "sigmoid", "normalize_topk": False, "dtype": "bf16"}),
        ]
    for E, k, kw in routing:
        kw = dict(kw)
        dtype = torch.bfloat16 if kw.pop("dtype", None) == "bf16" else torch.float32
        bias = torch.zeros(E) if kw.pop("bias", False) else None
        logits = torch.randn(2 if quick else 32, E, dtype=dtype, requires_grad=True)
        res = topk_routing(logits, topk=k, expert_bias=bias, impl="triton", checks=False, **kw)
        res.topk_probs.sum().backward()

    perms = [(1, True, torch.bfloat16, 7168), (4, True, torch.float32, 64)]
    if not quick:
        perms += [(1, False, torch.float16, 4096), (2, True, torch.float64, 64)]

    for align, with_probs, dtype, H in perms:
        T, E, k = 16, 8, 4
        x = torch.randn(T, H, dtype=dtype, requires_grad=True)
        idx = torch.rand(T, E).argsort(dim=1)[:, :k].contiguous()
        probs = torch.rand(T, k, requires_grad=True) if with_probs else None
        perm = permute(
            x,
            idx,
            E,
            topk_probs=probs,
            align=align,
            num_rows=T * k + E * (align - 1),
            impl="triton",
        )
        out = unpermute(perm.x * 1, perm, probs=perm.probs, impl="triton")
        out2 = unpermute(perm.x, perm, impl="triton")
        (out.float().sum() + out2.float().sum()).backward()

    from flexdispatch.kernels.screen import screen_inputs

    # the deferred value checks: k = 2 (one token per [2, 2] comparison), k = 8, k = 32
    screens = [(2, torch.bfloat16, 7168), (8, torch.float32, 56)]
    if not quick:
        screens += [(32, torch.float16, 4096), (6, torch.bfloat16, 7168)]
    for k, dtype, V in screens:
        acc = torch.zeros(6, dtype=torch.int64)
        idx = torch.zeros(40, k, dtype=torch.int64)
        screen_inputs(idx, 256, torch.zeros(40, V, dtype=dtype), torch.zeros(40, k), acc)

    from flexdispatch.kernels.inband import capped_slots, pack_inband, unpack_blocks

    # the worst-case send slots: a sliced [T, R + 2] mask, short and long (several chunks)
    for n, P, cap in [(8, 2, 8)] + ([] if quick else [(16384, 8, 16384)]):
        capped_slots(torch.zeros(n, P + 2, dtype=torch.bool)[:, :P], cap)

    # the in-band send rows of a flat worst-case dispatch and their receive side, short rows and
    # long ones (every width since issue 46: DeepSeek-V3's 7168 bf16 columns included)
    packs = [(2, torch.bfloat16, 64), (8, torch.float32, 512), (8, torch.bfloat16, 7168)]
    if not quick:
        packs += [(6, torch.bfloat16, 1024), (32, torch.float16, 8), (2, torch.bfloat16, 4096)]
    for k, dtype, H in packs:
        x, key = torch.zeros(8, H, dtype=dtype), torch.zeros(8, k, dtype=torch.int64)
        need = torch.zeros((), dtype=torch.int64)
        send = pack_inband(x, key, torch.zeros(8, k), torch.zeros(12, dtype=torch.int64), need, 256)
        recv = torch.cat([send, send[:1]])  # [W + 1] rows, W = 12: 3 blocks of 4
        n = torch.zeros(3, dtype=torch.int64)
        rb = H * dtype.itemsize
        rows, meta = recv[:, :rb].view(dtype), recv[:, rb:].view(torch.int32)[:, : 2 * k]
        unpack_blocks(rows, meta, n, cap=4, k=k, lo=32, num_local=32)
    # a world of one: the rows, ids and probs read where they are, through the send order
    longs = [(8, torch.bfloat16, 7168)]
    if not quick:
        longs += [(2, torch.bfloat16, 4096), (8, torch.float16, 2048)]
    for k, dtype, H in longs:
        n = torch.zeros(1, dtype=torch.int64)
        rows, key = torch.zeros(8, H, dtype=dtype), torch.zeros(8, k, dtype=torch.int64)
        order = torch.zeros(8, dtype=torch.int64)
        probs = torch.zeros(8, k)
        unpack_blocks(rows, key, n, cap=8, k=k, lo=0, num_local=256, row_map=order, probs=probs)
    return log


def _signature(fn: Any, args: tuple, constexprs: dict) -> tuple[dict, dict, dict]:
    from triton.runtime.jit import JITFunction

    jf = JITFunction(fn)
    sig: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list] = {}
    for i, (name, value) in enumerate(zip(jf.arg_names, args, strict=False)):
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + _DTYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            sig[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(value).__name__}")
    for name in constexprs:
        sig[name] = "constexpr"
    return {"jf": jf}, sig, attrs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one launch per kernel and branch")
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability (90)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("compile_kernels: unset TRITON_INTERPRET (an interpreting process cannot compile)")
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    log = _record(args.quick)
    seen: set = set()
    failures = 0
    target = GPUTarget("cuda", args.arch, 32)
    t_all = time.perf_counter()
    for fn, fargs, constexprs in log:
        if args.quick and "BLOCK_T" in constexprs:
            constexprs = {**constexprs, "BLOCK_T": 2}
        holder, sig, attrs = _signature(fn, fargs, constexprs)
        key = (fn.__name__, tuple(sorted(sig.items())), tuple(sorted(map(str, constexprs.items()))))
        if key in seen:
            continue
        seen.add(key)
        what = f"{fn.__name__}({', '.join(f'{k}={v}' for k, v in constexprs.items())})"
        t0 = time.perf_counter()
        try:
            src = ASTSource(fn=holder["jf"], signature=sig, constexprs=constexprs, attrs=attrs)
            triton.compile(src, target=target, options={"num_warps": 4})
        except Exception as exc:  # report every failure, then fail
            failures += 1
            print(f"FAIL {what}\n  {type(exc).__name__}: {str(exc).strip()[:2000]}")
        else:
            print(f"ok   {what}  {time.perf_counter() - t0:.1f} s")
    print(
        f"{len(seen)} kernel variants for sm_{args.arch} with triton {triton.__version__}: "
        f"{len(seen) - failures} compiled, {failures} failed ({time.perf_counter() - t_all:.0f} s)"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
