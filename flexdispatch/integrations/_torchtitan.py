"""The classes behind ``flexdispatch.integrations.torchtitan`` (this module imports torchtitan).

T tokens on this rank · D hidden · E experts · K top-k · R ranks of the EP mesh · e = E / R local
experts · M received rows · N rows grouped by local expert.
"""

from __future__ import annotations

import contextlib
import math
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.config import override
from torchtitan.models.common.token_dispatcher import (
    AllToAllTokenDispatcher,
    BaseEPTokenDispatcher,
    LocalTokenDispatcher,
)

from flexdispatch.config import DispatchConfig
from flexdispatch.dispatch import ops as _ops
from flexdispatch.dispatch.dispatcher import FlexDispatcher
from flexdispatch.permutation import _permute, unpermute
from flexdispatch.types import DispatchHandle, Permutation

__all__ = [
    "FLEXDISPATCH_SAVE_OPS",
    "FlexDispatchMetadata",
    "FlexTokenDispatcher",
    "flexdispatch_override",
    "update_flex_token_dispatcher_config",
]

_PUBLIC = "flexdispatch.integrations.torchtitan"


@dataclass(frozen=True, kw_only=True)
class FlexDispatchMetadata:
    """What ``FlexTokenDispatcher.dispatch`` hands to ``combine``."""

    handle: DispatchHandle
    perm: Permutation


_DISPATCH_FIELDS = ("backend", "deepep_api", "hierarchical", "ranks_per_node", "checks")
"""The ``Config`` fields handed to ``DispatchConfig`` unchanged (same names there)."""


def _check_config(cfg: Any) -> None:
    """``FlexTokenDispatcher.Config``'s fields, when it is made (a bad string used to surface only
    at ``parallelize``, as a pydantic error about a ``DispatchConfig`` the user never wrote).

    Raises:
        TypeError: ``num_worst_tokens`` / ``num_max_tokens_per_rank`` not an int (a bool, a
            float, a JSON string are not).
        ValueError: naming the field: ``num_worst_tokens`` < -1, ``num_max_tokens_per_rank`` not
            None or > 0, or a value ``DispatchConfig`` refuses (``backend``, ``deepep_api``, ...).
    """
    for name, value in (
        ("num_worst_tokens", cfg.num_worst_tokens),
        ("num_max_tokens_per_rank", cfg.num_max_tokens_per_rank),
    ):
        if value is None and name == "num_max_tokens_per_rank":
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                f"FlexTokenDispatcher.Config {name} must be an int, got {value!r} "
                f"({type(value).__name__})"
            )
    if cfg.num_worst_tokens < -1:
        raise ValueError(
            f"FlexTokenDispatcher.Config num_worst_tokens must be 0 (dropless), -1 (EP x tokens "
            f"per rank) or a row count W > 0, got {cfg.num_worst_tokens}"
        )
    if cfg.num_max_tokens_per_rank is not None and cfg.num_max_tokens_per_rank <= 0:
        raise ValueError(
            f"FlexTokenDispatcher.Config num_max_tokens_per_rank must be None (the job's tokens "
            f"per rank, or the first batch's) or > 0, got {cfg.num_max_tokens_per_rank}"
        )
    try:
        # NOTE: the one source of truth for these values (a throwaway config, no dispatcher)
        DispatchConfig(**{name: getattr(cfg, name) for name in _DISPATCH_FIELDS})
    except ValueError as exc:  # NOTE: pydantic's ValidationError is a ValueError
        errors = getattr(exc, "errors", None)
        first = errors()[0] if callable(errors) and errors() else {}
        field = str((first.get("loc") or ("",))[0]) or "config"
        why = first.get("msg") or " ".join(str(exc).split())
        value = getattr(cfg, field, None)
        raise ValueError(f"FlexTokenDispatcher.Config {field}={value!r}: {why}") from None


