"""``TopKRouter``: gating, shapes, losses joined to autograd, expert bias (1 and 2 processes)."""

from __future__ import annotations

import dataclasses
import os
import socket
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F

from flexdispatch.config import RouterConfig
from flexdispatch.routing import (
    TopKRouter,
    aux_loss_scores,
    count_tokens_per_expert,
    gating_linear,
    hash_routing,
    switch_aux_loss,
    topk_routing,
    z_loss,
)

H = 16


def _cfg(**kw) -> RouterConfig:
    base = {"num_experts": 8, "topk": 2}
    base.update(kw)
    return RouterConfig(**base)


def test_weight_init_and_dtype():
    torch.manual_seed(3)
    a = TopKRouter(_cfg(), H)
    torch.manual_seed(3)
    b = TopKRouter(_cfg(), H)
    assert torch.equal(a.weight, b.weight)
    assert a.weight.shape == (8, H) and a.weight.dtype == torch.float32
    assert 0.01 < float(a.weight.detach().std()) < 0.03
    assert TopKRouter(_cfg(router_dtype="fp64"), H).weight.dtype == torch.float64


@pytest.mark.parametrize("train", [False, True])
def test_sbh_equals_th(train):
    router = TopKRouter(
        _cfg(score_function="sigmoid", aux_loss_type="aux_loss", aux_loss_coeff=0.1), H
    )
    router.train(train)
    x = torch.randn(5, 3, H)
    r3 = router(x)
    r2 = router(x.reshape(-1, H))
    assert r3.topk_idx.shape == (15, 2)
    assert torch.equal(r3.topk_idx, r2.topk_idx)
    assert torch.equal(r3.topk_probs, r2.topk_probs)
    if train:
        assert torch.allclose(r3.aux_loss, r2.aux_loss)
    else:
        assert r3.aux_loss is None and r3.z_loss is None


def test_router_equals_topk_routing_on_its_logits():
    cfg = _cfg(
        num_experts=16,
        topk=4,
        score_function="sigmoid",
        num_groups=4,
        group_topk=2,
        scaling_factor=2.5,
        enable_expert_bias=True,
        capacity_factor=1.0,
    )
    router = TopKRouter(cfg, H)
    router.expert_bias.copy_(torch.randn(16) * 0.01)
    x = torch.randn(32, H)
    res = router(x)
    want = topk_routing(
        x @ router.weight.t(),
        topk=4,
        score_function="sigmoid",
        num_groups=4,
        group_topk=2,
        scaling_factor=2.5,
        expert_bias=router.expert_bias,
        capacity_factor=1.0,
    )
    assert torch.equal(res.topk_idx, want.topk_idx)
    assert torch.allclose(res.topk_probs, want.topk_probs)
    assert torch.equal(res.tokens_per_expert, want.tokens_per_expert)


def test_bf16_input_gives_fp32_logits_and_bf16_grad():
    router = TopKRouter(_cfg(), H)
    x = torch.randn(10, H).bfloat16().requires_grad_()
    logits = gating_linear(x, router.weight, torch.float32)
    assert logits.dtype == torch.float32
    res = router(x)
    assert res.topk_probs.dtype == torch.float32
    res.topk_probs.sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16
    assert router.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rd", [torch.float32, torch.float64])
def test_gating_matches_linear_and_saves_only_inputs(x_dtype, rd):
    w = (torch.randn(8, H) * 0.1).to(rd).requires_grad_()
    x = torch.randn(6, H).to(x_dtype).requires_grad_()
    g = torch.randn(6, 8, dtype=rd)
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = gating_linear(x, w, rd)
    assert out.dtype == rd
    assert sorted(saved, key=str) == sorted([((6, H), x_dtype), ((8, H), rd)], key=str)
    (out * g).sum().backward()

    x2 = x.detach().clone().requires_grad_()
    w2 = w.detach().clone().requires_grad_()
    ref = F.linear(x2.to(rd), w2)
    (ref * g).sum().backward()
    assert torch.equal(out, ref)
    assert x.grad.dtype == x_dtype and w.grad.dtype == rd
    assert torch.allclose(x.grad, x2.grad) and torch.allclose(w.grad, w2.grad)


def test_fp64_router():
    router = TopKRouter(_cfg(router_dtype="fp64", z_loss_coeff=1e-3), H)
    x = torch.randn(7, H)
    res = router(x)
    assert res.topk_probs.dtype == torch.float32
    assert res.z_loss.dtype == torch.float64


