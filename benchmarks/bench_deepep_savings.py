"""Count what the DeepEP adapter spends per training step (issue 25: N10, N11, N13, N19, N20, N21,
and the node-deduplicated ``auto`` choice across nodes).

Shape letters (ARCHITECTURE.md): T tokens per rank · H hidden · E experts · k top-k · R ranks ·
L ranks per node · W worst-case rows.

Everything runs through DeepEP's own Python layer over the emulated runtime
(``tests/deepep_emu``; V1 and V2 of 2.1.0, V2.5 ``"ep"`` of 2.5.0), on R = 2 gloo ranks (one
node) and R = 4 as two emulated nodes of L = 2. The counting is done here, not by the code under
test, so the same script measures any tree: run it from this checkout, and with
``PYTHONPATH=<other checkout>`` for the figures before.

Per training step (``dispatch`` of x and probs needing gradients, ``combine(recv_x)``, backward),
T=256, E=16, k=4, H=1000 bf16 (H not a multiple of 16 / 256, so padding shows), per rank:

- ``combines``: DeepEP combine kernels in the step (forward 1; the dispatch backward was 2 on V1
  and 1 + k on V2 and V2.5: N10); ``kernels``: every DeepEP kernel;
- ``configs``: DeepEP ``Config`` objects built (pybind constructions, N20);
- ``ops`` / ``MiB``: the adapter's aten ops outside DeepEP (not under its Python layer or the
  emulated runtime; views excluded) and the bytes of the fresh tensors they allocate (N11, N21);
- ``waits``: where the current stream waits on a DeepEP event, V1 with ``deepep_async_finish``
  (N13), and how many of them come before ``dispatch_start(...).wait()``;
- ``rebuilds``: buffers built while the row width creeps from 8 to 1024 columns in steps of 8
  (a fake ``deep_ep`` module; N19);
- ``auto``: what ``deepep_api='auto'`` picks across nodes for a bounded dropless dispatch, and the
  inter-node bytes V1's internode kernels and V2's direct mode send for the same tokens.

Run: ``.venv/bin/python benchmarks/bench_deepep_savings.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from bench_deepep_ops import _VIEW_OPS  # the ops that move no data (this folder is on sys.path)
from torch.utils._python_dispatch import TorchDispatchMode

if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

T, E_PER_RANK, K, H = 256, 8, 4, 1000


class _Adapter(TorchDispatchMode):
    """The adapter's aten ops (outside DeepEP) and the bytes of fresh tensors they return."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.fresh = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.utils._pytree import tree_flatten

        from tests.deepep_emu.runtime.transport import inside_deepep

        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in _VIEW_OPS or inside_deepep():
            return out
        self.ops += 1
        ins = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in ins:
                self.fresh += t.untyped_storage().nbytes()
        return out


def _count_configs(emu: Any) -> list[int]:
    built = [0]
    cls = emu.Config
    init = cls.__init__

    def counted(self: Any, *a: Any, **kw: Any) -> None:
        built[0] += 1
        init(self, *a, **kw)

    cls.__init__ = counted
    return built


def _count_waits() -> list[int]:
    from tests.deepep_emu.runtime import config as emu_config

    waits = [0]
    fn = emu_config.EventHandle.current_stream_wait

    def counted(self: Any) -> None:
        waits[0] += 1
        fn(self)

    emu_config.EventHandle.current_stream_wait = counted  # type: ignore[method-assign]
    return waits


def _inputs(rank: int, R: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    E = E_PER_RANK * R
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :K].contiguous()
    probs = torch.rand(T, K, generator=g)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    return x, idx, probs


def _step(rank: int, R: int, emu: Any, built: list[int], api: str, W: int) -> dict[str, Any]:
    from flexdispatch import DispatchConfig, FlexDispatcher
    from tests.deepep_emu.runtime import transport

    cfg = DispatchConfig(
        backend="deepep",
        deepep_api=api,
        ranks_per_node=R,
        num_worst_tokens=W,
        num_max_dispatch_tokens_per_rank=T,
    )
    d = FlexDispatcher(cfg, num_experts=E_PER_RANK * R, _deep_ep=emu)
    x, idx, probs = _inputs(rank, R)

    def step() -> None:
        xs, ps = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        res = d.dispatch(xs, idx, ps)
        y = d.combine(res.recv_x, res.handle)
        (y.float().sum() + (res.recv_topk_probs * 0.5).sum()).backward()

    step()  # warm: buffers built, shapes seen
    transport.reset()
    configs = built[0]
    mode = _Adapter()
    with mode:
        step()
    kernels = transport.counters()
    d.close()
    return {
        "combines": sum(n for k, n in kernels.items() if k.endswith("combine")),
        "kernels": sum(n for k, n in kernels.items() if k != "collectives"),
        "configs": built[0] - configs,
        "ops": mode.ops,
        "MiB": round(mode.fresh / 2**20, 2),
    }