class FlexTokenDispatcher(BaseEPTokenDispatcher):
    """torchtitan EP token dispatcher over a ``FlexDispatcher`` (module docstring of
    ``flexdispatch.integrations.torchtitan``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseEPTokenDispatcher.Config):
        backend: str = "auto"
        """``DispatchConfig.backend``: ``"auto"``, ``"torch"`` or ``"deepep"``."""
        num_worst_tokens: int = 0
        """0 dropless; W > 0 static rows; -1: EP × ``num_max_tokens_per_rank``."""
        num_max_tokens_per_rank: int | None = None
        """Tokens per rank for ``num_worst_tokens=-1`` (``update_flex_token_dispatcher_config``
        fills it from the job; None: the first dispatch's token count)."""
        hidden_dim: int | None = None
        """The model's hidden size (filled from the job; informative)."""
        hierarchical: bool = False
        ranks_per_node: int | None = None
        deepep_api: str = "auto"
        """``DispatchConfig.deepep_api``: ``"auto"``, ``"v1"``, ``"v2"`` or ``"v25"``."""
        checks: bool = False

        def __post_init__(self) -> None:
            _check_config(self)

    def __init__(self, config: Config):
        super().__init__(config)
        _check_config(config)  # NOTE: again: a field may have been set after the Config was made
        self.config = config
        self.dispatcher: FlexDispatcher | None = None
        self._first_batch: int | None = None  # NOTE: W's tokens per rank came from it

    def init_buffer(self) -> None:
        """Build the ``FlexDispatcher`` on the EP mesh's group (collective), unless its worst
        case waits for the first dispatch's token count."""
        if self.ep_mesh is None or self.dispatcher is not None:
            return
        if self.config.num_worst_tokens == -1 and self.config.num_max_tokens_per_rank is None:
            return
        self._build(self.config.num_max_tokens_per_rank)

    def _build(self, tokens_per_rank: int | None) -> FlexDispatcher:
        if self.ep_mesh is None:
            raise RuntimeError("FlexTokenDispatcher: no EP mesh wired (wire_meshes)")
        group = self.ep_mesh.get_group()
        W = self.config.num_worst_tokens
        if W == -1:
            bad = isinstance(tokens_per_rank, bool) or not isinstance(tokens_per_rank, int)
            if bad or tokens_per_rank <= 0:
                raise ValueError(
                    f"FlexTokenDispatcher: num_worst_tokens=-1 needs num_max_tokens_per_rank > 0 "
                    f"(the most tokens a rank dispatches), got {tokens_per_rank!r}: set it, or "
                    f"let update_flex_token_dispatcher_config fill it from the job"
                )
            W = group.size() * tokens_per_rank
        self.dispatcher = FlexDispatcher(
            DispatchConfig(
                backend=self.config.backend,  # type: ignore[arg-type]
                num_worst_tokens=W,
                hierarchical=self.config.hierarchical,
                ranks_per_node=self.config.ranks_per_node,
                deepep_api=self.config.deepep_api,  # type: ignore[arg-type]
                checks=self.config.checks,
            ),
            num_experts=self.num_experts,
            group=group,
        )
        return self.dispatcher

    def _build_from_first_batch(self, tokens: int) -> FlexDispatcher:
        """``num_worst_tokens=-1`` with nothing filled: W from the first batch's token count."""
        self._first_batch = tokens
        return self._build(tokens)

    def dispatch(
        self,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_expert_ids_TK: torch.Tensor,
        num_local_tokens_per_expert_E: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """``x_TD`` ``[T, D]``, scores and expert ids ``[T, K]`` -> (``[N, D]`` rows grouped by
        local expert, ``[e]`` int64 rows per local expert, metadata for ``combine``)."""
        if self.ep_mesh is None:  # EP = 1: local reordering, as torchtitan's dispatchers
            return LocalTokenDispatcher.dispatch(
                self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E
            )
        fd = self.dispatcher or _build_outside_graph(self, x_TD.shape[0])
        with _collective_boundary("dispatch", x_TD) as stamp:
            try:
                # NOTE: through the custom op (as torch.compile does), so that selective
                # activation checkpointing sees flexdispatch::dispatch and can save it
                res = _ops.dispatch(
                    fd,
                    x_TD,
                    topk_expert_ids_TK.to(torch.int64),
                    topk_scores_TK.to(torch.float32),
                    None,
                )
                W = fd.config.num_worst_tokens
                if W > 0 and x_TD.shape[0] * fd.num_ranks > W:
                    # NOTE: only a rank with more than W / R tokens can overflow W, and the
                    # dispatch records that on the device without a host read: read it here,
                    # on this path only (torchtitan gives every rank the same T, so every rank
                    # reads it and raises together)
                    fd.check_overflow()
            except ValueError as exc:
                self._name_the_field(exc, fd, x_TD.shape[0])
                raise
            M, K = res.recv_topk_idx.shape
            worst = fd.config.num_worst_tokens > 0
            # NOTE: the dispatcher's own rows: permute's argument checks are not run again
            perm = _permute(
                res.recv_x,
                res.recv_topk_idx,
                fd.num_local_experts,
                res.recv_topk_probs,
                # NOTE: worst-case mode keeps static shapes (zero rows past the real ones)
                static_rows=M * K if worst else None,
                num_rows=None if worst else res.num_recv_pairs,
                impl="auto",
            )
        meta = FlexDispatchMetadata(handle=res.handle, perm=perm)
        return stamp(perm.x), stamp(perm.padded_tokens_per_expert), meta

    def _name_the_field(self, exc: ValueError, fd: FlexDispatcher, tokens: int) -> None:
        """A worst-case overflow where W came from the first batch (``num_worst_tokens=-1``,
        nothing filled): the dispatcher's message says to raise ``num_worst_tokens``, a value the
        user never set here; raise one naming ``num_max_tokens_per_rank`` instead."""
        text = str(exc)
        if self._first_batch is None or "worst-case dispatch overflow" not in text:
            return
        R = self.ep_mesh.size() if self.ep_mesh is not None else 1
        need = re.search(r"(?:at least|>=) (\d+)", text)
        least = f"at least {math.ceil(int(need.group(1)) / R)}, " if need else ""
        raise ValueError(
            f"FlexTokenDispatcher: a batch of {tokens} tokens on this rank overflows the "
            f"worst case of W={fd.config.num_worst_tokens} rows that num_worst_tokens=-1 took "
            f"from the first batch ({self._first_batch} tokens per rank): set "
            f"num_max_tokens_per_rank ({least}the most tokens a rank dispatches) in the "
            f"override's options, or call update_flex_token_dispatcher_config"
        ) from None

    def combine(
        self, routed_output_RD: torch.Tensor, metadata: Any, x_TD: torch.Tensor
    ) -> torch.Tensor:
        """Weight each row by its score, sum per received token in fp32, send the sums back."""
        if self.ep_mesh is None:
            return LocalTokenDispatcher.combine(self, routed_output_RD, metadata, x_TD)
        if not isinstance(metadata, FlexDispatchMetadata) or self.dispatcher is None:
            raise TypeError("combine needs the metadata of this dispatcher's dispatch")
        perm = metadata.perm
        with _collective_boundary("combine", routed_output_RD) as stamp:
            summed_MD = unpermute(routed_output_RD, perm, probs=perm.probs)
            out = self.dispatcher.combine(summed_MD, metadata.handle)
        return stamp(out)


_BUILD_REASON = (
    "flexdispatch: FlexTokenDispatcher(num_worst_tokens=-1) builds its FlexDispatcher at the "
    "first dispatch when num_max_tokens_per_rank is unset, which a fullgraph=True region cannot "
    "do: set num_max_tokens_per_rank (update_flex_token_dispatcher_config fills it from the job) "
    "or run one step eagerly first"
)

# NOTE: outside any compiled graph: dynamo cannot trace the dispatcher's construction (pydantic,
# a collective); without fullgraph it breaks the graph here, with it it refuses with the reason
_build_outside_graph = torch.compiler.disable(
    FlexTokenDispatcher._build_from_first_batch, reason=_BUILD_REASON
)


def flexdispatch_override(
    cfg: AllToAllTokenDispatcher.Config, **options: Any
) -> FlexTokenDispatcher.Config:
    """torchtitan ``@override`` factory: the ``FlexTokenDispatcher.Config`` for a matched
    ``AllToAllTokenDispatcher.Config`` (same ``num_experts`` / ``top_k``); ``options`` (the
    ``--override.imports`` entry's JSON kwargs) set the other fields."""
    return FlexTokenDispatcher.Config(num_experts=cfg.num_experts, top_k=cfg.top_k, **options)


# NOTE: registered under the public module's name: --override.imports names
# flexdispatch.integrations.torchtitan.flexdispatch_override
flexdispatch_override.__module__ = _PUBLIC
flexdispatch_override = override(
    target=AllToAllTokenDispatcher.Config,
    exact=True,
    description="flexdispatch: DeepEP or torch.distributed all-to-all under one contract",
)(flexdispatch_override)


def _spmd_checking() -> bool:
    """Whether torchtitan's ``spmd_typechecking`` (spmd_types' checker) is active here."""
    spmd = sys.modules.get("spmd_types")
    return spmd is not None and bool(spmd.TYPE_CHECKING)


@contextlib.contextmanager
def _collective_boundary(what: str, rows: torch.Tensor) -> Iterator[Callable[[Any], Any]]:
    """Under spmd_types' checker: one typed boundary around a dispatch (or combine) and the
    permutation beside it, as ``typecheck_forward`` is for an autograd Function. On entry the
    rows' type is checked (partial (P) rows are refused); inside, the checker is off
    (``spmd_types.no_typecheck``: what runs there — the autograd Functions or the custom ops,
    a no-grad call straight to the backend, the Triton permutation kernels on CUDA — is
    flexdispatch's own); the ``stamp`` it yields types each result varying (V) on every axis of
    the rows, as the rows a rank receives (and the sums it gets back) differ from rank to rank.
    Without the checker: no boundary, ``stamp`` returns its argument."""
    if not _spmd_checking():
        yield lambda t: t
        return
    import spmd_types as spmd

    rows_type = spmd.get_local_type(rows) if spmd.has_local_type(rows) else {}
    if any(v is spmd.P for v in rows_type.values()):
        raise spmd.SpmdTypeError(
            f"FlexTokenDispatcher.{what}: partial (P) rows cannot be dispatched or combined: "
            f"reduce them first (types {rows_type})"
        )
    varying = {axis: spmd.V for axis in rows_type}

    def stamp(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and varying:
            spmd.assert_type(t, varying)
        return t

    with spmd.no_typecheck():
        yield stamp


def update_flex_token_dispatcher_config(model_config: Any, job_config: Any) -> None:
    """See ``flexdispatch.integrations.torchtitan.update_flex_token_dispatcher_config``."""
    configs = [
        cfg for _, cfg, _, _ in model_config.traverse(FlexTokenDispatcher.Config, recurse=True)
    ]
    if not configs:
        return
    parallelism, training = job_config.parallelism, job_config.training
    for owner, name in (
        (parallelism, "context_parallel_degree"),
        (parallelism, "tensor_parallel_degree"),
        (training, "local_batch_size"),
        (training, "seq_len"),
    ):
        value = getattr(owner, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            where = "parallelism" if owner is parallelism else "training"
            raise ValueError(
                f"{where}.{name} must be an int >= 1 to size FlexTokenDispatcher's worst case, "
                f"got {value!r}"
            )
    shards = parallelism.context_parallel_degree * parallelism.tensor_parallel_degree
    if training.seq_len % shards:
        raise ValueError(
            f"training.seq_len ({training.seq_len}) must be divisible by "
            f"context_parallel_degree * tensor_parallel_degree ({shards}) so that every rank "
            f"holds the same number of tokens: pad seq_len to a multiple of {shards}"
        )
    tokens = training.local_batch_size * training.seq_len // shards
    for cfg in configs:
        cfg.hidden_dim = getattr(model_config, "dim", cfg.hidden_dim)
        if cfg.num_max_tokens_per_rank is None:
            cfg.num_max_tokens_per_rank = tokens
        elif cfg.num_max_tokens_per_rank < tokens:
            raise ValueError(
                f"FlexTokenDispatcher num_max_tokens_per_rank ({cfg.num_max_tokens_per_rank}) is "
                f"smaller than the job's tokens per rank ({tokens}): raise it or leave it unset"
            )


FLEXDISPATCH_SAVE_OPS = frozenset(
    {torch.ops.flexdispatch.dispatch.default, torch.ops.flexdispatch.combine.default}
)
"""flexdispatch's communicating ops, for a selective activation checkpointing save list: saved,
a recomputed forward does not run the all-to-all (and, dropless, the host sync) again."""


def _save_flexdispatch_ops() -> None:
    """Add ``FLEXDISPATCH_SAVE_OPS`` to torchtitan's default save list (``SelectiveAC``, its
    default activation checkpointing, reads ``_get_default_save_ops`` when it wraps a block),
    so that a dispatch is not recomputed in the backward: it names its own and DeepEP's ops, not
    flexdispatch's. Idempotent; where torchtitan has no such function (another release), warns
    once with the recipe (a ``SelectiveAC`` subclass whose ``get_save_ops`` adds them)."""
    try:
        from torchtitan.distributed import activation_checkpoint as ac
    except ImportError:
        return
    current = getattr(ac, "_get_default_save_ops", None)
    if current is None or not callable(current):
        warnings.warn(
            "flexdispatch: torchtitan.distributed.activation_checkpoint has no "
            "_get_default_save_ops (not torchtitan 0.3.0): under SelectiveAC every flexdispatch "
            "dispatch is recomputed in the backward; subclass SelectiveAC with get_save_ops = "
            "lambda self: super().get_save_ops() | FLEXDISPATCH_SAVE_OPS",
            stacklevel=2,
        )
        return
    if getattr(current, "_flexdispatch", False):
        return

    def default_save_ops() -> set:
        return set(current()) | FLEXDISPATCH_SAVE_OPS

    default_save_ops._flexdispatch = True  # type: ignore[attr-defined]
    default_save_ops.__wrapped__ = current  # type: ignore[attr-defined]
    default_save_ops.__doc__ = current.__doc__
    ac._get_default_save_ops = default_save_ops


_save_flexdispatch_ops()
