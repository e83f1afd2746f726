"""The CPU output pool: memory is lent again only once nothing refers to it any more."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from flexdispatch import DispatchConfig, FlexDispatcher
from flexdispatch._pool import CpuOutputPool

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
SHAPE = (512, 1024)  # 2 MiB of fp32


@pytest.fixture()
def pool() -> CpuOutputPool:
    p = CpuOutputPool(min_bytes=MiB, max_entries=4)
    if not p.enabled:
        pytest.skip("this PyTorch has no storage use counter: the pool is off (plain torch.empty)")
    return p


def test_returns_a_fresh_looking_tensor(pool: CpuOutputPool) -> None:
    t = pool.empty(SHAPE, torch.bfloat16)
    assert t.shape == SHAPE and t.dtype == torch.bfloat16 and t.device.type == "cpu"
    assert t.is_contiguous() and t._base is None and t.storage_offset() == 0


def test_memory_is_reused_once_dropped(pool: CpuOutputPool) -> None:
    t = pool.empty(SHAPE, torch.float32)
    ptr = t.data_ptr()
    del t
    u = pool.empty(SHAPE, torch.float32)
    assert u.data_ptr() == ptr and pool.reused == 1 and pool.allocated == 1
    # a slightly smaller request fits the same buffer too; a much smaller one does not
    del u
    assert pool.empty((500, 1024), torch.float32).data_ptr() == ptr
    assert pool.empty((128, 1024), torch.float32).data_ptr() != ptr


def _holders() -> list:
    return [
        ("the tensor", lambda t: t),
        ("a view", lambda t: t[1:]),
        ("a reshaped view", lambda t: t.view(-1)),
        ("its storage", lambda t: t.untyped_storage()),
        ("a NumPy array", lambda t: t.numpy()),
        ("a tensor made with set_", lambda t: torch.empty(0).set_(t.untyped_storage())),
    ]


def _first_float(keep: object) -> float:
    if isinstance(keep, torch.UntypedStorage):
        return float(torch.empty(0).set_(keep)[0])
    return float(torch.as_tensor(keep).reshape(-1)[0])


@pytest.mark.parametrize("name,hold", _holders(), ids=[h[0] for h in _holders()])
def test_anything_referring_to_the_memory_keeps_it_out_of_reuse(
    pool: CpuOutputPool, name: str, hold
) -> None:
    t = pool.empty(SHAPE, torch.float32)
    t.fill_(7.0)
    ptr = t.data_ptr()
    keep = hold(t)
    del t
    u = pool.empty(SHAPE, torch.float32)
    assert u.data_ptr() != ptr, f"memory held by {name} was lent again"
    u.fill_(-1.0)
    assert _first_float(keep) == 7.0
    del keep, u
    gc.collect()
    assert pool.empty(SHAPE, torch.float32).data_ptr() in {ptr, pool._entries[1].buf.data_ptr()}


def test_a_tensor_saved_for_backward_keeps_it_out_of_reuse(pool: CpuOutputPool) -> None:
    t = pool.empty(SHAPE, torch.float32).normal_()
    ref = t.clone()
    ptr = t.data_ptr()
    w = torch.randn(SHAPE, requires_grad=True)
    loss = (t * w).sum()  # mul saves t for the gradient of w
    del t
    other = pool.empty(SHAPE, torch.float32)
    assert other.data_ptr() != ptr
    other.fill_(0.0)
    loss.backward()
    assert torch.equal(w.grad, ref)
    del loss, other
    gc.collect()
    assert pool.empty(SHAPE, torch.float32).data_ptr() in {e.buf.data_ptr() for e in pool._entries}


def test_in_place_ops_under_autograd_work(pool: CpuOutputPool) -> None:
    t = pool.empty(SHAPE, torch.float32).fill_(1.0)
    t.requires_grad_(True)
    y = t * 3
    y.mul_(2)  # in place on a non-view result
    y.sum().backward()
    assert torch.all(t.grad == 6)


def test_a_storage_resized_away_is_forgotten(pool: CpuOutputPool) -> None:
    t = pool.empty(SHAPE, torch.float32)
    t.untyped_storage().resize_(0)
    del t
    u = pool.empty(SHAPE, torch.float32)
    u.fill_(1.0)  # would crash if the pool handed out the 0-byte storage
    assert pool.allocated == 2 and len(pool._entries) == 1


def test_small_requests_are_not_pooled(pool: CpuOutputPool) -> None:
    pool.empty((4, 4), torch.float32)
    assert pool.allocated == 0 and pool.held_bytes() == 0


def test_bounded_and_releasable(pool: CpuOutputPool) -> None:
    alive = [pool.empty(SHAPE, torch.float32) for _ in range(6)]
    assert len(pool._entries) <= pool.max_entries
    for t in alive:
        t.fill_(3.0)
    assert all(float(t[0, 0]) == 3.0 for t in alive)
    held = pool.held_bytes()
    del alive, t
    gc.collect()
    assert pool.release() == held and pool.held_bytes() == 0


def test_threads_never_share_live_memory(pool: CpuOutputPool) -> None:
    errors: list[str] = []
    barrier = threading.Barrier(4)

    def work(value: float) -> None:
        barrier.wait()
        for _ in range(50):
            t = pool.empty(SHAPE, torch.float32)
            t.fill_(value)
            if not bool((t == value).all()):
                errors.append(f"thread {value}: its tensor was overwritten")
            del t

    threads = [threading.Thread(target=work, args=(float(v),)) for v in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors


@pytest.mark.parametrize("W", [0, 1024])
def test_dispatcher_outputs_survive_later_calls(W: int) -> None:
    """recv_x and combine's result of one call keep their values through the next calls."""
    d = FlexDispatcher(DispatchConfig(backend="torch", num_worst_tokens=W), num_experts=8)
    g = torch.Generator().manual_seed(0)
    T, H = 1024, 1024  # 4 MiB rows: pooled

    def call(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(T, H, generator=g)
        idx = torch.rand(T, 8, generator=g).argsort(1)[:, :2]  # distinct experts per token
        idx[: seed * 7] = -1
        res = d.dispatch(x, idx, torch.rand(T, 2, generator=g))
        return res.recv_x, d.combine(res.recv_x * 2, res.handle)

    rx1, y1 = call(1)
    assert rx1._base is None and y1._base is None  # not views: in-place ops stay legal
    copies = (rx1.clone(), y1.clone())
    later = [call(s) for s in (2, 3, 4)]
    assert torch.equal(rx1, copies[0]) and torch.equal(y1, copies[1])
    ptrs = {t.data_ptr() for pair in later for t in pair}
    assert rx1.data_ptr() not in ptrs and y1.data_ptr() not in ptrs


def _child_uses_pool(q) -> None:
    from flexdispatch._pool import OUTPUT_POOL

    t = OUTPUT_POOL.empty(SHAPE, torch.float32).fill_(2.0)
    q.put((len(OUTPUT_POOL._entries), float(t.sum())))


def test_a_forked_child_starts_with_an_empty_pool_and_a_free_lock() -> None:
    import multiprocessing as mp

    from flexdispatch._pool import OUTPUT_POOL

    if not OUTPUT_POOL.enabled:
        pytest.skip("this PyTorch has no storage use counter: the pool is off")
    held = OUTPUT_POOL.empty(SHAPE, torch.float32)  # the parent holds one buffer
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    with OUTPUT_POOL._lock:  # another thread holds the lock at fork time
        p = ctx.Process(target=_child_uses_pool, args=(q,))
        p.start()
    entries, total = q.get(timeout=30)
    p.join(timeout=30)
    assert p.exitcode == 0
    assert entries == 1 and total == 2.0 * SHAPE[0] * SHAPE[1]
    del held
