"""The classes behind ``flexdispatch.integrations.torchtitan`` (this module imports torchtitan).

T tokens on this rank · D hidden · E experts · K top-k · R ranks of the EP mesh · e = E / R local
experts · M received rows · N rows grouped by local expert.
"""

from __future__ import annotations

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
from flexdispatch.dispatcher import FlexDispatcher
from flexdispatch.permutation import permute, unpermute
from flexdispatch.types import DispatchHandle, Permutation

__all__ = [
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
        checks: bool = False

    def __init__(self, config: Config):
        super().__init__(config)
        if config.num_worst_tokens < -1:
            raise ValueError(
                f"num_worst_tokens must be 0 (dropless), -1 (EP x tokens per rank) or a row "
                f"count W > 0, got {config.num_worst_tokens}"
            )
        self.config = config
        self.dispatcher: FlexDispatcher | None = None

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
            W = group.size() * int(tokens_per_rank or 0)
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
        fd = self.dispatcher or self._build(x_TD.shape[0])
        res = fd.dispatch(
            x_TD, topk_expert_ids_TK.to(torch.int64), topk_scores_TK.to(torch.float32)
        )
        M, K = res.recv_topk_idx.shape
        worst = fd.config.num_worst_tokens > 0
        perm = permute(
            res.recv_x,
            res.recv_topk_idx,
            fd.num_local_experts,
            topk_probs=res.recv_topk_probs,
            # NOTE: worst-case mode keeps static shapes (zero rows past the real ones)
            num_out_rows=M * K if worst else None,
            num_rows=None if worst else res.num_recv_pairs,
        )
        meta = FlexDispatchMetadata(handle=res.handle, perm=perm)
        return perm.x, perm.padded_tokens_per_expert, meta

    def combine(
        self, routed_output_RD: torch.Tensor, metadata: Any, x_TD: torch.Tensor
    ) -> torch.Tensor:
        """Weight each row by its score, sum per received token in fp32, send the sums back."""
        if self.ep_mesh is None:
            return LocalTokenDispatcher.combine(self, routed_output_RD, metadata, x_TD)
        if not isinstance(metadata, FlexDispatchMetadata) or self.dispatcher is None:
            raise TypeError("combine needs the metadata of this dispatcher's dispatch")
        perm = metadata.perm
        summed_MD = unpermute(routed_output_RD, perm, probs=perm.probs)
        return self.dispatcher.combine(summed_MD, metadata.handle)


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


def _typecheck_rule(cls: type, collective: bool) -> Any:
    """A ``typecheck_forward`` for one of flexdispatch's autograd Functions (spmd_types):
    the SPMD type of the rows it moves (its first typed tensor argument) is checked and given to
    every tensor it returns; a collective (dispatch, combine) makes every axis varying, as the
    rows a rank receives differ from rank to rank. The Function itself runs unchecked (the
    checker's mode is off inside ``typecheck_forward``)."""
    import spmd_types as spmd

    def typecheck_forward(*args: Any) -> Any:
        typed = [a for a in args if isinstance(a, torch.Tensor) and spmd.has_local_type(a)]
        if not typed:
            raise spmd.SpmdTypeError(
                f"{cls.__name__}.apply: flexdispatch needs the SPMD type of the rows it moves; "
                f"annotate them with spmd_types.assert_type"
            )
        rows_type = spmd.get_local_type(typed[0])
        if collective:
            if any(t is spmd.P for t in rows_type.values()):
                raise spmd.SpmdTypeError(
                    f"{cls.__name__}.apply: partial (P) rows cannot be dispatched or combined: "
                    f"reduce them first (types {rows_type})"
                )
            rows_type = {axis: spmd.V for axis in rows_type}
        out = cls.apply(*args)
        for t in out if isinstance(out, tuple) else (out,):
            if isinstance(t, torch.Tensor):
                spmd.assert_type(t, rows_type)
        return out

    return staticmethod(typecheck_forward)


def _register_spmd_types() -> None:
    """Register the autograd Functions a ``FlexTokenDispatcher`` runs with spmd_types, so that
    torchtitan's ``spmd_typechecking=True`` accepts them (otherwise: "autograd Function is not
    registered for SPMD type checking")."""
    import spmd_types as spmd

    from flexdispatch import dispatch_grad, permutation

    for cls, collective in (
        (dispatch_grad._Dispatch, True),
        (dispatch_grad._Combine, True),
        (permutation._PermuteRows, False),
        (permutation._UnpermuteRows, False),
    ):
        if "typecheck_forward" not in vars(cls):
            cls.typecheck_forward = _typecheck_rule(cls, collective)  # type: ignore[attr-defined]
            spmd.register_autograd_function(cls)


_register_spmd_types()


def update_flex_token_dispatcher_config(model_config: Any, job_config: Any) -> None:
    """See ``flexdispatch.integrations.torchtitan.update_flex_token_dispatcher_config``."""
    configs = [
        cfg for _, cfg, _, _ in model_config.traverse(FlexTokenDispatcher.Config, recurse=True)
    ]
    if not configs:
        return
    parallelism, training = job_config.parallelism, job_config.training
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
