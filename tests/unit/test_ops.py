"""The custom ops (``flexdispatch.dispatch.ops``) in a world of one: stable names and schemas, the
eager op path equal to the autograd Functions bit for bit, the handle registry freed with the
results, selective activation checkpointing naming the ops, and ``torch.compile`` of a worst-case
``MoELayer`` with ``fullgraph=True`` (forward and backward) equal to eager.

T tokens · H hidden · E experts · k top-k · W worst-case rows. Compiled with ``backend=
"aot_eager"`` (dynamo + AOTAutograd, the graph inductor would get; inductor's C++ build takes
over a minute on the CI machine: docs/compile.md).
"""

from __future__ import annotations

import copy
import functools
import gc
import pickle

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from flexdispatch import DispatchConfig, FlexDispatcher, _pool
from flexdispatch.config import load_config
from flexdispatch.dispatch import ops
from flexdispatch.moe import MoELayer

T, H, E, K = 6, 8, 4, 2
IDX = torch.tensor([[0, 1], [2, -1], [3, 0], [1, 2], [-1, -1], [2, 3]])


@pytest.fixture(autouse=True)
def _eager_ops_off():
    before = ops.set_eager_ops(False)
    try:
        yield
    finally:
        ops.set_eager_ops(before)
        torch._dynamo.reset()  # NOTE: a failed compile test leaves no cache to the next one
    assert ops.live_handles() == 0  # NOTE: freed by reference counting, no gc pass needed


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    return x, torch.rand(T, K, generator=g).masked_fill(IDX < 0, 0.0)


def _step(
    d: FlexDispatcher, x: torch.Tensor, p: torch.Tensor, bias: bool, grads: str = "xp"
) -> dict:
    """dispatch -> rows * probs -> combine (+ bias) -> backward; every result and gradient
    (``grads``: which of x and p require one)."""
    xg, pg = x.clone().requires_grad_("x" in grads), p.clone().requires_grad_("p" in grads)
    bg = torch.ones(T, H, requires_grad=True) if bias else None
    res = d.dispatch(xg, IDX, pg)
    y = torch.tanh(res.recv_x) * res.recv_topk_probs.sum(1, keepdim=True)
    out = d.combine(y, res.handle, bias=bg)
    out.square().sum().backward()
    got = {
        "out": out.detach(),
        "recv_x": res.recv_x.detach(),
        "recv_idx": res.recv_topk_idx,
        "counts": res.num_recv_tokens_per_expert,
        "gx": xg.grad,
        "gp": pg.grad,
        "pairs": res.num_recv_pairs,
        "state": type(res.handle.state).__name__,
    }
    if bg is not None:
        got["gb"] = bg.grad
    return got


def test_op_names_and_schemas_are_stable() -> None:
    """The names selective checkpointing lists (``flexdispatch.dispatch.default``) and their
    schemas (docs/compile.md)."""
    want = {
        "dispatch": "flexdispatch::dispatch(Tensor x, Tensor topk_idx, Tensor topk_probs, "
        "Tensor dispatcher, SymInt num_worst_tokens, SymInt num_local_experts, Tensor? "
        "num_tokens_per_rank=None, Tensor? num_tokens_per_rdma_rank=None, Tensor? "
        "num_tokens_per_expert=None, Tensor? is_token_in_rank=None) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor)",
        "combine": "flexdispatch::combine(Tensor y, Tensor handle, Tensor dispatcher, SymInt "
        "num_tokens, Tensor? bias=None) -> Tensor",
        "combine_with_probs": "flexdispatch::combine_with_probs(Tensor? y, Tensor? probs, Tensor "
        "handle, Tensor dispatcher, SymInt num_tokens) -> (Tensor, Tensor)",
        "cached_dispatch": "flexdispatch::cached_dispatch(Tensor x, Tensor handle, Tensor "
        "dispatcher, SymInt num_recv_rows) -> Tensor",
    }
    for name, schema in want.items():
        assert str(getattr(torch.ops.flexdispatch, name).default._schema) == schema


