"""The backend protocol: what every dispatch backend implements and reports.

Shape letters (ARCHITECTURE.md): T tokens on this rank · H hidden · E experts in total · R ranks ·
e = E / R local experts · k top-k · L ranks per node · N = R / L nodes · M received rows ·
W worst-case rows.

A backend moves rows and nothing else: it is never differentiable (``FlexDispatcher`` wraps its
primitives in autograd Functions) and it keeps no per-call state on itself. Everything ``combine``
needs travels in the ``DispatchHandle`` it returns. Capabilities are answered as ``(ok, reason)``
pairs so that selection and diagnostics can explain themselves.

Every hook the dispatcher may call is declared here; the optional ones have a default (no-op, or
a refusal naming the capability that says why): the expanded layout, a dispatch in two halves
(``launch_*`` / ``finish_*``), the combine with a bias, the low-latency decode kernels, device
statistics (``flush_stats``) and the count of bad ids a backend takes itself (``counts_bad_ids``).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from flexdispatch.distributed import group_rank, group_size
from flexdispatch.types import (
    DispatchHandle,
    DispatchLayout,
    DispatchResult,
    DispatchStats,
    ExpandedDispatchResult,
    ExpertMajorHandle,
    ExpertMajorResult,
)

if TYPE_CHECKING:
    from flexdispatch.config import DispatchConfig

__all__ = ["Capability", "DispatchBackend"]

Capability = tuple[bool, str]
"""``(ok, reason)``: whether a feature is supported and why (or why not)."""


class DispatchBackend(abc.ABC):
    """A way of moving rows between the ranks of an expert-parallel group.

    Attributes:
        name: registry name (``"torch"``, ``"deepep"``).
        api: the DeepEP release of a ``deepep`` backend, else None.
        num_ranks: R.
        rank: this rank inside the group.
        ranks_per_node: L.
        num_experts: E.
        stats: cumulative counters; the backend adds bytes, rows and host syncs to them.
        counts_bad_ids: ``dispatch`` maps the ids outside ``[-1, E)`` safely itself (the torch
            backend sends them nowhere) and, with checks off, counts them where it computes
            counts anyway, leaving ``bad_ids``: that dispatch's ``(count, lowest id, highest
            id)`` as 0-dim int64 device tensors (None with checks on, where they raised before
            any collective). The dispatcher then checks no value with checks off and logs the
            count (``FlexDispatcher.check_overflow`` raises naming it).
    """

    name: str
    api: str | None = None
    """The DeepEP release a ``deepep`` backend runs (``"v1"``, ``"v2"``, ``"v25"``)."""
    counts_bad_ids: bool = False
    bad_ids: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    issuer: int = 0
    """The serial of the ``FlexDispatcher`` that owns this backend (set by it): a backend may
    stamp it on the handles it makes (``DispatchHandle.issuer``), else the dispatcher does."""
    config_fields: dict[str, str] = {}  # noqa: RUF012 - read-only, replaced by subclasses
    """This backend's own constructor arguments -> the ``DispatchConfig`` fields they take."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        num_experts: int,
        ranks_per_node: int,
        num_worst_tokens: int = 0,
        hierarchical: bool = False,
        checks: bool | None = None,
        stats: DispatchStats | None = None,
    ) -> None:
        """The arguments every backend takes (a backend adds its own, keyword-only).

        Args:
            group: the expert-parallel process group (None = WORLD, or a world of one).
            num_experts: E, divisible by R.
            ranks_per_node: L as resolved by the dispatcher.
            num_worst_tokens: W (0 = dropless).
            hierarchical: node-aware two-stage dispatch.
            checks: value checks that need a host sync (None: ``FLEXDISPATCH_CHECKS``).
            stats: counters to add to (shared with the dispatcher), or None for new ones.
        """
        self.group = group
        self.num_ranks = group_size(group)
        self.rank = group_rank(group)
        self.ranks_per_node = ranks_per_node
        self.num_experts = num_experts
        self.num_worst_tokens = num_worst_tokens
        self.hierarchical = hierarchical
        self.checks = checks
        self._stats = stats if stats is not None else DispatchStats()

    @property
    def stats(self) -> DispatchStats:
        """Cumulative counters (statistics kept on the device folded in first: ``flush_stats``,
        which may read the device)."""
        self.flush_stats()
        return self._stats

    @stats.setter
    def stats(self, value: DispatchStats) -> None:
        self._stats = value

    @classmethod
    def from_config(
        cls,
        config: DispatchConfig,
        group: dist.ProcessGroup | None,
        *,
        num_experts: int,
        ranks_per_node: int,
        stats: DispatchStats,
        **hooks: Any,
    ) -> DispatchBackend:
        """Build this backend for ``config``: the fields every backend takes, then the ones of
        this backend (``config_fields``).

        Args:
            config: the ``DispatchConfig``.
            group: the process group (None = WORLD).
            num_experts: E.
            ranks_per_node: L (resolved).
            stats: counters the backend adds to.
            hooks: private test hooks the constructor takes (``_deep_ep``).

        Raises:
            ValueError: the backend cannot serve this group (with the reason).
        """
        return cls(
            group,
            num_experts=num_experts,
            ranks_per_node=ranks_per_node,
            num_worst_tokens=config.num_worst_tokens,
            hierarchical=config.hierarchical,
            checks=config.checks or None,
            stats=stats,
            **{arg: getattr(config, field) for arg, field in cls.config_fields.items()},
            **hooks,
        )

    @property
    def num_local_experts(self) -> int:
        """e = E / R."""
        return self.num_experts // self.num_ranks

    @property
    def num_nodes(self) -> int:
        """N = R / L."""
        return self.num_ranks // self.ranks_per_node

    # ----------------------------------------------------------------- capabilities
    @abc.abstractmethod
    def supports_worst_case(self) -> Capability:
        """Static-shape worst-case mode (``num_worst_tokens > 0``)."""

    @abc.abstractmethod
    def supports_cuda_graph(self) -> Capability:
        """Capturing dispatch/combine in a CUDA graph."""

    @abc.abstractmethod
    def supports_hierarchical(self) -> Capability:
        """Node-aware two-stage dispatch."""

    @abc.abstractmethod
    def supports_world(self, num_ranks: int, ranks_per_node: int) -> Capability:
        """Running on ``num_ranks`` ranks with ``ranks_per_node`` ranks per node."""

    # ----------------------------------------------------------------- primitives (no grad)
    @abc.abstractmethod
    def dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
        layout: DispatchLayout | None = None,
    ) -> DispatchResult:
        """Send each token once to every rank holding one of its experts.

        Args:
            x: ``[T, H]`` rows (bf16, fp16 or fp32).
            topk_idx: ``[T, k]`` int64 global expert ids, ``-1`` = none.
            topk_probs: ``[T, k]`` float32, 0 where ``topk_idx`` is ``-1``.
            layout: optional precomputed ``get_dispatch_layout`` result for ``topk_idx``.

        Returns:
            ``DispatchResult`` satisfying the seven-point contract of ARCHITECTURE.md.
        """

    @abc.abstractmethod
    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Send rows back along ``handle`` and sum them per source token.

        Args:
            y: ``[M, X]`` floating rows in the order ``dispatch`` returned (``[W, X]`` in
                worst-case mode; rows past the real ones are ignored). Any width ``X``.

        Returns:
            ``[T, X]`` unweighted sum over the receiving ranks; zero for tokens sent nowhere.
        """

    @abc.abstractmethod
    def cached_dispatch(self, x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Send new rows along an existing handle's layout (the backward of ``combine``).

        Args:
            x: ``[T, X]`` floating rows, one per source token. Any width ``X``.

        Returns:
            ``[M, X]`` (``[W, X]`` in worst-case mode, zero past the real rows), in the order of
            the handle's ``dispatch``.
        """

    # ----------------------------------------------------------------- expanded (optional)
    def supports_expanded(self) -> Capability:
        """``dispatch_expanded``: rows per (token, local expert), grouped by expert."""
        return False, f"the {self.name} backend returns one row per (token, rank): use permute"

    def dispatch_expanded(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_probs: torch.Tensor
    ) -> ExpandedDispatchResult:
        """Dispatch into the expert-major layout of ``ExpandedDispatchResult`` (no permute).

        ``combine`` / ``cached_dispatch`` take the returned handle like any other; the backward
        of the routing weights goes through ``combine_slot_weights``.
        """
        raise NotImplementedError(self.supports_expanded()[1])

    def combine_slot_weights(
        self, y: torch.Tensor | None, w: torch.Tensor, handle: DispatchHandle
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The backward of ``dispatch_expanded``: ``(combine(y), [T, k] float32)`` where slot
        ``j`` of token ``t`` gets ``w`` of the row it was expanded into (0 for a slot sent
        nowhere); ``y`` None skips the rows."""
        raise NotImplementedError(self.supports_expanded()[1])

    def combine_with_probs(
        self, y: torch.Tensor | None, probs: torch.Tensor, handle: DispatchHandle
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The backward of ``dispatch``: ``(combine(y), combine(probs))`` for ``probs`` ``[M, k]``
        float32 that is 0 wherever ``recv_topk_idx`` is ``-1``; ``y`` None skips the rows.

        Default: two combines. DeepEP overrides it with one combine whose ``topk_weights``
        channel carries ``probs`` (each slot is non-zero on one rank only, so DeepEP's per-slot
        reduction is the sum).
        """
        return (None if y is None else self.combine(y, handle)), self.combine(probs, handle)

    # ----------------------------------------------------------------- DeepEP 2.5 (optional)
    def supports_combine_bias(self, dtype: torch.dtype) -> Capability:
        """``combine_bias``: a ``[T, X]`` bias added inside the combine's reduction."""
        return False, f"the {self.name} backend adds a bias after combine"

    def combine_bias(
        self, y: torch.Tensor, handle: DispatchHandle, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``combine(y, handle) + bias``, the bias added inside the reduction (one rounding)."""
        out = self.combine(y, handle)
        return out if bias is None else out + bias

    # ----------------------------------------------------------------- in two halves (optional)
    def supports_overlap(self, *, expanded: bool) -> Capability:
        """A dispatch that returns before its rows: ``launch_expanded`` / ``finish_expanded``
        (``expanded``), or ``launch_dispatch`` / ``finish_dispatch``."""
        return False, f"the {self.name} backend finishes a dispatch before returning"

    def launch_dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
        layout: DispatchLayout | None = None,
    ) -> Any:
        """Issue ``dispatch`` and return what ``finish_dispatch`` takes (its arguments and
        errors); work issued before the finish overlaps the dispatch."""
        raise NotImplementedError(self.supports_overlap(expanded=False)[1])

    def finish_dispatch(self, pending: Any) -> DispatchResult:
        """Wait for a ``launch_dispatch`` and build its result."""
        raise NotImplementedError(self.supports_overlap(expanded=False)[1])

    def launch_expanded(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
    ) -> Any:
        """Issue ``dispatch_expanded`` and return what ``finish_expanded`` takes."""
        raise NotImplementedError(self.supports_overlap(expanded=True)[1])

    def check_finish(self, pending: Any) -> None:  # noqa: B027 - optional hook, no-op by default
        """Raise when ``pending`` (a ``launch_expanded``) cannot be finished now."""

    def finish_expanded(self, pending: Any) -> ExpandedDispatchResult:
        """Wait for a ``launch_expanded`` and build its result."""
        raise NotImplementedError(self.supports_overlap(expanded=True)[1])

    # ----------------------------------------------------------------- decode (optional)
    def low_latency_tokens(self) -> int | None:
        """The tokens per rank and call a backend with low-latency decode kernels was built for
        (``low_latency_dispatch`` / ``low_latency_combine``), None without them."""
        return None

    def low_latency_dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_probs: torch.Tensor
    ) -> ExpertMajorResult:
        """Expert-major decode dispatch (``dispatch.decode``), ``[e, C, H]`` rows."""
        raise NotImplementedError(f"the {self.name} backend has no low-latency kernels")

    def low_latency_combine(self, y: torch.Tensor, handle: ExpertMajorHandle) -> torch.Tensor:
        """The weighted combine of ``low_latency_dispatch``'s rows."""
        raise NotImplementedError(f"the {self.name} backend has no low-latency kernels")

    # ----------------------------------------------------------------- safe points
    def flush_stats(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Fold statistics kept on the device into ``stats`` (may sync the host)."""

    def check_overflow(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Raise if a worst-case dispatch overflowed since construction (may sync the host)."""

    def close(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Release communication resources."""
