"""Hash routing: the hash against a Python-int reference, balance, weights, tables, validation."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from flexdispatch.routing.hash import hash_expert_table, hash_experts, hash_routing

M32 = 0xFFFFFFFF


# ----------------------------------------------------------------- reference (plain Python ints)


def ref_fmix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) % 2**32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) % 2**32
    return x ^ (x >> 16)


def ref_hash_experts(token_id: int, E: int, k: int, seed: int) -> list[int]:
    """The documented hash, one token at a time: rendezvous hashing over E experts."""
    u = token_id % 2**64  # two's complement view of an int64
    seed_word = ref_fmix32((seed % 2**32) ^ ref_fmix32((seed >> 32) ^ 0x9E3779B9))
    t = ref_fmix32((u % 2**32) ^ seed_word)
    t = ref_fmix32(t ^ (u >> 32))
    keys = []
    for x in range(E):
        h = ref_fmix32((t + (x + 1) * 0x9E3779B9) % 2**32)
        keys.append((h * E + x, x))
    keys.sort(reverse=True)
    return [x for _, x in keys[:k]]


def ref_scores(row: list[float], score_function: str) -> list[float]:
    if score_function == "softmax":
        m = max(row)
        ex = [math.exp(v - m) for v in row]
        s = sum(ex)
        return [v / s for v in ex]
    if score_function == "sigmoid":
        return [1.0 / (1.0 + math.exp(-v)) for v in row]
    return [math.sqrt(math.log1p(math.exp(v)) if v < 20 else v) for v in row]


# ------------------------------------------------------------------------------------- the hash


@pytest.mark.parametrize(
    ("E", "k", "seed"), [(16, 4, 0), (256, 6, 7), (160, 6, 2**40 + 3), (5, 5, 1)]
)
def test_experts_match_python_reference(E, k, seed):
    ids = torch.cat(
        [
            torch.arange(20),
            torch.randint(0, 2**62, (20,)),
            torch.tensor([2**32 - 1, 2**32, 2**63 - 1]),
        ]
    )
    got = hash_experts(ids, num_experts=E, topk=k, seed=seed)
    assert got.dtype == torch.int64 and got.shape == (ids.numel(), k)
    for t, tid in enumerate(ids.tolist()):
        assert got[t].tolist() == ref_hash_experts(tid, E, k, seed), f"token id {tid}"


def test_experts_are_distinct_and_in_range():
    ids = torch.randint(0, 2**31, (2000,))
    idx = hash_experts(ids, num_experts=24, topk=8, seed=3)
    assert int(idx.min()) >= 0 and int(idx.max()) < 24
    for row in idx.tolist():
        assert len(set(row)) == 8


def test_same_id_same_experts_and_seeds_differ():
    ids = torch.tensor([5, 9, 5, 9, 123456789])
    a = hash_experts(ids, num_experts=64, topk=4, seed=0)
    assert torch.equal(a[0], a[2]) and torch.equal(a[1], a[3])
    many = torch.arange(4000)
    s0 = hash_experts(many, num_experts=64, topk=4, seed=0)
    s1 = hash_experts(many, num_experts=64, topk=4, seed=1)
    same_rows = (s0.sort(1).values == s1.sort(1).values).all(1).float().mean().item()
    assert same_rows < 0.01  # independent tables agree on a row with probability 1/C(64,4)


def _assert_balanced(idx: torch.Tensor, E: int, k: int) -> None:
    n = idx.shape[0]
    counts = torch.bincount(idx.flatten(), minlength=E).double()
    p = k / E
    mean, var = n * p, n * p * (1 - p)
    chi2 = float(((counts - mean) ** 2 / var).sum())
    # E[chi2] = E; 6 standard deviations of a chi-square with E-1 degrees of freedom above it.
    assert chi2 < E + 6 * math.sqrt(2 * E), f"chi-square {chi2:.1f} too large for E={E}"
    rel = float(((counts - mean).abs() / mean).max())
    assert rel < 0.05, f"an expert deviates {rel:.1%} from the uniform count {mean:.0f}"


@pytest.mark.parametrize("ids_kind", ["random", "consecutive"])
def test_balance_over_many_ids(ids_kind):
    E, k, n = 64, 8, 100_000
    # random 40-bit ids, or a vocabulary 0..n-1
    ids = torch.randint(0, 2**40, (n,)) if ids_kind == "random" else torch.arange(n)
    _assert_balanced(hash_experts(ids, num_experts=E, topk=k, seed=11), E, k)


def test_slot_positions_are_balanced_too():
    # Each slot j (the j-th largest key) is itself a uniform draw over experts.
    E, k = 32, 4
    idx = hash_experts(torch.arange(40_000), num_experts=E, topk=k, seed=0)
    for j in range(k):
        counts = torch.bincount(idx[:, j], minlength=E).double()
        assert float((counts - counts.mean()).abs().max() / counts.mean()) < 0.1


def test_same_result_in_a_fresh_process():
    ids = [0, 1, 17, 2**33 + 5, 2**62 + 1]
    code = (
        "import torch; torch.set_num_threads(2);"
        "from flexdispatch.routing.hash import hash_experts;"
        f"print(hash_experts(torch.tensor({ids}), num_experts=96, topk=6, seed=5).tolist())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    here = hash_experts(torch.tensor(ids), num_experts=96, topk=6, seed=5).tolist()
    assert out.stdout.strip() == str(here)


# ------------------------------------------------------------------------------------- weights


def test_without_logits_weights_are_uniform_and_scaled():
    ids = torch.randint(0, 10_000, (37,))
    r = hash_routing(ids, num_experts=16, topk=4, scaling_factor=2.0)
    assert r.topk_probs.dtype == torch.float32
    assert torch.equal(r.topk_probs, torch.full((37, 4), 0.5))
    assert torch.equal(r.topk_idx, hash_experts(ids, num_experts=16, topk=4))


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("normalize_topk", [None, True, False])
@pytest.mark.parametrize("scaling_factor", [None, 1.5])
def test_weights_match_per_token_loop(score_function, normalize_topk, scaling_factor):
    E, k, T = 24, 6, 19
    ids = torch.randint(0, 50_000, (T,))
    logits = torch.randn(T, E) * 2
    r = hash_routing(
        ids,
        num_experts=E,
        topk=k,
        seed=4,
        logits=logits,
        score_function=score_function,
        normalize_topk=normalize_topk,
        scaling_factor=scaling_factor,
    )
    renorm = (score_function != "softmax") if normalize_topk is None else normalize_topk
    for t in range(T):
        experts = ref_hash_experts(int(ids[t]), E, k, 4)
        assert r.topk_idx[t].tolist() == experts
        s = ref_scores(logits[t].tolist(), score_function)
        w = [s[x] for x in experts]
        if renorm:
            total = sum(w)
            w = [v / total for v in w]
        if scaling_factor is not None:
            w = [v * scaling_factor for v in w]
        torch.testing.assert_close(
            r.topk_probs[t], torch.tensor(w, dtype=torch.float32), rtol=1e-5, atol=1e-7
        )


def test_counts_and_result_contract():
    E, k, T = 12, 3, 50
    ids = torch.randint(0, 1000, (T,))
    r = hash_routing(ids, num_experts=E, topk=k, logits=torch.randn(T, E))
    want = [0] * E
    for row in r.topk_idx.tolist():
        for x in row:
            want[x] += 1
    assert r.tokens_per_expert.dtype == torch.int64 and r.tokens_per_expert.tolist() == want
    assert r.num_dropped.dtype == torch.int64 and r.num_dropped.dim() == 0
    assert int(r.num_dropped) == 0
    assert r.aux_loss is None and r.z_loss is None


def test_gradient_reaches_only_chosen_logits():
    E, k, T = 10, 3, 6
    ids = torch.arange(T)
    logits = torch.randn(T, E, requires_grad=True)
    r = hash_routing(ids, num_experts=E, topk=k, logits=logits, score_function="sigmoid")
    (r.topk_probs * torch.randn(T, k)).sum().backward()
    chosen = torch.zeros(T, E, dtype=torch.bool).scatter_(1, r.topk_idx, True)
    assert logits.grad is not None
    assert torch.all(logits.grad[~chosen] == 0)
    assert torch.any(logits.grad[chosen] != 0)


def test_any_shape_is_flattened_and_int32_matches_int64():
    ids = torch.randint(0, 5000, (4, 3))
    logits = torch.randn(4, 3, 16)
    a = hash_routing(ids, num_experts=16, topk=2, logits=logits, score_function="sigmoid")
    b = hash_routing(
        ids.reshape(-1).int(),
        num_experts=16,
        topk=2,
        logits=logits.reshape(12, 16),
        score_function="sigmoid",
    )
    assert a.topk_idx.shape == (12, 2)
    assert torch.equal(a.topk_idx, b.topk_idx) and torch.equal(a.topk_probs, b.topk_probs)


def test_empty_input():
    r = hash_routing(torch.empty(0, dtype=torch.int64), num_experts=8, topk=2)
    assert r.topk_idx.shape == (0, 2) and r.topk_probs.shape == (0, 2)
    assert r.tokens_per_expert.tolist() == [0] * 8


def test_meta_device_no_data_needed():
    ids = torch.empty(7, dtype=torch.int64, device="meta")
    logits = torch.empty(7, 32, device="meta")
    r = hash_routing(ids, num_experts=32, topk=4, logits=logits, score_function="sqrtsoftplus")
    assert r.topk_idx.device.type == "meta" and r.topk_idx.shape == (7, 4)
    assert r.topk_idx.dtype == torch.int64 and r.topk_probs.dtype == torch.float32
    assert r.tokens_per_expert.shape == (32,) and r.num_dropped.shape == ()


# --------------------------------------------------------------------------------------- tables


def test_table_equals_hash():
    V = 3000
    table = hash_expert_table(V, num_experts=40, topk=5, seed=9, chunk_size=700)
    assert table.shape == (V, 5) and table.dtype == torch.int64
    assert torch.equal(table, hash_experts(torch.arange(V), num_experts=40, topk=5, seed=9))
    ids = torch.randint(0, V, (64,))
    logits = torch.randn(64, 40)
    a = hash_routing(ids, num_experts=40, topk=5, seed=9, logits=logits, table=table)
    b = hash_routing(ids, num_experts=40, topk=5, seed=9, logits=logits)
    assert torch.equal(a.topk_idx, b.topk_idx) and torch.equal(a.topk_probs, b.topk_probs)


def test_checkpoint_style_table_is_looked_up():
    # A tid2eid-like table: row v holds experts (v, v+1) mod E.
    V, E = 10, 6
    table = torch.tensor([[v % E, (v + 1) % E] for v in range(V)], dtype=torch.int32)
    ids = torch.tensor([3, 9, 0, 3])
    r = hash_routing(ids, num_experts=E, topk=2, table=table, checks=True)
    for t, v in enumerate(ids.tolist()):
        assert r.topk_idx[t].tolist() == [v % E, (v + 1) % E]


# ----------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "exc", "needle"),
    [
        ({"token_ids": [1, 2]}, TypeError, "token_ids must be a torch.Tensor"),
        ({"token_ids": torch.tensor([1.0])}, TypeError, "token_ids must have dtype"),
        ({"num_experts": 0}, ValueError, "num_experts must be a positive int"),
        ({"topk": 0}, ValueError, "topk must be an int in [1, 32]"),
        ({"topk": 33, "num_experts": 64}, ValueError, "topk must be an int in [1, 32]"),
        ({"topk": 9}, ValueError, "topk=9 exceeds num_experts=8"),
        ({"seed": -1}, ValueError, "seed must be an int"),
        ({"logits": torch.randn(3, 7)}, ValueError, "logits must have shape"),
        ({"logits": torch.zeros(3, 8, dtype=torch.long)}, TypeError, "logits must be a floating"),
        ({"score_function": "relu"}, ValueError, "score_function must be one of"),
        ({"scaling_factor": 0.0}, ValueError, "scaling_factor must be > 0"),
        ({"table": torch.zeros(4, 3, dtype=torch.int64)}, ValueError, "table must be [V, topk=2]"),
        ({"table": torch.zeros(4, 2)}, TypeError, "table must have dtype"),
    ],
)
def test_errors_name_the_argument(kwargs, exc, needle):
    args = {"token_ids": torch.tensor([1, 2, 3]), "num_experts": 8, "topk": 2}
    args.update(kwargs)
    token_ids = args.pop("token_ids")
    with pytest.raises(exc) as err:
        hash_routing(token_ids, **args)
    assert needle in str(err.value)


def test_value_checks_need_checks_flag():
    bad = torch.tensor([1, -4])
    hash_routing(bad, num_experts=8, topk=2, checks=False)  # hashed, no host sync
    with pytest.raises(ValueError, match="negative ids"):
        hash_routing(bad, num_experts=8, topk=2, checks=True)
    table = torch.zeros(3, 2, dtype=torch.int64)
    table[:, 1] = 1
    with pytest.raises(ValueError, match="token_ids holds 1 id"):
        hash_routing(torch.tensor([0, 3]), num_experts=8, topk=2, table=table, checks=True)
    with pytest.raises(ValueError, match="table holds"):
        hash_routing(torch.tensor([0]), num_experts=8, topk=2, table=table * 9, checks=True)
    with pytest.raises(ValueError, match="NaN"):
        logits = torch.full((1, 8), float("nan"))
        hash_routing(torch.tensor([0]), num_experts=8, topk=2, logits=logits, checks=True)