@pytest.mark.parametrize("W", [0, 12], ids=["dropless", "worst"])
@pytest.mark.parametrize(
    ("bias", "grads"),
    [(False, "xp"), (True, "xp"), (False, "x"), (False, "p")],
    ids=["plain", "bias", "x-only", "p-only"],
)
def test_eager_ops_equal_the_autograd_functions(W: int, bias: bool, grads: str) -> None:
    """Results, gradients and statistics are those of the Functions (the backward is counted
    as no call on either path)."""
    d = FlexDispatcher(DispatchConfig(backend="torch", num_worst_tokens=W), num_experts=E)
    x, p = _inputs()
    plain = _step(d, x, p, bias, grads)
    ops.set_eager_ops(True)
    via = _step(d, x, p, bias, grads)
    assert plain.pop("state") != "Tensor" and via.pop("state") == "Tensor"
    for name, value in plain.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(via[name], value), name
        else:
            assert via[name] == value, name
    assert d.stats.dispatch_calls == 2 and d.stats.combine_calls == 2


def test_a_copied_dispatcher_is_a_dispatcher_of_its_own() -> None:
    """``copy.deepcopy`` and pickle give a new serial: the ops route a copy's calls to the copy
    (not to the original's backend), and a copy outlives its original; handles stay with the
    dispatcher that issued them."""
    d = FlexDispatcher(DispatchConfig(backend="torch", num_worst_tokens=12), num_experts=E)
    x, p = _inputs()
    ops.set_eager_ops(True)
    twin = copy.deepcopy(d)
    res = twin.dispatch(x, IDX, p)
    assert (twin.stats.dispatch_calls, d.stats.dispatch_calls) == (1, 0)
    with pytest.raises(ValueError, match="issued by another FlexDispatcher"):
        d.combine(res.recv_x, res.handle)
    assert torch.equal(twin.combine(res.recv_x, res.handle), d.combine(*_rows(d, x, p)))
    thawed = pickle.loads(pickle.dumps(d))
    del d, res
    gc.collect()
    assert thawed.dispatch(x, IDX, p).recv_x.shape == (12, H)
    assert thawed._issuer != twin._issuer


def _rows(d: FlexDispatcher, x: torch.Tensor, p: torch.Tensor) -> tuple:
    res = d.dispatch(x, IDX, p)
    return res.recv_x, res.handle


def _metadata(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device)


