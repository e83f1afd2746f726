"""The planner's DeepEP V2 (``ElasticBuffer``) sizing: the size hint against the test emulator's
own copy of it, against hand-computed values, and against what the V2 path really allocates.

Shape letters: T tokens per rank · H hidden · E experts · R ranks · e = E / R · k top-k ·
L ranks per node (the NVLink domain) · M ``num_max_tokens_per_rank`` · W worst-case rows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flexdispatch.planner import (
    deepep_elastic_hints,
    elastic_buffer_size,
    elastic_buffer_size_hint,
    elastic_hidden,
)
from tests.deepep_emu.runtime.elastic import calculate_buffer_size
from tests.deepep_emu.runtime.limits import DeepEPHostAssert
from tests.dist.harness import run_group

MIB2 = 2 * 1024 * 1024


def hint(**kw: Any) -> int:
    return elastic_buffer_size_hint(**kw)


# ------------------------------------------------------------------ against the emulator
@pytest.mark.parametrize("R", [2, 4, 8, 16, 32])
@pytest.mark.parametrize("L", [8, None], ids=["L8", "LR"])
def test_direct_mode_equals_the_emulator(R: int, L: int | None) -> None:
    L = R if L is None else L
    compared = refused = 0
    for M in (1, 37, 128, 4096):
        for H in (16, 48, 256, 2048, 7168, 7184):
            for k in (0, 1, 8, 32):
                for fp8 in (False, True):
                    for amr in (False, True):
                        # hybrid mode with a single NVLink domain is direct mode too
                        for hybrid in (False, True) if R <= L else (False,):
                            args = (R, L, M, H, k, fp8, hybrid, amr)
                            try:
                                want = calculate_buffer_size("2.1.0", *args)
                            except DeepEPHostAssert:
                                want = None
                            kw = {
                                "num_ranks": R,
                                "num_nvl_ranks": L,
                                "num_max_tokens_per_rank": M,
                                "hidden": H,
                                "num_topk": k,
                                "use_fp8_dispatch": fp8,
                                "allow_hybrid_mode": hybrid,
                                "allow_multiple_reduction": amr,
                            }
                            if want is None:  # fp8 rows of H % 32 != 0 bytes
                                with pytest.raises(ValueError, match="multiple of 32"):
                                    hint(**kw)
                                refused += 1
                                continue
                            assert hint(**kw) == want, args
                            compared += 1
    assert compared >= 250 and refused > 0


# ------------------------------------------------------------------ by hand
def test_direct_intranode_by_hand() -> None:
    # R = L = 8 (one NVLink domain: no send buffers), M = 4096, H = 7168 bf16, k = 8:
    #   dispatch slot a(7168 * 2) + a(0) + a(8 * 8 + 9 * 4 = 100) = 14336 + 0 + 128 = 14464
    #   combine slot  a(14336) + a(64) = 14400
    #   dispatch = (0 + 8) * 4096 * 14464 = 473,956,352
    #   combine  = 0 + min(8, 8) * 4096 * 14400 = 471,859,200
    #   max = 473,956,352 = 226 * 2 MiB exactly
    s = elastic_buffer_size(
        num_ranks=8, num_nvl_ranks=8, num_max_tokens_per_rank=4096, hidden=7168, num_topk=8
    )
    assert (s.dispatch_token_bytes, s.combine_token_bytes) == (14464, 14400)
    assert (s.dispatch_bytes, s.combine_bytes) == (473_956_352, 471_859_200)
    assert s.num_bytes == 473_956_352 == 226 * MIB2
    assert (s.num_rdma_ranks, s.num_nvl_ranks, s.num_scaleout_ranks, s.num_scaleup_ranks) == (
        1,
        8,
        1,
        8,
    )
    assert s.scaleup_nvlink


def test_direct_internode_by_hand() -> None:
    # R = 16 over NVLink domains of 8 (direct mode: scale-up 16 != NVLink 8, send buffers):
    #   dispatch = (1 + 16) * 4096 * 14464 = 1,007,157,248
    #   combine  = 16 * 4096 * 1 * 14400 + min(16, 8) * 4096 * 14400 = 24 * 4096 * 14400
    #            = 1,415,577,600 = 675 * 2 MiB
    s = elastic_buffer_size(
        num_ranks=16, num_nvl_ranks=8, num_max_tokens_per_rank=4096, hidden=7168, num_topk=8
    )
    assert (s.num_rdma_ranks, s.num_nvl_ranks, s.num_scaleout_ranks, s.num_scaleup_ranks) == (
        2,
        8,
        1,
        16,
    )
    assert not s.scaleup_nvlink
    assert (s.dispatch_bytes, s.combine_bytes) == (1_007_157_248, 1_415_577_600)
    assert s.num_bytes == 675 * MIB2


def test_fp8_single_reduction_by_hand() -> None:
    # R = 4 in a domain of 8 (capped at R: NVLink), M = 128, H = 2048 fp8, k = 4, amr off:
    #   scale packs ceil(2048 / 32) = 64 -> 256 bytes
    #   dispatch slot a(2048) + a(256) + a(4 * 8 + 5 * 4 = 52) = 2048 + 256 + 64 = 2368
    #   combine slot  a(4096) + a(32) = 4128
    #   dispatch = 4 * 128 * 2368 = 1,212,416
    #   combine  = 0 + k * 128 * 4128 = 2,113,536 -> rounded up to 2 MiB: 4,194,304
    s = elastic_buffer_size(
        num_ranks=4,
        num_nvl_ranks=8,
        num_max_tokens_per_rank=128,
        hidden=2048,
        num_topk=4,
        use_fp8_dispatch=True,
        allow_multiple_reduction=False,
    )
    assert s.num_nvl_ranks == 4 and s.scaleup_nvlink
    assert (s.dispatch_token_bytes, s.combine_token_bytes) == (2368, 4128)
    assert (s.dispatch_bytes, s.combine_bytes) == (1_212_416, 2_113_536)
    assert s.num_bytes == 4_194_304


def test_hybrid_by_hand() -> None:
    # R = 32 over domains of 8, hybrid: SO = 4 scale-out x SU = 8 scale-up, M = 256, H = 7168,
    # k = 8 (slots 14464 / 14400 as above), C = 1280 channels:
    #   dispatch = 14464 * (8 * (4 * 256) + 256 + 4 * (256 + 1280)) = 14464 * 14592 = 211,058,688
    #   amr:  combine = 14400 * (min(8, 8) * 4 * 256 + min(4, 8) * 256 + 1 * 4 * 1536)
    #                 = 14400 * 15360 = 221,184,000 -> 106 * 2 MiB = 222,298,112
    #   no amr: combine = 14400 * 8 * (4 * 256 + 256 + 4 * 1536) = 14400 * 59392 = 855,244,800
    #                 -> 408 * 2 MiB = 855,638,016
    kw = {"num_ranks": 32, "num_nvl_ranks": 8, "num_max_tokens_per_rank": 256, "hidden": 7168}
    s = elastic_buffer_size(**kw, num_topk=8, allow_hybrid_mode=True)
    assert (s.num_scaleout_ranks, s.num_scaleup_ranks, s.scaleup_nvlink) == (4, 8, True)
    assert (s.dispatch_bytes, s.combine_bytes) == (211_058_688, 221_184_000)
    assert s.num_bytes == 222_298_112 == 106 * MIB2
    single = elastic_buffer_size(
        **kw, num_topk=8, allow_hybrid_mode=True, allow_multiple_reduction=False
    )
    assert single.combine_bytes == 855_244_800 and single.num_bytes == 408 * MIB2


def test_topk_zero_sizes_for_32() -> None:
    kw = {"num_ranks": 8, "num_nvl_ranks": 8, "num_max_tokens_per_rank": 64, "hidden": 1024}
    assert elastic_buffer_size(**kw, num_topk=0) == elastic_buffer_size(**kw, num_topk=32)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_max_tokens_per_rank": 0}, "positive"),
        ({"hidden": 0}, "positive"),
        ({"hidden": 2}, r"ceil\(H / 32\)"),
        ({"hidden": 48, "use_fp8_dispatch": True}, "multiple of 32"),
        ({"hidden": 40}, "multiple of 32"),
        ({"num_ranks": 12}, "NVLink domain"),
        ({"num_topk": -1}, "num_topk"),
    ],
)
def test_bad_arguments_are_named(kw: dict[str, Any], match: str) -> None:
    base = {
        "num_ranks": 16,
        "num_nvl_ranks": 8,
        "num_max_tokens_per_rank": 128,
        "hidden": 256,
        "num_topk": 8,
    }
    with pytest.raises(ValueError, match=match):
        elastic_buffer_size(**{**base, **kw})


# ------------------------------------------------------------------ what the V2 path asks for
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("H", [8, 16, 100, 256, 300, 2048, 7168])
def test_elastic_hidden_mirrors_the_backend(dtype: torch.dtype, H: int) -> None:
    from flexdispatch.backends.deepep import bounded, sizing
    from flexdispatch.backends.deepep.v2 import backend as v2

    x = torch.zeros(3, H, dtype=dtype)
    _, _, wire = sizing.split_rows(x, fp8_multiple=32)
    sent = sizing.pad_cols(wire.send(x), v2._DISPATCH_COL_MULTIPLE)
    want_dispatch = max(sent.shape[1], bounded.COMBINE_COLS)  # DeepEPV2Backend.dispatch
    if dtype != torch.bfloat16 and H <= bounded._NARROW:
        want_combine = bounded.COMBINE_COLS  # _combine_fp32
    else:
        want_combine = sizing.pad_cols(x.to(torch.bfloat16), bounded.COMBINE_COLS).shape[1]
    assert elastic_hidden(H, dtype.itemsize) == (want_dispatch, want_combine)


@pytest.mark.parametrize("H", [32, 256, 2048, 7168])
def test_elastic_hidden_of_fp8_tuples(H: int) -> None:
    from flexdispatch.backends.deepep import bounded, sizing

    x8 = torch.zeros(2, H, dtype=torch.float8_e4m3fn)
    _, _, wire = sizing.split_rows((x8, torch.ones(2, max(H // 128, 1))), fp8_multiple=32)
    assert elastic_hidden(H, 1) == (
        max(wire.wire_width, bounded.COMBINE_COLS),
        -(-H // 256) * 256,
    )
    with pytest.raises(ValueError, match="H % 32"):
        elastic_hidden(H + 16, 1)


def test_plan_hints_use_the_layer_buffer() -> None:
    # fp32 rows of H = 7168: dispatch 2 * 7168 = 14336 bf16 columns, combine 7168 -> 14336
    v2 = deepep_elastic_hints(
        hidden=7168, num_experts=256, num_ranks=16, ranks_per_node=8, topk=8, tokens=512,
        elem_size=4,
    )  # fmt: skip
    assert (v2.dispatch_hidden, v2.combine_hidden, v2.hidden) == (14336, 7168, 14336)
    direct = {"num_ranks": 16, "num_nvl_ranks": 8, "hidden": 14336, "num_topk": 8}
    assert v2.dropless == elastic_buffer_size(**direct, num_max_tokens_per_rank=512)
    assert v2.worst_case_w == 512 * 16 and v2.worst_case == v2.dropless  # M = W / R = T
    assert v2.supported and v2.reason == ""


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({"topk": 33, "num_experts": 256}, "at most 32 experts per token"),
        ({"num_experts": 4096}, "at most 2048 experts"),
        ({"num_experts": 2048, "num_ranks": 4, "ranks_per_node": 4}, "256 experts per rank"),
        ({"hidden": 7184, "elem_size": 1}, "H % 32"),
    ],
)
def test_plan_hints_say_why_v2_does_not_fit(kw: dict[str, Any], reason: str) -> None:
    base = {
        "hidden": 7168,
        "num_experts": 256,
        "num_ranks": 16,
        "ranks_per_node": 8,
        "topk": 8,
        "tokens": 128,
    }
    v2 = deepep_elastic_hints(**{**base, **kw})
    assert not v2.supported and reason in v2.reason
    assert v2.dropless.num_bytes > 0  # the sizes are pure arithmetic


# ------------------------------------------------------------------ what the V2 path builds
def allocated_worker(rank: int, R: int, L: int, T: int, H: int, dtype_name: str) -> list[int]:
    """Bytes of the shared ``ElasticBuffer`` after one dispatch + combine, dropless then W."""
    from flexdispatch import DispatchConfig, FlexDispatcher
    from tests.deepep_emu.load import load_deep_ep

    dtype = getattr(torch, dtype_name)
    emu = load_deep_ep(nvl_peers=L, release="2.1.0")
    E, k = 4 * R, 3
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    probs = torch.rand(T, k, generator=g)
    got = []
    for W in (0, T * R):
        cfg = DispatchConfig(
            backend="deepep",
            deepep_api="v2",
            ranks_per_node=L,
            num_worst_tokens=W,
            num_max_dispatch_tokens_per_rank=T,
        )
        d = FlexDispatcher(cfg, num_experts=E, _deep_ep=emu)
        res = d.dispatch(x, idx, probs)
        d.combine(res.recv_x, res.handle)
        got.append(d.backend._shared.num_bytes)
        d.close()
    return got


@pytest.mark.dist
@pytest.mark.parametrize(("H", "dtype"), [(300, "bfloat16"), (700, "float32")])
def test_plan_figure_is_what_the_v2_path_allocates(H: int, dtype: str) -> None:
    """Two emulated nodes of 2 ranks: the planner's V2 bytes, dropless (M = T) and worst-case
    (W = T * R), equal the shared buffer the V2 path built after a dispatch and a combine."""
    R, L, T = 4, 2, 600
    v2 = deepep_elastic_hints(
        hidden=H, num_experts=4 * R, num_ranks=R, ranks_per_node=L, topk=3, tokens=T,
        elem_size=getattr(torch, dtype).itemsize,
    )  # fmt: skip
    want = [v2.dropless.num_bytes, v2.worst_case.num_bytes]
    env = {"LOCAL_WORLD_SIZE": str(L)}
    from tests.deepep_emu.load import emulator_or_skip

    emulator_or_skip(nvl_peers=L)  # skips with the reason where the wheel's files are absent
    for got in run_group(allocated_worker, R, L, T, H, dtype, env=env):
        assert got == want
