"""DeepEP's per-release kernel limits and the row chunk plans built on them (pure Python).

Xw bf16 columns on the wire · H hidden · k top-k.
"""

from __future__ import annotations

import types

import pytest

from flexdispatch.backends.deepep import rules


@pytest.mark.parametrize("release", rules.RELEASES)
def test_dispatch_caps_match_the_kernels(release: str) -> None:
    r = rules.rules_for(release)
    # intranode SM90 TMA: rows a multiple of 32 bytes with half a row + 8 <= 8192
    cols = r.dispatch_max_cols(False)
    assert 2 * cols % 32 == 0 and 2 * cols // 2 + 8 <= 8192
    assert 2 * (cols + 16) // 2 + 8 > 8192  # the next multiple of 32 bytes would trap
    # internode: get_num_bytes_per_token (row + meta + ids + weights, aligned 16) + 8 <= 16384
    for k in (1, 8, 32):
        c = r.dispatch_max_cols(True, topk=k)
        assert rules.internode_token_bytes(2 * c, topk=k) + 8 <= 16384
        assert rules.internode_token_bytes(2 * (c + 16), topk=k) + 8 > 16384


@pytest.mark.parametrize("release", rules.RELEASES)
def test_combine_widths(release: str) -> None:
    r = rules.rules_for(release)
    assert r.combine_col_multiple(True) == 256  # hidden_int4 % 32 == 0 internode
    assert r.combine_col_multiple(False) == (256 if release == "1.2.1" else 8)
    c = r.combine_max_cols(True, topk=32)
    assert c % 256 == 0 and -(-(2 * c + 8 + 4 * 32) // 16) * 16 + 8 <= 16384


def test_release_specific_lists() -> None:
    old, new = rules.rules_for("1.2.1"), rules.rules_for("2.1.0")
    assert {18, 20} <= set(old.internode_node_counts)
    assert 3 not in old.internode_node_counts and 3 in new.internode_node_counts
    assert 3072 not in old.low_latency_hidden_sizes and 3072 in new.low_latency_hidden_sizes
    with pytest.raises(ValueError, match="unknown DeepEP release"):
        rules.rules_for("9.9")


def test_release_of_modules() -> None:
    assert rules.release_of(types.SimpleNamespace(EMULATED_RELEASE="2.1.0")) == "2.1.0"
    assert rules.release_of(types.SimpleNamespace(__version__="2.1.0")) == "2.1.0"
    assert rules.release_of(types.SimpleNamespace()) == "1.2.1"  # a v1.2.1 build has no version


@pytest.mark.parametrize(
    ("total", "cap", "multiple", "widths"),
    [
        (64, 8176, 16, [64]),
        (8176, 8176, 16, [8176]),
        (8192, 8176, 16, [4096, 4096]),  # bf16 H = 8192 intranode: two calls
        (14336, 8176, 16, [7168, 7168]),  # fp32 H = 7168 travels as 2H bf16 columns
        (20000, 8176, 16, [6672, 6672, 6656]),
        (8, 7936, 256, [8]),  # a narrow row is padded to one 256-column chunk
    ],
)
def test_plan_chunks(total: int, cap: int, multiple: int, widths: list[int]) -> None:
    chunks = rules.plan_chunks(total, cap, multiple)
    assert [c.width for c in chunks] == widths
    assert sum(c.width for c in chunks) == total
    assert all(c.padded % multiple == 0 and c.width <= c.padded <= cap for c in chunks)
    starts = [c.start for c in chunks]
    assert starts == [sum(widths[:i]) for i in range(len(widths))]


def test_plan_chunks_refuses_impossible() -> None:
    with pytest.raises(ValueError, match="no chunk fits"):
        rules.plan_chunks(100, 8, 16)
    with pytest.raises(ValueError, match="at least one column"):
        rules.plan_chunks(0, 8176, 16)