def test_fake_implementations_describe_the_real_outputs() -> None:
    """What ``torch.compile`` plans with (the fake ops under ``FakeTensorMode``) has the shapes,
    strides, offsets, dtypes and devices of what the ops return (``opcheck``'s fake test, without
    its cost). Worst-case mode: every size static."""
    d = FlexDispatcher(DispatchConfig(backend="torch", num_worst_tokens=12), num_experts=E)
    x, p = _inputs()
    ops.set_eager_ops(True)
    res = d.dispatch(x, IDX, p)
    handle = res.handle.state
    y = torch.randn(12, H)
    f = torch.ops.flexdispatch
    calls = [
        (f.dispatch.default, (x, IDX, p, d._op_id, 12, d.num_local_experts)),
        (f.combine.default, (y, handle, d._op_id, T, torch.ones(T, H))),
        (f.combine_with_probs.default, (y, torch.rand(12, K), handle, d._op_id, T)),
        (f.combine_with_probs.default, (None, torch.rand(12, K), handle, d._op_id, T)),
        (f.combine_with_probs.default, (y, None, handle, d._op_id, T)),
        (f.cached_dispatch.default, (torch.randn(T, 3), handle, d._op_id, 12)),
        (
            f.grouped_mm.default,
            (torch.randn(10, H), torch.randn(3, H, 4), torch.tensor([3, 7, 10], dtype=torch.int32)),
        ),
        (
            f.grouped_mm.default,
            (
                torch.randn(10, H).t(),
                torch.randn(10, 4),
                torch.tensor([3, 7, 10], dtype=torch.int32),
            ),
        ),
    ]
    for op, args in calls:
        real = op(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            fake = op(*fake_args)
        real, fake = (real, fake) if isinstance(real, tuple) else ((real,), (fake,))
        assert [_metadata(t) for t in fake] == [_metadata(t) for t in real], op
    del res, handle, real


def test_handle_registry_lives_as_long_as_the_result() -> None:
    d = FlexDispatcher(DispatchConfig(backend="torch", num_worst_tokens=12), num_experts=E)
    x, p = _inputs()
    ops.set_eager_ops(True)
    res = d.dispatch(x, IDX, p)
    alias = res.handle.state.detach()  # e.g. selective checkpointing's cache
    assert ops.live_handles() == 1
    state = res.handle.state
    del res
    gc.collect()
    assert ops.live_handles() == 1  # the handle tensor and its alias still live
    del state
    gc.collect()
    assert ops.live_handles() == 1
    y = torch.zeros(12, H)
    out = torch.ops.flexdispatch.combine(y, alias, d._op_id, T)
    assert out.shape == (T, H)
    del alias
    gc.collect()
    assert ops.live_handles() == 0
    stale = torch.tensor([10**9, -1])
    with pytest.raises(RuntimeError, match="not registered"):
        torch.ops.flexdispatch.combine(y, stale, d._op_id, T)
    with pytest.raises(RuntimeError, match="no live FlexDispatcher"):
        torch.ops.flexdispatch.dispatch(x, IDX, p, torch.tensor([10**9]), 12, 2)
    with pytest.raises(TypeError, match="enabled must be a bool"):
        ops.set_eager_ops(1)  # type: ignore[arg-type]


def test_selective_checkpointing_saves_the_named_ops() -> None:
    """torchtitan-style SAC: a policy that must save ``flexdispatch.dispatch.default`` and
    ``flexdispatch.combine.default`` sees them, the dispatch is not run again in the backward,
    and the results equal the run without checkpointing."""
    d = FlexDispatcher(DispatchConfig(backend="torch", num_worst_tokens=12), num_experts=E)
    x, p = _inputs()
    keep = {torch.ops.flexdispatch.dispatch.default, torch.ops.flexdispatch.combine.default}
    seen: set[str] = set()

    def policy(ctx, op, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.add(str(op))
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    def fn(xg: torch.Tensor, pg: torch.Tensor) -> torch.Tensor:
        res = d.dispatch(xg, IDX, pg)
        y = torch.tanh(res.recv_x) * res.recv_topk_probs.sum(1, keepdim=True)
        return d.combine(y, res.handle)

    ops.set_eager_ops(True)
    runs = {}
    for mode in ("plain", "sac"):
        xg, pg = x.clone().requires_grad_(), p.clone().requires_grad_()
        before = d.stats.dispatch_calls
        if mode == "plain":
            out = fn(xg, pg)
        else:
            ctx = functools.partial(create_selective_checkpoint_contexts, policy)
            out = checkpoint(fn, xg, pg, use_reentrant=False, context_fn=ctx)
        out.square().sum().backward()
        runs[mode] = (out.detach(), xg.grad, pg.grad, d.stats.dispatch_calls - before)
    assert {"flexdispatch.dispatch.default", "flexdispatch.combine.default"} <= seen
    for a, b in zip(runs["plain"][:3], runs["sac"][:3], strict=True):
        assert torch.equal(a, b)
    assert runs["sac"][3] == 1  # saved, not dispatched again for the backward


def _layer(W: int, dtype: torch.dtype) -> tuple[MoELayer, torch.Tensor]:
    cfg = load_config("tiny_cpu")
    dispatch = cfg.dispatch.model_copy(update={"backend": "torch", "num_worst_tokens": W})
    layer = MoELayer(cfg.model_copy(update={"dispatch": dispatch}), seed=3, dtype=dtype)
    x = torch.randn(12, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    return layer, x.to(dtype)


def _train_step(layer: MoELayer, fn, x0: torch.Tensor) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    layer.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    out = fn(x)
    (out.float() * torch.linspace(-1, 1, out.shape[1])).sum().backward()
    grads = [p.grad for _, p in sorted(layer.named_parameters())]
    return [out.detach(), x.grad, *grads]


def _compiled_ops(counter: CompileCounterWithBackend) -> set[str]:
    """The ``flexdispatch`` ops in the graphs dynamo captured (``dispatch``, ``combine``, ...)."""
    targets = {str(n.target) for g in counter.graphs for n in g.graph.nodes}
    return {t.split(".")[1] for t in targets if t.startswith("flexdispatch.")}


def test_compile_fullgraph_worst_case_layer_equals_eager() -> None:
    """fp32 tiny_cpu, W = T: one graph (``fullgraph=True``), forward and backward through
    ``flexdispatch::dispatch`` / ``combine``, bit-equal to eager, no host sync counted, and no
    recompile at the next step (compiled before the host caches of ``_memory`` are filled)."""
    torch._dynamo.reset()
    layer, x0 = _layer(12, torch.float32)
    state = {k: v.clone() for k, v in layer.state_dict().items()}

    def fn(x: torch.Tensor) -> torch.Tensor:
        return layer(x).output

    eager = _train_step(layer, fn, x0)
    layer.load_state_dict(state)  # the expert-bias statistics the eager step moved
    counter = CompileCounterWithBackend("aot_eager")
    syncs = layer.dispatcher.stats.host_syncs
    for cache in (_pool._ARANGES, _pool._SCALARS, _pool._CACHED):
        cache.clear()  # as in a process that compiles before any eager step
    compiled_fn = torch.compile(fn, fullgraph=True, backend=counter)
    compiled = _train_step(layer, compiled_fn, x0)
    _train_step(layer, compiled_fn, x0)
    assert counter.frame_count == 1
    assert {"dispatch", "combine"} <= _compiled_ops(counter), _compiled_ops(counter)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)
    assert layer.dispatcher.stats.host_syncs == syncs
    torch._dynamo.reset()


def test_identical_layers_share_one_compiled_graph() -> None:
    """A model has many MoE layers, each with its own dispatcher, compiled block by block
    (``torch.compile(block, fullgraph=True)``, as torchtitan does): identical layers share one
    graph (nothing of a layer's identity is a guard), so the recompile limit (8) is never hit,
    and each compiled layer still equals its eager self."""
    torch._dynamo.reset()
    try:
        counter = CompileCounterWithBackend("aot_eager")
        layers = [_layer(12, torch.float32) for _ in range(10)]
        for layer, x0 in layers:
            state = {k: v.clone() for k, v in layer.state_dict().items()}
            eager = _train_step(layer, lambda x, m=layer: m(x).output, x0)
            layer.load_state_dict(state)
            compiled_layer = torch.compile(layer, fullgraph=True, backend=counter)
            compiled = _train_step(layer, lambda x, m=compiled_layer: m(x).output, x0)
            for a, b in zip(eager, compiled, strict=True):
                assert torch.equal(a, b)
        assert counter.frame_count == 1, counter.frame_count
    finally:
        torch._dynamo.reset()


def test_compile_dropless_breaks_the_graph_and_equals_eager() -> None:
    """Dropless dispatch has a data-dependent row count: ``fullgraph=True`` refuses it, and
    without it dynamo runs the dispatch op outside the graph and still equals eager."""
    torch._dynamo.reset()
    d = FlexDispatcher(DispatchConfig(backend="torch"), num_experts=E)
    x, p = _inputs()

    def fn(xg: torch.Tensor, pg: torch.Tensor) -> torch.Tensor:
        res = d.dispatch(xg, IDX, pg)
        y = torch.tanh(res.recv_x) * res.recv_topk_probs.sum(1, keepdim=True)
        return d.combine(y, res.handle)

    def run(f):  # type: ignore[no-untyped-def]
        xg, pg = x.clone().requires_grad_(), p.clone().requires_grad_()
        out = f(xg, pg)
        out.square().sum().backward()
        return out.detach(), xg.grad, pg.grad

    eager = run(fn)
    with pytest.raises((torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)):
        run(torch.compile(fn, fullgraph=True, backend="aot_eager"))
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    for a, b in zip(eager, run(torch.compile(fn, backend=counter)), strict=True):
        assert torch.equal(a, b)
    assert "combine" in _compiled_ops(counter)
    torch._dynamo.reset()
    gc.collect()  # NOTE: the refused compile's traceback held a dispatch result


def test_a_compiled_dispatch_combines_eagerly() -> None:
    """A dispatch compiled whole (its handle stamped with no issuer) is combined on the eager
    path equal to an eager dispatch + combine; the op still refuses another dispatcher's handle
    (docs/compile.md: combine takes the op handle on either path)."""
    torch._dynamo.reset()
    d = FlexDispatcher(DispatchConfig(backend="torch", num_worst_tokens=12), num_experts=E)
    other = FlexDispatcher(DispatchConfig(backend="torch", num_worst_tokens=12), num_experts=E)
    x, p = _inputs()
    res = torch.compile(lambda a, b: d.dispatch(a, IDX, b), fullgraph=True, backend="eager")(x, p)
    assert isinstance(res.handle.state, torch.Tensor)
    eager = d.dispatch(x, IDX, p)
    assert torch.equal(d.combine(res.recv_x, res.handle), d.combine(eager.recv_x, eager.handle))
    with pytest.raises(ValueError, match="issued by another FlexDispatcher"):
        other.combine(res.recv_x, res.handle)
    torch._dynamo.reset()


def test_op_ids_stay_on_the_cpu_under_a_default_device() -> None:
    """Under ``with torch.device(...)`` (vLLM and SGLang build models so; ``meta`` stands in for
    ``cuda`` here) the dispatcher's id and the handle tensor are still CPU tensors (reading them
    is no device sync, as the fake rule says), and dispatch + combine through the ops work."""
    x, p = _inputs()
    ref = FlexDispatcher(DispatchConfig(backend="torch", num_worst_tokens=12), num_experts=E)
    res = ref.dispatch(x, IDX, p)
    want = ref.combine(res.recv_x * 2, res.handle)
    ops.set_eager_ops(True)
    with torch.device("meta"):
        d = FlexDispatcher(DispatchConfig(backend="torch", num_worst_tokens=12), num_experts=E)
        res = d.dispatch(x, IDX, p)
        assert d._op_id.device.type == "cpu"
        assert res.handle.state.device.type == "cpu"
        assert torch.equal(d.combine(res.recv_x * 2, res.handle), want)


def test_compiled_combine_of_an_eager_handle_equals_eager() -> None:
    """A handle of the eager path (``dispatch_expanded``, or a dispatch outside the compiled
    region) combined inside one: registered when the code runs (a graph break), not while
    tracing (its id baked into the graph, its entry gone with the trace): every call, each with
    a new handle through the same graph, equals eager, forward and backward; ``fullgraph=True``
    refuses it naming the fix."""
    torch._dynamo.reset()
    d = FlexDispatcher(DispatchConfig(backend="torch", num_worst_tokens=12), num_experts=E)
    compiled = torch.compile(lambda y, h: d.combine(y, h), backend="aot_eager")
    x, p = _inputs()
    for scale in (1.0, 2.0):
        res = d.dispatch(x * scale, IDX, p)
        got, want = [], []
        for f, out in ((compiled, got), (d.combine, want)):
            y = res.recv_x.clone().requires_grad_()
            z = f(y, res.handle)
            z.square().sum().backward()
            out += [z.detach(), y.grad]
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
    full = torch.compile(lambda y, h: d.combine(y, h), backend="aot_eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="not dispatch_expanded"):
        full(res.recv_x, res.handle)
    del res
    torch._dynamo.reset()
    gc.collect()


def test_compile_dropless_fullgraph_names_the_fix_under_captured_scalars() -> None:
    """torchtitan compiles each block with ``fullgraph=True`` and ``capture_scalar_outputs``:
    a dropless dispatch is refused with a message naming ``num_worst_tokens > 0`` (not
    dynamo's data-dependent guard error), and without ``fullgraph`` it equals eager."""
    torch._dynamo.reset()
    d = FlexDispatcher(DispatchConfig(backend="torch"), num_experts=E)
    x, p = _inputs()

    def fn(xg: torch.Tensor, pg: torch.Tensor) -> torch.Tensor:
        res = d.dispatch(xg, IDX, pg)
        return d.combine(res.recv_x * 2, res.handle)

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        full = torch.compile(fn, fullgraph=True, backend="aot_eager")
        with pytest.raises(torch._dynamo.exc.Unsupported, match="num_worst_tokens > 0"):
            full(x, p)
        torch._dynamo.reset()
        assert torch.equal(torch.compile(fn, backend="aot_eager")(x, p), fn(x, p))
    torch._dynamo.reset()
    gc.collect()  # NOTE: the refused compile's traceback held a dispatch result


# --------------------------------------------------------------------------- reliability-5 S8


def test_the_ops_called_directly_check_their_id_tensors() -> None:
    # an empty id tensor raised IndexError; a float one ([serial + 0.4]) was truncated to the id
    d = FlexDispatcher(DispatchConfig(backend="torch"), num_experts=E)
    x, p = _inputs()
    op = torch.ops.flexdispatch
    for bad in (torch.empty(0, dtype=torch.int64), d._op_id.double() + 0.4, d._op_id.view(1, 1)):
        with pytest.raises(
            ValueError, match=r"dispatcher must be the dispatcher's id .* \[1\] int64"
        ):
            op.dispatch(x, IDX, p, bad, 0, E)
    outs = op.dispatch(x, IDX, p, d._op_id, 0, E)
    for bad in (torch.empty(0, dtype=torch.int64), outs[4].float(), outs[4][:1]):
        with pytest.raises(ValueError, match=r"handle must be the handle tensor .* \[2\] int64"):
            op.combine(outs[0], bad, d._op_id, T)


def test_the_ops_int_arguments_must_agree_with_the_dispatcher_and_the_handle() -> None:
    # the fake rules size the traced outputs from these ints: told W=64 on a dropless
    # dispatcher, num_tokens=7, num_recv_rows=99, the real ops returned other shapes silently
    d = FlexDispatcher(DispatchConfig(backend="torch"), num_experts=E)
    x, p = _inputs()
    op = torch.ops.flexdispatch
    with pytest.raises(ValueError, match=r"num_worst_tokens=64 but the dispatcher has 0"):
        op.dispatch(x, IDX, p, d._op_id, 64, E)
    with pytest.raises(ValueError, match=r"num_local_experts=3 but the dispatcher has 4"):
        op.dispatch(x, IDX, p, d._op_id, 0, 3)
    recv_x, _, recv_p, _, handle_t = op.dispatch(x, IDX, p, d._op_id, 0, E)
    M = recv_x.shape[0]
    with pytest.raises(ValueError, match=rf"num_tokens=7 but the handle has {T}"):
        op.combine(recv_x, handle_t, d._op_id, 7)
    with pytest.raises(ValueError, match=rf"num_tokens=7 but the handle has {T}"):
        op.combine_with_probs(recv_x, recv_p, handle_t, d._op_id, 7)
    with pytest.raises(ValueError, match=rf"num_recv_rows=99 but the handle has {M}"):
        op.cached_dispatch(x, handle_t, d._op_id, 99)
    assert op.combine(recv_x, handle_t, d._op_id, T).shape == (T, H)  # the right ints: fine


def test_a_compiled_direct_op_call_with_a_wrong_size_raises() -> None:
    # aot_eager, fullgraph: the graph was traced with the fake shape (7, H); the real op
    # returned (T, H) and nothing was said
    torch._dynamo.reset()
    d = FlexDispatcher(DispatchConfig(backend="torch", num_worst_tokens=12), num_experts=E)
    x, p = _inputs()
    op = torch.ops.flexdispatch

    def fn(a, b):
        recv_x, _, _, _, handle_t = op.dispatch(a, IDX, b, d._op_id, 12, E)
        return op.combine(recv_x, handle_t, d._op_id, 7)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    with pytest.raises(ValueError, match=rf"num_tokens=7 but the handle has {T}"):
        compiled(x, p)
    torch._dynamo.reset()
