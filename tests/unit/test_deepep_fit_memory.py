"""Issue 44, Q3: the "new DeepEP buffer fits on every rank" agreement counts only memory that
DeepEP's allocator can get.

DeepEP V2 / V2.5 allocate their symmetric buffer with ``ncclMemAlloc`` -> ``cuMemCreate``
(deep_ep_v25/csrc/kernels/comm/symmetric.hpp:119-124, 78-93), V1 with ``cudaMalloc``
(v1.2.1 csrc/deep_ep.cpp:49) / NVSHMEM: all from the driver, none from PyTorch's caching
allocator. What they can get is ``cudaMemGetInfo``'s free memory (``torch.cuda.mem_get_info``),
plus what ``torch.cuda.empty_cache()`` gives back to the driver first — never PyTorch's
reserved-but-unused bytes as such.

A stand-in CUDA device (``_Device``) replaces torch's memory queries: ``free`` is what the driver
has, ``reserved - allocated`` is PyTorch's cache, and ``empty_cache`` returns the cache to the
driver (all of it, unless ``fragmented``). At 1aba7f0 every test here but the last fails: the
15 GiB buffer is accepted on 2 GiB free (the 20 GiB cache counted), ``empty_cache`` is never
called, a second identical build skips the query, and sizes below 256 MiB are never checked.
"""

from __future__ import annotations

import pytest
import torch

from flexdispatch.backends.deepep import refusals

GiB = 1 << 30


class _Device:
    def __init__(self, free: int, reserved: int, allocated: int, fragmented: bool = False) -> None:
        self.free, self.reserved, self.allocated = free, reserved, allocated
        self.fragmented, self.emptied = fragmented, 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (self.free, 80 * GiB))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: self.reserved)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: self.allocated)
        monkeypatch.setattr(torch.cuda, "empty_cache", self.empty_cache)

    def empty_cache(self) -> None:
        self.emptied += 1
        if not self.fragmented:
            self.free += self.reserved - self.allocated
            self.reserved = self.allocated


def _agree(num_bytes: int, what: str = "DeepEP 2.5 EPBuffer") -> None:
    refusals.agree_buffer_fits(
        None,
        what,
        num_bytes=num_bytes,
        held=0,
        device=torch.device("cuda", 0),
        setting="num_max_dispatch_tokens_per_rank",
        value=4096,
        detail=f"{num_bytes} bytes in all for M=4096",
        fix="set a smaller DispatchConfig.num_max_dispatch_tokens_per_rank",
    )


def test_cached_but_unused_memory_is_not_what_deepep_can_allocate(monkeypatch) -> None:
    """2 GiB free and 20 GiB cached that ``empty_cache`` cannot give back (a fragmented cache):
    ``ncclMemAlloc`` sees 2 GiB, so a 15 GiB buffer is refused before the collective build."""
    _Device(2 * GiB, 22 * GiB, 2 * GiB, fragmented=True).install(monkeypatch)
    with pytest.raises(ValueError, match="outside PyTorch's caching allocator") as err:
        _agree(15 * GiB)
    assert "num_max_dispatch_tokens_per_rank=4096" in str(err.value)
    assert "after returning PyTorch's cache" in str(err.value)


def test_the_cache_is_given_back_before_it_is_counted(monkeypatch) -> None:
    """2 GiB free and 20 GiB of releasable cache: the cache is returned to the driver on this
    rank (the only way those bytes reach DeepEP), then the free memory counts: 15 GiB fits."""
    dev = _Device(2 * GiB, 22 * GiB, 2 * GiB)
    dev.install(monkeypatch)
    _agree(15 * GiB)
    assert dev.emptied == 1 and dev.free == 22 * GiB


def test_a_fit_is_never_remembered_and_small_builds_are_checked(monkeypatch) -> None:
    """A size that fitted once is asked again at the next build (memory changed in between), and
    a build below 256 MiB (``fits.SMALL_BYTES``) is checked too."""
    dev = _Device(40 * GiB, 0, 0)
    dev.install(monkeypatch)
    _agree(15 * GiB, what="DeepEP V2 ElasticBuffer")
    dev.free = 2 * GiB
    with pytest.raises(ValueError):
        _agree(15 * GiB, what="DeepEP V2 ElasticBuffer")
    dev.free = 50 << 20
    with pytest.raises(ValueError):
        _agree(200 << 20)


def test_enough_free_memory_never_empties_the_cache(monkeypatch) -> None:
    """Control: where the free memory alone holds the buffer, PyTorch's cache is left alone."""
    dev = _Device(40 * GiB, 22 * GiB, 2 * GiB)
    dev.install(monkeypatch)
    _agree(15 * GiB)
    assert dev.emptied == 0
