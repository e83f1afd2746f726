"""What every rank of ``flexdispatch demo`` and its single-process reference start from: the
demo's spec (picklable), the preset as the demo runs it, each mode's layer config, and every
rank's tokens, token ids and output gradients drawn from one seed (``demo.py`` runs them).

R ranks · L ranks per node · T tokens per rank · H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DemoSpec", "demo_config", "global_inputs", "global_token_ids"]

_MODES = ("flat", "hierarchical")
_VOCAB = 32000  # token ids for hash routing are drawn below this


@dataclass(frozen=True, kw_only=True)
class DemoSpec:
    """What every rank of the demo needs (picklable)."""

    preset: str
    backend: str
    tokens: int
    seed: int
    iters: int
    worst_case: bool
    # The sizes the demo runs (None: the preset's own), as flexdispatch.cli.demo_fit chose them.
    hidden_size: int | None = None
    ffn_hidden_size: int | None = None
    shared_expert_ffn_hidden_size: int | None = None


def demo_config(spec: DemoSpec):
    """The preset as the demo runs it (sizes as in ``spec``; see ``flexdispatch.cli.demo_fit``)."""
    from flexdispatch.config import MoEConfig, load_config

    cfg = load_config(spec.preset)
    sizes = {
        "hidden_size": spec.hidden_size,
        "ffn_hidden_size": spec.ffn_hidden_size,
        "shared_expert_ffn_hidden_size": spec.shared_expert_ffn_hidden_size,
    }
    sizes = {k: v for k, v in sizes.items() if v is not None}
    if not sizes:
        return cfg
    data = cfg.model_dump()
    data.update(sizes)
    if cfg.dispatch.hidden_size is not None and "hidden_size" in sizes:
        data["dispatch"]["hidden_size"] = sizes["hidden_size"]
    return MoEConfig.model_validate(data)


def _layer_config(spec: DemoSpec, mode: str, num_ranks: int, ranks_per_node: int):
    from flexdispatch.config import MoEConfig

    cfg = demo_config(spec)
    dispatch = {
        **cfg.dispatch.model_dump(),
        "backend": spec.backend,
        "hierarchical": mode == "hierarchical",
        "ranks_per_node": ranks_per_node,
        "num_worst_tokens": spec.tokens * num_ranks if spec.worst_case else 0,
    }
    # NOTE: validated (model_copy would not check the preset's fields against the demo's)
    return MoEConfig.model_validate({**cfg.model_dump(), "dispatch": dispatch})


def global_inputs(spec: DemoSpec, num_ranks: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's tokens and output gradients, ``[R, T, H]`` each, from one seed."""
    gen = torch.Generator().manual_seed(spec.seed + 12345)
    x = torch.randn(num_ranks, spec.tokens, hidden, generator=gen)
    g = torch.randn(num_ranks, spec.tokens, hidden, generator=gen)
    return x, g


def global_token_ids(spec: DemoSpec, num_ranks: int) -> torch.Tensor:
    """Every rank's token ids ``[R, T]`` int64 (hash routing routes by them), from one seed."""
    gen = torch.Generator().manual_seed(spec.seed + 54321)
    return torch.randint(0, _VOCAB, (num_ranks, spec.tokens), generator=gen)
