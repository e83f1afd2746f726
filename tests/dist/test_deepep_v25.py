"""The deepep backend's DeepEP 2.5 path (``deepep_api="v25"``, ``deep_ep_v25.EPBuffer``) under the
dispatch contract, on DeepEP 2.5's own ``buffers/ep.py`` over the emulated runtime.

Shape letters (ARCHITECTURE.md): T tokens · H hidden · E experts · R ranks · e = E / R · k top-k ·
L ranks per node · M received rows · W worst-case rows.

One spawned group per topology — one node of 2 and of 4 ranks, two emulated nodes of 2
(``load_deep_ep(release="2.5.0", nvl_peers=2)``: hybrid mode, and direct mode on the same group)
— runs the shared contract checks (``test_contract._check_dispatch``) dropless and worst-case on
every case, the modes' bit-equality, combine against the reference and the byte counts per link
class; the groups of 2 and 2 x 2 also autograd, bf16 and 300-column rows, ``MoELayer`` forward
and backward against the torch backend (shared experts added inside the combine) and the bias
fusion against the separate add.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist.harness import run_group
from tests.dist.reference import CASES, all_inputs, expert_fn, ref_combine, ref_dispatch
from tests.dist.test_contract import E_PER_RANK, H, K, _check_dispatch


def _emu(L: int) -> Any:
    from tests.deepep_emu.load import load_deep_ep

    return load_deep_ep(nvl_peers=L, release="2.5.0")


def _make(R: int, L: int, W: int = 0, **kw: Any) -> Any:
    from flexdispatch import DispatchConfig, FlexDispatcher

    cfg = DispatchConfig(
        backend="deepep", deepep_api="v25", ranks_per_node=L, num_worst_tokens=W, **kw
    )
    return FlexDispatcher(cfg, num_experts=E_PER_RANK * R, _deep_ep=_emu(L))


def _worst(inputs: list[Any]) -> int:
    return len(inputs) * max(max(inp.x.shape[0] for inp in inputs), 1)


def _a(n: int, b: int) -> int:
    return -(-n // b) * b


def expected_bytes(
    idx: torch.Tensor, rank: int, R: int, L: int, hybrid: bool, drow: int, crow: int
) -> tuple[int, int, int]:
    """(rows sent, NVLink bytes, RDMA bytes) of one dispatch + combine, counted per token.

    Direct mode: a row per destination rank, NVLink inside the node (not to itself), RDMA
    across. Hybrid mode: one RDMA row per destination node, then an NVLink hop to every
    destination rank whose local index differs from the source's. Combine mirrors dispatch.
    """
    e = E_PER_RANK
    sent = intra = inter = 0
    for row in idx.tolist():
        ranks = sorted({i // e for i in row if i >= 0})
        sent += len(ranks)
        for g in ranks:
            if hybrid:
                intra += g % L != rank % L
            elif g // L == rank // L:
                intra += g != rank
            else:
                inter += 1
        if hybrid:
            inter += len({g // L for g in ranks} - {rank // L})
    return sent, intra * (drow + crow), inter * (drow + crow)


# --------------------------------------------------------------------- contract
def contract(
    rank: int, R: int, L: int, seed: int, hybrid: bool | None, cases: tuple[str, ...] = CASES
) -> int:
    from flexdispatch.backends.deepep.v25.backend import DeepEPV25Backend

    E = E_PER_RANK * R
    kw = {"R": R, "E": E, "k": K, "H": H}
    checked = 0
    # fp32 rows of H = 8: 16 bf16 wire columns; the fp32 combine runs H narrow combines
    drow = _a(_a(32, 32) + _a(8 * K + 4 * (1 + K), 32), 64)
    crow = H * _a(_a(2 * 256, 32) + _a(8 * K, 32), 64)
    for case in cases:
        inputs = all_inputs(seed, case=case, **kw)
        mine = inputs[rank]
        ref = ref_dispatch(inputs, rank, E)
        ref_out = ref_combine(mine, E, R)
        W = _worst(inputs)
        noisy = all_inputs(seed + 1, case=case, exact=False, **kw)
        seen = {}
        for worst in (False, True):
            where = f"rank {rank} {case} {'worst' if worst else 'dropless'} hybrid={hybrid}"
            d = _make(R, L, W if worst else 0, deepep_hybrid=hybrid)
            assert isinstance(d.backend, DeepEPV25Backend), where
            assert d.backend.hybrid == (L < R and hybrid is not False), where
            res = d.dispatch(mine.x, mine.idx, mine.probs)
            _check_dispatch(res, ref, W if worst else 0, where)
            out = d.combine(expert_fn(res.recv_x, res.recv_topk_probs, rank), res.handle)
            assert out.shape == mine.x.shape and out.dtype == mine.x.dtype, where
            torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=0, msg=where)
            s = d.stats
            assert s.host_syncs == (0 if worst else 1), f"{where}: {s}"
            want = expected_bytes(mine.idx, rank, R, L, d.backend.hybrid, drow, crow)
            got = (s.rows_sent, s.bytes_sent_intra_node, s.bytes_sent_inter_node)
            assert got == want, f"{where}: {got} != {want}"
            assert s.rows_received == ref.x.shape[0], where
            nx = noisy[rank]
            r2 = d.dispatch(nx.x, nx.idx, nx.probs)
            y2 = torch.sin(r2.recv_x) * 1.37 + r2.recv_x * r2.recv_topk_probs.sum(1, keepdim=True)
            o2 = d.combine(y2, r2.handle)
            M2 = ref_dispatch(noisy, rank, E).x.shape[0]
            seen[worst] = (r2.recv_x[:M2], r2.recv_topk_idx[:M2], r2.recv_topk_probs[:M2], o2)
            d.close()
            checked += 1
        for a, b in zip(seen[False], seen[True], strict=True):
            assert torch.equal(a, b), f"rank {rank} {case}: worst-case prefix differs"
    return checked


def rows(rank: int, R: int, L: int, seed: int) -> int:
    """bf16 and 300-column rows move bit for bit and combine to bf16 precision (autograd:
    ``test_contract.py``)."""
    E = E_PER_RANK * R
    checked = 0
    for width in (H, 300):
        inputs = all_inputs(seed, exact=False, dtype=torch.bfloat16, R=R, E=E, k=K, H=width)
        mine = inputs[rank]
        ref = ref_dispatch(inputs, rank, E)
        M = ref.x.shape[0]
        for worst in (False, True):
            where = f"rank {rank} bf16 H={width} {'worst' if worst else 'dropless'}"
            d = _make(R, L, _worst(inputs) if worst else 0)
            res = d.dispatch(mine.x, mine.idx, mine.probs)
            assert torch.equal(res.recv_x[:M], ref.x), where
            assert torch.equal(res.recv_topk_idx[:M], ref.idx), where
            out = d.combine(res.recv_x, res.handle)
            n_dest = torch.tensor(
                [len({i // E_PER_RANK for i in r if i >= 0}) for r in mine.idx.tolist()],
                dtype=torch.float32,
            )
            assert out.dtype == torch.bfloat16, where
            want = mine.x.float() * n_dest[:, None]
            torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=1e-2, msg=where)
            d.close()
            checked += 1
    return checked


# --------------------------------------------------------------------- MoELayer end to end
def moe(rank: int, R: int, L: int) -> list[dict[str, Any]]:
    from flexdispatch.config import load_config
    from flexdispatch.moe import MoELayer
    from tests.deepep_emu.runtime import ep as emu_ep

    biases: list[bool] = []
    real = emu_ep.EPRuntime.combine

    def spy(self: Any, x: torch.Tensor, w: Any, b0: Any, *args: Any) -> Any:
        biases.append(b0 is not None)
        return real(self, x, w, b0, *args)

    emu_ep.EPRuntime.combine = spy  # type: ignore[method-assign]
    T, out = 4, []
    for hidden, dtype, W in (
        (256, torch.bfloat16, 0),
        (300, torch.float32, 0),
        (256, torch.bfloat16, R * T),
    ):
        cfg = load_config("tiny_cpu").model_copy(
            update={"hidden_size": hidden, "ffn_hidden_size": 32, "num_shared_experts": 1}
        )
        got = {}
        for backend in ("deepep", "torch"):
            dispatch = cfg.dispatch.model_copy(
                update={
                    "backend": backend,
                    "deepep_api": "v25",
                    "ranks_per_node": L,
                    "num_worst_tokens": W,
                    "expert_alignment": 4 if W else 1,
                }
            )
            c = cfg.model_copy(update={"dispatch": dispatch})
            kw = {"_deep_ep": _emu(L)} if backend == "deepep" else {}
            layer = MoELayer(c, seed=5, dtype=dtype, **kw)
            g = torch.Generator().manual_seed(100 + rank)
            x = torch.randn(T, hidden, generator=g).to(dtype).requires_grad_(True)
            biases.clear()
            res = layer(x)
            fused = list(biases)
            w = torch.randn(T, hidden, generator=g).to(dtype)
            (res.output.float() * w.float()).sum().backward()
            assert layer.shared_experts is not None
            got[backend] = (
                res.output.detach().float(),
                x.grad.float(),
                layer.router.weight.grad.float(),
                layer.experts.w2.grad.float(),
                layer.shared_experts.w1.grad.float(),
                type(res.dispatch).__name__,
                fused,
                layer.dispatcher.stats.host_syncs,
            )
            layer.dispatcher.close()
        d, t = got["deepep"], got["torch"]

        def rel(a: torch.Tensor, b: torch.Tensor) -> float:
            return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))

        out.append(
            {
                "case": (hidden, str(dtype), W),
                "rel": [rel(d[i], t[i]) for i in range(5)],
                "result": d[5],
                "fused": d[6],
                "syncs": d[7],
            }
        )
    emu_ep.EPRuntime.combine = real  # type: ignore[method-assign]
    out.append(bias_fusion(rank, R, L))
    return out


def bias_fusion(rank: int, R: int, L: int) -> dict[str, Any]:
    """``combine(y, bias=s)`` (inside DeepEP's reduction: one rounding) against
    ``combine(y) + s`` (two): bit-equal where the sums are exact in bf16, within one bf16
    rounding otherwise; gradients of ``y`` and ``s`` equal."""
    E = E_PER_RANK * R
    inputs = all_inputs(3, R=R, E=E, k=K, H=256, dtype=torch.bfloat16, exact=False)
    mine = inputs[rank]
    d = _make(R, L)
    res = d.dispatch(mine.x, mine.idx, mine.probs)
    g = torch.Generator().manual_seed(rank)
    out: dict[str, Any] = {}
    for name, scale in (("exact", None), ("random", 1.0)):
        if scale is None:  # small integers: every sum exact in bf16
            y = torch.randint(-8, 8, res.recv_x.shape, generator=g).to(torch.bfloat16)
            s = torch.randint(-8, 8, mine.x.shape, generator=g).to(torch.bfloat16)
        else:
            y = torch.randn(res.recv_x.shape, generator=g).to(torch.bfloat16)
            s = torch.randn(mine.x.shape, generator=g).to(torch.bfloat16)
        y1, s1 = y.clone().requires_grad_(), s.clone().requires_grad_()
        y2, s2 = y.clone().requires_grad_(), s.clone().requires_grad_()
        fused = d.combine(y1, res.handle, bias=s1)
        apart = d.combine(y2, res.handle) + s2
        gw = torch.randn(fused.shape, generator=g).to(torch.bfloat16)
        (fused * gw).sum().backward()
        (apart * gw).sum().backward()
        out[name] = (
            bool(torch.equal(fused, apart)),
            float((fused.float() - apart.float()).abs().max() / apart.float().abs().max()),
            bool(torch.equal(y1.grad, y2.grad) and torch.equal(s1.grad, s2.grad)),
        )
    d.close()
    return out


def group_worker(rank: int, R: int, L: int, seed: int, full: bool) -> dict[str, Any]:
    report: dict[str, Any] = {"contract": contract(rank, R, L, seed, None)}
    if L < R:  # two emulated nodes: direct mode on the same group too
        report["direct"] = contract(rank, R, L, seed, False, ("random", "receives_nothing"))
    if full:
        report["rows"] = rows(rank, R, L, seed)
        report["moe"] = moe(rank, R, L)
    return report


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("R", "L", "full"),
    [(2, 2, True), (4, 4, False), (4, 2, True)],
    ids=["R2-one-node", "R4-one-node", "R4-two-nodes"],
)
def test_ep_contract(R: int, L: int, full: bool) -> None:
    for report in run_group(group_worker, R, L, 1234, full, timeout=280):
        assert report["contract"] == 2 * len(CASES), report
        if L < R:
            assert report["direct"] == 4, report
        if not full:
            continue
        assert report["rows"] == 4, report
        *layers, fusion = report["moe"]
        for c in layers:
            # V2.5 combines in bf16: the layers agree with the torch backend to bf16 precision
            assert c["result"] == "ExpandedDispatchResult", c
            assert max(c["rel"]) < 3e-2, c
            # the shared experts ride the combine as its bias on bf16 rows, never on fp32 ones
            assert c["fused"] == [c["case"][1] == "torch.bfloat16"], c
            assert c["syncs"] == (0 if c["case"][2] else 1), c
        assert fusion["exact"][0] and fusion["exact"][2], fusion
        assert fusion["random"][1] < 2**-7 and fusion["random"][2], fusion


# --------------------------------------------------------------------- 16 ranks, 2 nodes of 8
def layer16(rank: int, R: int) -> dict[str, Any]:
    """``MoELayer`` (tiny: H = 256 bf16, 16 experts, top-4, a shared expert) on 2 emulated
    nodes of 8, worst-case (static shapes, hybrid mode), forward and backward against torch."""
    from flexdispatch.config import load_config
    from flexdispatch.moe import MoELayer

    T, L = 3, 8
    cfg = load_config("tiny_cpu").model_copy(
        update={"hidden_size": 256, "ffn_hidden_size": 16, "num_shared_experts": 1}
    )
    got = {}
    for backend in ("deepep", "torch"):
        dispatch = cfg.dispatch.model_copy(
            update={
                "backend": backend,
                # NOTE: "ep", not "auto": MoELayer checks V1's topology rules under "auto" with
                # L = R (audit N1, another helper's fix)
                "deepep_api": "v25",
                "ranks_per_node": L,
                "num_worst_tokens": R * T,
            }
        )
        c = cfg.model_copy(update={"dispatch": dispatch})
        kw = {"_deep_ep": _emu(L)} if backend == "deepep" else {}
        layer = MoELayer(c, seed=7, dtype=torch.bfloat16, **kw)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(T, 256, generator=g).to(torch.bfloat16).requires_grad_(True)
        out = layer(x).output
        (out.float() * torch.randn(T, 256, generator=g)).sum().backward()
        b = layer.dispatcher.backend
        got[backend] = (
            out.detach().float(),
            x.grad.float(),
            layer.router.weight.grad.float(),
            getattr(b, "hybrid", None),
            layer.dispatcher.stats.host_syncs,
        )
        layer.dispatcher.close()
    d, t = got["deepep"], got["torch"]
    rel = [
        float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
        for a, b in zip(d[:3], t[:3], strict=True)
    ]
    return {"rel": rel, "hybrid": d[3], "syncs": d[4]}


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_ep_layer_on_16_ranks_as_two_nodes_of_8() -> None:
    for out in run_group(layer16, 16, timeout=280):
        assert out["hybrid"] is True and out["syncs"] == 0, out
        assert max(out["rel"]) < 3e-2, out