@pytest.mark.parametrize("loss_type", ["aux_loss", "seq_aux_loss", "global_aux_loss"])
@pytest.mark.parametrize("fn", ["softmax", "sigmoid"])
def test_autoscaler_backprops_losses_through_probs(loss_type, fn):
    """Backward of ``probs.sum()`` alone == backward of ``probs.sum() + aux + z`` without them."""
    cfg = _cfg(score_function=fn, aux_loss_type=loss_type, aux_loss_coeff=0.3, z_loss_coeff=0.05)
    torch.manual_seed(1)
    router = TopKRouter(cfg, H)
    plain = TopKRouter(_cfg(score_function=fn), H)
    plain.load_state_dict(router.state_dict())
    x = torch.randn(4, 3, H)

    res = router(x)
    assert res.aux_loss is not None and res.z_loss is not None
    res.topk_probs.sum().backward()

    res2 = plain(x)
    assert res2.aux_loss is None and res2.z_loss is None
    logits = x.reshape(-1, H) @ plain.weight.t()
    scores, idx = aux_loss_scores(logits, topk=2, score_function=fn)
    if loss_type == "seq_aux_loss":
        counts_BE = torch.zeros(3, 8)
        for t in range(12):
            for e in idx[t].tolist():
                counts_BE[t % 3, e] += 1
        P_BE = scores.reshape(4, 3, 8).sum(0)
        aux = 0.3 * 8 / (2 * 4 * 4) * (P_BE * counts_BE).sum() / 3
    else:  # a single micro-batch on one process: global == batch loss
        aux = switch_aux_loss(
            scores, count_tokens_per_expert(idx, 8), topk=2, num_tokens=12, coeff=0.3
        )
    assert torch.allclose(res.aux_loss, aux)
    zl = z_loss(logits, 0.05)
    assert torch.allclose(res.z_loss, zl)
    (res2.topk_probs.sum() + aux + zl).backward()
    assert torch.allclose(router.weight.grad, plain.weight.grad, atol=1e-6)
    assert not torch.allclose(router.weight.grad, torch.zeros_like(router.weight.grad))


def test_aux_loss_scale_attribute():
    cfg = _cfg(aux_loss_type="aux_loss", aux_loss_coeff=1.0)
    torch.manual_seed(2)
    a = TopKRouter(cfg, H)
    b = TopKRouter(cfg, H)
    b.load_state_dict(a.state_dict())
    b.aux_loss_scale = 0.0
    x = torch.randn(12, H)
    ra, rb = a(x), b(x)
    (ra.topk_probs * 0).sum().backward()
    (rb.topk_probs * 0).sum().backward()
    assert float(a.weight.grad.abs().sum()) > 0
    assert float(b.weight.grad.abs().sum()) == 0


def test_global_aux_loss_accumulates_and_resets():
    cfg = _cfg(aux_loss_type="global_aux_loss", aux_loss_coeff=0.1)
    router = TopKRouter(cfg, H)
    x1, x2 = torch.randn(10, H), torch.randn(10, H)
    router(x1)
    r2 = router(x2)
    assert int(router.ga_steps) == 2
    counts = []
    for x in (x1, x2):
        _, idx = aux_loss_scores(x @ router.weight.t(), topk=2, score_function="softmax")
        counts.append(count_tokens_per_expert(idx, 8).float())
    assert torch.equal(router.global_tokens_per_expert, counts[0] + counts[1])
    s2, _ = aux_loss_scores(x2 @ router.weight.t(), topk=2, score_function="softmax")
    want = switch_aux_loss(s2, (counts[0] + counts[1]) / 2, topk=2, num_tokens=10, coeff=0.1)
    assert torch.allclose(r2.aux_loss, want)
    router.reset_global_aux_loss_tracker()
    assert int(router.ga_steps) == 0 and float(router.global_tokens_per_expert.sum()) == 0


def test_losses_only_in_training_with_grad():
    router = TopKRouter(_cfg(aux_loss_type="aux_loss", aux_loss_coeff=0.1, z_loss_coeff=0.1), H)
    x = torch.randn(6, H)
    with torch.no_grad():
        r = router(x)
    assert r.aux_loss is None and r.z_loss is None
    router.eval()
    r = router(x)
    assert r.aux_loss is None and r.z_loss is None
    router.train()
    r = router(x)
    assert r.aux_loss.dim() == 0 and r.z_loss.dim() == 0
    assert dataclasses.is_dataclass(r)


