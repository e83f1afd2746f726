"""Every "no host sync" claim, checked on CUDA with a detector that sees every wait
(``tests/gpu/sync_detector.py``: a long GPU spin queued before the step; the step synced iff the
spin's event is done when it returns).

Claimed sync-free (each must come back pending): worst-case dispatch + combine on the torch
backend (the backend one GPU can run; DeepEP needs two), as a world of one runs it (no
collective) and with the backend's collective paths forced on (NCCL's all-to-alls of one rank),
routing (grouped sigmoid, softmax with capacity; the default and the torch implementations),
the dispatch layout, the static permute + unpermute (``static_rows``), the decode path
(``DecodeDispatcher`` in worst-case mode, the expert-major maps) and DeepEP's worst-case receive
masking. Known to sync, so the detector must fire: the dropless dispatch, both ways (a pinned
copy + an event synchronize, which ``torch.cuda.set_sync_debug_mode`` does not see) and the
exact-size permute (one ``.item()``).

Skipped without CUDA. One spawned process (an NCCL group of world size 1, bound to cuda:0) runs
every case; the tests read its results. Shape letters (ARCHITECTURE.md): T tokens · H hidden ·
E experts · k top-k · R ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA (the detector spins a GPU)"
    ),
]

T, H, E, K, R = 2048, 512, 64, 8, 8

SYNC_FREE = (
    "worst-case dispatch+combine (torch)",
    "worst-case dispatch+combine (torch, collectives forced)",
    "routing: sigmoid, 8 groups / 4",
    "routing: sigmoid, 8 groups / 4 (torch impl)",
    "routing: softmax with capacity",
    "layout",
    "static permute+unpermute",
    "static permute+unpermute (torch impl)",
    "decode dispatch+combine (worst-case)",
    "decode expert-major maps",
    "deepep worst-case masking",
)
SYNCING = (
    "dropless dispatch+combine (torch)",
    "dropless dispatch+combine (torch, collectives forced)",
    "exact-size permute",
)


def _cases(dev: torch.device) -> dict[str, Any]:
    from flexdispatch import (
        DispatchConfig,
        FlexDispatcher,
        get_dispatch_layout,
        permute,
        topk_routing,
        unpermute,
    )
    from flexdispatch.backends.deepep import sizing
    from flexdispatch.dispatch.decode import (
        DecodeDispatcher,
        expert_major_maps,
        from_expert_major,
        to_expert_major,
    )

    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(T, E, device=dev, generator=g)
    x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
    r = topk_routing(logits, topk=K, score_function="sigmoid", num_groups=8, group_topk=4)
    idx, probs = r.topk_idx, r.topk_probs
    worst = FlexDispatcher(DispatchConfig(backend="torch", num_worst_tokens=T), num_experts=E)
    dropless = FlexDispatcher(DispatchConfig(backend="torch"), num_experts=E)
    # NOTE: a group of one runs no collective; forced, it runs the paths of R ranks (NCCL)
    worst_nccl = FlexDispatcher(DispatchConfig(backend="torch", num_worst_tokens=T), num_experts=E)
    dropless_nccl = FlexDispatcher(DispatchConfig(backend="torch"), num_experts=E)
    for d in (worst_nccl, dropless_nccl):
        d.backend.distributed = True
    decoder = DecodeDispatcher(
        FlexDispatcher(DispatchConfig(backend="torch", num_worst_tokens=256), num_experts=E),
        num_max_dispatch_tokens_per_rank=256,
    )
    e_local = E // R
    local_idx = torch.where(idx < e_local, idx, -1)[:512]

    def step(d: Any) -> torch.Tensor:
        res = d.dispatch(x, idx, probs)
        return d.combine(res.recv_x, res.handle)

    def decode() -> torch.Tensor:
        res = decoder.dispatch(x[:256], idx[:256], probs[:256])
        return decoder.combine(res.recv_x, res.handle)

    def maps() -> torch.Tensor:
        m = sizing.mask_worst_case(x[:512], local_idx, probs[:512], e_local)
        mp = expert_major_maps(m.recv_topk_idx, e_local, 512)
        y = to_expert_major(m.recv_x, mp, 512)
        return from_expert_major(y, mp, m.recv_topk_probs)

    def static_permute(impl: str) -> torch.Tensor:
        p = permute(x, idx, E, topk_probs=probs, static_rows=T * K, impl=impl)
        return unpermute(p.x, p, probs=p.probs, impl=impl)

    return {
        "worst-case dispatch+combine (torch)": lambda: step(worst),
        "worst-case dispatch+combine (torch, collectives forced)": lambda: step(worst_nccl),
        "routing: sigmoid, 8 groups / 4": lambda: topk_routing(
            logits, topk=K, score_function="sigmoid", num_groups=8, group_topk=4
        ),
        "routing: sigmoid, 8 groups / 4 (torch impl)": lambda: topk_routing(
            logits, topk=K, score_function="sigmoid", num_groups=8, group_topk=4, impl="torch"
        ),
        "routing: softmax with capacity": lambda: topk_routing(logits, topk=K, capacity_factor=1.0),
        "layout": lambda: get_dispatch_layout(idx, E, R),
        "static permute+unpermute": lambda: static_permute("auto"),
        "static permute+unpermute (torch impl)": lambda: static_permute("torch"),
        "decode dispatch+combine (worst-case)": decode,
        "decode expert-major maps": maps,
        "deepep worst-case masking": lambda: sizing.mask_worst_case(
            x[:512], local_idx, probs[:512], e_local
        ),
        "dropless dispatch+combine (torch)": lambda: step(dropless),
        "dropless dispatch+combine (torch, collectives forced)": lambda: step(dropless_nccl),
        "exact-size permute": lambda: permute(x, idx, E, topk_probs=probs),
    }


def detector_worker() -> dict[str, dict[str, Any]]:
    from tests.gpu.sync_detector import cuda_detector

    dev = torch.device("cuda", torch.cuda.current_device())
    det = cuda_detector()
    out: dict[str, dict[str, Any]] = {}
    for name, fn in _cases(dev).items():
        try:
            got = det.check(fn)
            out[name] = {
                "synced": got.synced,
                "host_ms": round(got.host_ms, 3),
                "plain_ms": round(got.plain_ms, 3),
                "spin_ms": round(got.spin_ms, 3),
            }
        except Exception as exc:  # reported per case, so one failure does not hide the others
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


@pytest.fixture(scope="module")
def seen() -> dict[str, dict[str, Any]]:
    from flexdispatch.launch import spawn_group

    return spawn_group(detector_worker, 1, backend="nccl", timeout_s=240)[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", SYNCING)
def test_the_detector_fires_on_the_paths_that_wait(seen: dict, name: str) -> None:
    got = seen[name]
    assert "error" not in got, got
    assert got["synced"], f"{name}: the detector missed a known wait: {got}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", SYNC_FREE)
def test_claimed_sync_free_paths_never_wait(seen: dict, name: str) -> None:
    got = seen[name]
    assert "error" not in got, got
    assert not got["synced"], f"{name}: waited on the GPU (a host sync): {got}"
    assert got["host_ms"] < got["spin_ms"]