def _async(rank: int, R: int, emu: Any, waits: list[int]) -> dict[str, Any]:
    from flexdispatch import DispatchConfig, FlexDispatcher

    cfg = DispatchConfig(
        backend="deepep", deepep_api="v1", ranks_per_node=R, deepep_async_finish=True
    )
    d = FlexDispatcher(cfg, num_experts=E_PER_RANK * R, _deep_ep=emu)
    x, idx, probs = _inputs(rank, R)
    d.dispatch(x, idx, probs)
    before = waits[0]
    d.dispatch(x, idx, probs)
    out: dict[str, Any] = {"waits_per_dispatch": waits[0] - before}
    start = getattr(d, "dispatch_start", None)
    if start is not None:
        before = waits[0]
        pending = start(x, idx, probs)
        out["waits_before_wait"] = waits[0] - before
        pending.wait()
    else:
        out["waits_before_wait"] = "no dispatch_start"
    d.close()
    return out


def _auto_nodes(rank: int, R: int, emu: Any) -> dict[str, Any]:
    from flexdispatch import DispatchConfig, FlexDispatcher

    L = 2
    x, idx, probs = _inputs(rank, R)
    base = {"backend": "deepep", "ranks_per_node": L, "num_max_dispatch_tokens_per_rank": T}
    d = FlexDispatcher(DispatchConfig(**base), num_experts=E_PER_RANK * R, _deep_ep=emu)
    out: dict[str, Any] = {"auto": type(d.backend).__name__}
    d.close()
    for api in ("legacy", "elastic"):
        d = FlexDispatcher(
            DispatchConfig(**base, deepep_api=api), num_experts=E_PER_RANK * R, _deep_ep=emu
        )
        res = d.dispatch(x, idx, probs)
        d.combine(res.recv_x, res.handle)
        s = d.stats
        out[api] = {"inter_MiB": round(s.bytes_sent_inter_node / 2**20, 3)}
        d.close()
    return out


def _worker(rank: int, R: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    from tests.deepep_emu.load import load_deep_ep

    out: dict[str, Any] = {}
    if R == 2:
        emu = load_deep_ep(release="2.1.0")
        built = _count_configs(emu)
        waits = _count_waits()
        for api in ("legacy", "elastic"):
            for W in (0, R * T):
                out[f"{api} {'worst-case' if W else 'dropless'}"] = _step(
                    rank, R, emu, built, api, W
                )
        emu25 = load_deep_ep(release="2.5.0")
        for W in (0, R * T):
            out[f"ep {'worst-case' if W else 'dropless'}"] = _step(rank, R, emu25, [0], "ep", W)
        out["async"] = _async(rank, R, emu, waits)
    else:
        out["nodes"] = _auto_nodes(rank, R, load_deep_ep(nvl_peers=2, release="2.1.0"))
    return out


def _rebuilds() -> dict[str, Any]:
    from flexdispatch.backends.deepep import buffer as B
    from flexdispatch.backends.deepep import sizing as S

    out: dict[str, Any] = {}
    built: list[int] = []

    class Buffer:
        def __init__(self, group: Any, **kw: Any) -> None:
            built.append(1)

        def destroy(self) -> None:
            pass

    for rdma in (0, 1):
        built.clear()
        shared = B.SharedBuffer(deep_ep=SimpleNamespace(Buffer=Buffer), group=None)
        for w in range(8, 1025, 8):
            need = S.BufferSize(num_nvl_bytes=128 * w, num_rdma_bytes=64 * w * rdma)
            shared.ensure(need, low_latency=False, num_qps_per_rank=24)
        out["with RDMA (NVSHMEM re-init)" if rdma else "intranode"] = len(built)
    out["bound"] = int(math.log2(1024 / 8)) + 1
    return out


def main() -> None:
    import flexdispatch
    from tests.dist.harness import run_group

    print(f"tree: {Path(flexdispatch.__file__).resolve().parents[1]}")
    one = run_group(_worker, 2, timeout=600)[0]
    nodes = run_group(_worker, 4, timeout=600, env={"LOCAL_WORLD_SIZE": "2"})[0]["nodes"]
    print(f"\nper training step, rank 0 (T={T}, E={E_PER_RANK * 2}, k={K}, H={H} bf16, R=2):")
    print("| path | DeepEP combines | DeepEP kernels | Configs built | adapter ops | adapter MiB |")
    print("|---|---|---|---|---|---|")
    for key, got in one.items():
        if key == "async":
            continue
        print(
            f"| {key} | {got['combines']} | {got['kernels']} | {got['configs']} | {got['ops']} | "
            f"{got['MiB']} |"
        )
    a = one["async"]
    print(
        f"\nV1 deepep_async_finish: stream waits per dispatch {a['waits_per_dispatch']}; "
        f"before dispatch_start(...).wait(): {a['waits_before_wait']}"
    )
    print(f"\nbuffer rebuilds, row width 8..1024 columns in steps of 8: {_rebuilds()}")
    print(
        f"\nacross nodes (R=4, L=2, num_max_dispatch_tokens_per_rank={T}): auto -> "
        f"{nodes['auto']}; inter-node MiB (dispatch + combine, rank 0): V1 internode "
        f"{nodes['legacy']['inter_MiB']}, V2 direct {nodes['elastic']['inter_MiB']}"
    )


if __name__ == "__main__":
    main()