def _skewed_router(**kw) -> tuple[TopKRouter, torch.Tensor]:
    cfg = _cfg(score_function="sigmoid", enable_expert_bias=True, bias_update_rate=0.01, **kw)
    router = TopKRouter(cfg, H)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[0, 0] = 5.0  # feature 0 pulls tokens to expert 0
        router.weight[1:, 1:] = torch.randn(7, H - 1) * 0.1
    x = torch.randn(40, H)
    x[:, 0] = 1.0
    return router, x


def test_update_expert_bias_direction():
    router, x = _skewed_router()
    router.eval()
    router(x)
    assert int(router.local_tokens_per_expert.sum()) == 0  # only counted in training
    router.train()
    res = router(x)
    counts = res.tokens_per_expert.clone()
    assert torch.equal(router.local_tokens_per_expert, counts)
    assert int(counts[0]) == 40  # every token chose expert 0
    router.update_expert_bias()
    mean = counts.float().mean()
    want = 0.01 * torch.sign(mean - counts.float())
    assert torch.equal(router.expert_bias, want)
    assert float(router.expert_bias[0]) < 0
    assert int(router.local_tokens_per_expert.sum()) == 0
    # probs do not depend on the bias: same selection => same probs
    router.expert_bias.fill_(0.5)
    again = router(x)
    assert torch.equal(again.topk_idx, res.topk_idx)
    assert torch.allclose(again.topk_probs, res.topk_probs)


def test_update_expert_bias_needs_bias():
    with pytest.raises(ValueError, match="enable_expert_bias"):
        TopKRouter(_cfg(), H).update_expert_bias()


# ----------------------------------------------------------------------------- 2 processes


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_inputs(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(24, H, generator=g)
    x[:, rank] += 3.0  # each rank skews towards a different feature
    return x


def _make_bias_router() -> TopKRouter:
    torch.manual_seed(7)
    cfg = _cfg(score_function="sigmoid", enable_expert_bias=True, bias_update_rate=0.01)
    router = TopKRouter(cfg, H)
    with torch.no_grad():
        router.weight[:, :2] *= 100.0
    return router


def _bias_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        router = _make_bias_router()
        router(_rank_inputs(rank))
        router.update_expert_bias(group=dist.group.WORLD)
        torch.save(router.expert_bias.clone(), os.path.join(out_dir, f"bias{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_update_expert_bias_across_two_gloo_ranks():
    ctx = torch.multiprocessing.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_bias_worker, args=(r, 2, port, out_dir)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=90)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        assert [p.exitcode for p in procs] == [0, 0]
        biases = [torch.load(os.path.join(out_dir, f"bias{r}.pt")) for r in range(2)]

    single = _make_bias_router()
    single(torch.cat([_rank_inputs(0), _rank_inputs(1)]))
    single.update_expert_bias()
    local = _make_bias_router()
    local(_rank_inputs(0))
    local.update_expert_bias()
    assert torch.equal(biases[0], biases[1])
    assert torch.equal(biases[0], single.expert_bias)
    # the test can tell a group-wide update from a rank-local one
    assert not torch.equal(local.expert_bias, single.expert_bias)


# ----------------------------------------------------------------------------- hash and errors


def test_hash_router_needs_token_ids():
    router = TopKRouter(_cfg(router_type="hash"), H)
    with pytest.raises(ValueError, match="token_ids"):
        router(torch.randn(4, H))
    with pytest.raises(ValueError, match="token_ids"):
        router(torch.randn(4, H), token_ids=torch.arange(5))


def test_hash_router_equals_hash_routing():
    cfg = _cfg(router_type="hash", score_function="sqrtsoftplus", scaling_factor=1.5, hash_seed=3)
    router = TopKRouter(cfg, H)
    x = torch.randn(3, 4, H)
    ids = torch.randint(0, 1000, (3, 4))
    res = router(x, token_ids=ids)
    want = hash_routing(
        ids.reshape(-1),
        num_experts=8,
        topk=2,
        seed=3,
        logits=x.reshape(-1, H) @ router.weight.t(),
        score_function="sqrtsoftplus",
        scaling_factor=1.5,
    )
    assert torch.equal(res.topk_idx, want.topk_idx)
    assert torch.allclose(res.topk_probs, want.topk_probs)


@pytest.mark.parametrize(
    ("hidden", "exc", "name"),
    [
        (torch.randn(4, H + 1), ValueError, "hidden"),
        (torch.randn(4, H).long(), TypeError, "hidden"),
        (torch.randn(H), ValueError, "hidden"),
        (torch.randn(2, 2, 2, H), ValueError, "hidden"),
        ([[0.0] * H], TypeError, "hidden"),
    ],
)
def test_bad_hidden(hidden, exc, name):
    with pytest.raises(exc, match=name):
        TopKRouter(_cfg(), H)(hidden)


def test_bad_constructor_args():
    with pytest.raises(TypeError, match="config"):
        TopKRouter({"num_experts": 8, "topk": 2}, H)
    with pytest.raises(ValueError, match="hidden_size"):
        TopKRouter(_cfg(), 0)
    with pytest.raises(ValueError) as info:
        TopKRouter(_cfg(), H)(torch.randn(3, 5))
    assert "hidden" in str(info.value) and "5" in str(info.value) and str(H) in str(info.value)


@pytest.mark.parametrize("loss_type", ["aux_loss", "seq_aux_loss", "global_aux_loss"])
@pytest.mark.parametrize("shape", [(0, H), (0, 2, H), (3, 0, H)])
def test_empty_input_gives_zero_losses(loss_type, shape):
    cfg = _cfg(aux_loss_type=loss_type, aux_loss_coeff=0.1, z_loss_coeff=0.1)
    router = TopKRouter(cfg, H)
    res = router(torch.randn(*shape))
    assert res.topk_idx.shape == (0, 2)
    assert float(res.aux_loss.detach()) == 0.0 and float(res.z_loss.detach()) == 0.0
    res.topk_probs.sum().backward()
    assert torch.equal(router.weight.grad, torch.zeros_like(router.weight))


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rd", [torch.float32, torch.float64])
def test_gating_with_bias_matches_linear_and_saves_only_inputs(x_dtype, rd):
    w = (torch.randn(8, H) * 0.1).to(rd).requires_grad_()
    b = torch.randn(8).to(rd).requires_grad_()
    x = torch.randn(6, H).to(x_dtype).requires_grad_()
    g = torch.randn(6, 8, dtype=rd)
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = gating_linear(x, w, rd, b)
    assert out.dtype == rd
    assert sorted(saved, key=str) == sorted([((6, H), x_dtype), ((8, H), rd)], key=str)
    (out * g).sum().backward()

    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    ref = F.linear(x2.to(rd), w2, b2)
    (ref * g).sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12 if rd == torch.float64 else 1e-6)
    assert x.grad.dtype == x_dtype and w.grad.dtype == rd and b.grad.dtype == rd
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)
    torch.testing.assert_close(b.grad, b2.grad)


def test_gating_bias_gradcheck_fp64():
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, w, b: gating_linear(x, w, torch.float64, b), (x, w, b)
    )


def test_router_bias_parameter_shifts_logits_and_trains():
    torch.manual_seed(4)
    plain = TopKRouter(_cfg(), H)
    torch.manual_seed(4)
    biased = TopKRouter(_cfg(router_bias=True), H)
    assert plain.bias is None
    assert biased.bias is not None and biased.bias.shape == (8,)
    assert torch.equal(biased.bias, torch.zeros(8))  # zero init, no draw: same weight
    assert torch.equal(plain.weight, biased.weight)
    assert "bias" in dict(biased.named_parameters())
    x = torch.randn(10, H)
    torch.testing.assert_close(biased(x).topk_probs, plain(x).topk_probs)
    with torch.no_grad():
        biased.bias.copy_(torch.tensor([0.0, 0, 0, 0, 0, 0, 0, 3.0]))
    res = biased(x)
    assert bool((res.topk_idx == 7).any(dim=1).all())  # the large bias wins every token
    (res.topk_probs * torch.randn(res.topk_probs.shape)).sum().backward()
    assert biased.bias.grad is not None and biased.bias.grad.abs().sum() > 0
    # same logits as a plain Linear with that bias
    lin = torch.nn.Linear(H, 8)
    with torch.no_grad():
        lin.weight.copy_(biased.weight)
        lin.bias.copy_(biased.bias)
    logits = gating_linear(x, biased.weight, torch.float32, biased.bias)
    torch.testing.assert_close(logits, lin(x))
