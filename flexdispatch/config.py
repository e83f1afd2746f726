"""Configuration models (pydantic v2, ``extra="forbid"``) and YAML presets.

Every validation error names the field and says how to fix it.
"""

from __future__ import annotations

import math
import os
import warnings
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from flexdispatch._checks.config_text import read_config_file
from flexdispatch._checks.errors import InputError
from flexdispatch._checks.files import validation_message
from flexdispatch._checks.values import not_bool
from flexdispatch.backends.deepep import limits as deepep_limits

__all__ = [
    "RouterConfig",
    "DispatchConfig",
    "MoEConfig",
    "load_config",
    "list_presets",
    "preset_path",
]


_MAX = (1 << 31) - 1
"""Bound of every size field: rows, experts and hidden sizes are indexed with 32-bit integers by
DeepEP and the Triton kernels (memory is checked where the sizes are used:
flexdispatch._checks.fits)."""


_Int = Annotated[int, BeforeValidator(not_bool)]
"""An integer field: never a bool (pydantic's lax mode still takes "8" and 8.0)."""

_Float = Annotated[float, BeforeValidator(not_bool)]

DEEPEP_API_RENAMED = {"legacy": "v1", "elastic": "v2", "ep": "v25"}
"""``deepep_api`` values before 0.1 (DeepEP's own class names) -> the release names now."""


def deepep_release(value: str) -> str:
    """``DispatchConfig.deepep_api`` as a release name, also for a config that skipped validation
    (``model_copy(update=...)`` with a name before 0.1)."""
    return DEEPEP_API_RENAMED.get(value, value)


def _deepep_api(value: object) -> object:
    """An old ``deepep_api`` value as its release name (with a ``DeprecationWarning``)."""
    if isinstance(value, str) and value in DEEPEP_API_RENAMED:
        new = DEEPEP_API_RENAMED[value]
        warnings.warn(
            f"deepep_api={value!r} is now deepep_api={new!r}; the old value goes in the next "
            f"release",
            DeprecationWarning,
            2,
        )
        return new
    return value


"""A float field: never a bool; finite (``allow_inf_nan=False`` on every model)."""


class _Strict(BaseModel):
    # NOTE: allow_inf_nan=False: every float field is finite (an infinite loss coefficient or
    # capacity factor would turn the gradients into NaN or fail deep inside forward)
    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False
    )


class RouterConfig(_Strict):
    """How tokens pick experts (Megatron-Core semantics; see REFERENCE_FACTS.md)."""

    num_experts: _Int = Field(gt=0, le=_MAX, description="E, experts in total.")
    topk: _Int = Field(gt=0, le=32, description="k, experts per token (DeepEP allows at most 32).")
    score_function: Literal["softmax", "sigmoid", "sqrtsoftplus"] = "softmax"
    use_pre_softmax: bool = Field(
        False, description="softmax only: softmax over all E before top-k (else over the k)."
    )
    num_groups: _Int | None = Field(
        None,
        gt=0,
        le=_MAX,
        description="Group-limited routing: experts split into this many groups.",
    )
    group_topk: _Int | None = Field(None, gt=0, le=_MAX, description="Groups kept per token.")
    group_score: Literal["sum_topk", "max"] = Field(
        "sum_topk",
        description="Group rank: sum of the top k/group_topk scores (Megatron, DeepSeek-V3) or "
        "the max score (DeepSeek-V2).",
    )
    scaling_factor: _Float | None = Field(None, gt=0, description="probs *= scaling_factor.")
    normalize_topk: bool | None = Field(
        None,
        description="Renormalise the k selected probs to sum to 1. None keeps Megatron's rule "
        "(sigmoid/sqrtsoftplus: yes when k > 1; softmax pre: no; softmax post: sums to 1 anyway); "
        "HF configs map norm_topk_prob here.",
    )
    enable_expert_bias: bool = Field(
        False, description="Aux-loss-free balancing bias, used for selection only."
    )
    bias_update_rate: _Float = Field(1e-3, ge=0)
    capacity_factor: _Float | None = Field(None, gt=0)
    drop_policy: Literal["probs", "position"] = "probs"
    aux_loss_type: Literal["none", "aux_loss", "seq_aux_loss", "global_aux_loss"] = "none"
    aux_loss_coeff: _Float = Field(0.0, ge=0)
    z_loss_coeff: _Float = Field(0.0, ge=0)
    router_dtype: Literal["fp32", "fp64"] = "fp32"
    router_type: Literal["learned", "hash"] = Field(
        "learned",
        description="'hash' routes by a fixed hash of the token id (DeepSeek-V4's first layers).",
    )
    hash_seed: _Int = Field(
        0, ge=0, lt=1 << 64, description="Seed of the hash router's table (< 2**64)."
    )
    router_bias: bool = Field(
        False, description="The gating Linear(H, E) has a bias added to the logits (gpt-oss)."
    )
    impl: Literal["auto", "torch", "triton"] = Field(
        "auto",
        description="topk_routing's implementation: 'auto' = the fused Triton kernel on CUDA "
        "when triton imports (torch otherwise), 'torch', or 'triton' (CUDA; CPU only under "
        "TRITON_INTERPRET=1). See docs/kernels.md.",
    )

    @model_validator(mode="after")
    def _check(self) -> RouterConfig:
        E, k = self.num_experts, self.topk
        if k > E:
            raise ValueError(f"topk={k} exceeds num_experts={E}: set topk <= num_experts")
        if (self.num_groups is None) != (self.group_topk is None):
            raise ValueError(
                "num_groups and group_topk go together: set both (group-limited routing) or neither"
            )
        if self.num_groups is not None and self.group_topk is not None:
            G, g = self.num_groups, self.group_topk
            if E % G:
                raise ValueError(
                    f"num_experts={E} is not divisible by num_groups={G}: pick num_groups that "
                    f"divides num_experts"
                )
            if g > G:
                raise ValueError(
                    f"group_topk={g} exceeds num_groups={G}: set group_topk <= num_groups"
                )
            if k % g and self.group_score == "sum_topk":
                raise ValueError(
                    f"topk={k} is not divisible by group_topk={g}: the group score sums the top "
                    f"topk//group_topk scores of each group, so pick group_topk dividing topk"
                )
            if g * (E // G) < k:
                raise ValueError(
                    f"group_topk={g} groups of {E // G} experts hold fewer than topk={k} experts: "
                    f"raise group_topk or num_experts/num_groups"
                )
        if self.use_pre_softmax and self.score_function != "softmax":
            raise ValueError("use_pre_softmax applies to score_function='softmax' only: unset it")
        if self.enable_expert_bias and self.score_function == "softmax":
            raise ValueError(
                "enable_expert_bias needs score_function 'sigmoid' or 'sqrtsoftplus' (Megatron "
                "ignores the bias in the softmax branch)"
            )
        if self.aux_loss_type != "none" and self.aux_loss_coeff == 0.0:
            raise ValueError(
                f"aux_loss_type={self.aux_loss_type!r} with aux_loss_coeff=0: set a positive "
                f"aux_loss_coeff or aux_loss_type='none'"
            )
        if self.router_type == "hash" and (self.capacity_factor is not None):
            raise ValueError("router_type='hash' has no capacity dropping: unset capacity_factor")
        if self.impl == "triton" and self.router_dtype == "fp64" and self.router_type == "learned":
            raise ValueError(
                "impl='triton' routes float32/bfloat16/float16 logits, but router_dtype='fp64' "
                "gates in float64: set impl='torch' (or 'auto') or router_dtype='fp32'"
            )
        return self

    @property
    def num_experts_per_group(self) -> int | None:
        return None if self.num_groups is None else self.num_experts // self.num_groups

    def capacity(self, num_tokens: int) -> int | None:
        """Per-expert capacity ``ceil(T * k / E * capacity_factor)``, or None without dropping."""
        if self.capacity_factor is None:
            return None
        return math.ceil(num_tokens * self.topk / self.num_experts * self.capacity_factor)


class DispatchConfig(_Strict):
    """How rows move between ranks."""

    backend: Literal["auto", "torch", "deepep"] = "auto"
    num_worst_tokens: _Int = Field(
        0,
        ge=0,
        le=_MAX,
        description="W > 0: static-shape worst-case mode (W rows out, no host sync). "
        "Must be a multiple of the EP world size for the torch backend.",
    )
    hierarchical: bool = Field(
        False, description="Cross the node boundary once per destination node, forward inside."
    )
    ranks_per_node: _Int | None = Field(
        None,
        gt=0,
        le=_MAX,
        description="L, ranks per node; None takes LOCAL_WORLD_SIZE from the launcher, else R.",
    )
    checks: bool = Field(
        False,
        description="Run checks that need a host sync (ids, NaN); or FLEXDISPATCH_CHECKS=1.",
    )
    timeout_s: _Float = Field(300.0, gt=0, description="Process-group timeout used by the CLI.")
    mode: Literal["normal", "low_latency"] = Field(
        "normal",
        description="'low_latency': decode with DeepEP's low-latency kernels (expert-major "
        "[e, R*num_max, H], see flexdispatch.dispatch.decode); other backends decode in "
        "worst-case mode.",
    )
    num_max_dispatch_tokens_per_rank: _Int = Field(
        128,
        gt=0,
        le=_MAX,
        description="Decode: the most tokens a rank dispatches per call (DeepEP: at most 1024); "
        "deepep_api='v2' / 'v25' dropless: the first per-rank token bound (the buffer is "
        "sized for it; it grows, on every rank at once, to the largest T a rank dispatches).",
    )
    use_fp8: bool = Field(
        False, description="DeepEP low-latency dispatch casts rows to fp8 (per-128-channel scales)."
    )
    hidden_size: _Int | None = Field(
        None,
        gt=0,
        le=_MAX,
        description="H, when known: lets backend selection check DeepEP's hidden-size rules.",
    )
    cuda_graph: bool = Field(
        False,
        description="The dispatch will be captured in a CUDA graph: refused unless it can be "
        "(num_worst_tokens > 0 or mode='low_latency'; DeepEP V1 worst-case mode intranode only, "
        "V2 (deepep_api 'auto'/'v2', DeepEP 2.1.0+) across nodes too).",
    )
    deepep_async_finish: bool = Field(
        False,
        description="DeepEP: launch on its communication stream (inputs fenced by an event, "
        "outputs allocated there); the current stream waits on the GPU, never the host.",
    )
    deepep_num_sms: _Int | None = Field(
        None,
        gt=0,
        le=_MAX,
        description="SMs of DeepEP's kernels for this dispatcher (V1: even, in the Config of each "
        "call, never DeepEP's process-wide Buffer.set_num_sms).",
    )
    deepep_api: Annotated[Literal["auto", "v1", "v2", "v25"], BeforeValidator(_deepep_api)] = Field(
        "auto",
        description="DeepEP release: 'v1' (deep_ep.Buffer), 'v2' (deep_ep.ElasticBuffer, "
        "DeepEP 2.1.0+; a dropless per-rank token bound that starts at "
        "num_max_dispatch_tokens_per_rank and grows, worst-case at most W / R), 'v25' "
        "(DeepEP 2.5 deep_ep_v25.EPBuffer, same bounds) or 'auto' (V2.5, else V2, where every "
        "rank has it, in worst-case mode or with num_max_dispatch_tokens_per_rank set; else "
        "V1). The names before 0.1 ('legacy', 'elastic', 'ep') are read as these.",
    )
    deepep_hybrid: bool | None = Field(
        None,
        description="deepep_api='v25' across nodes: True = DeepEP 2.5 hybrid mode (one RDMA row "
        "per destination node, forwarded over NVLink), False = direct mode, None = hybrid where "
        "its limits hold.",
    )
    expert_alignment: _Int = Field(
        1,
        gt=0,
        le=_MAX,
        description="dispatch_expanded on DeepEP 2.5: each local expert's rows padded (with zero "
        "rows) to a multiple of this, e.g. for grouped GEMMs that need aligned segments.",
    )

    @model_validator(mode="after")
    def _check_modes(self) -> DispatchConfig:
        if self.deepep_num_sms is not None and self.deepep_num_sms % 2:
            raise ValueError(
                f"deepep_num_sms={self.deepep_num_sms} must be even (DeepEP runs one channel on "
                f"two SMs): use {self.deepep_num_sms + 1}"
            )
        if self.cuda_graph and self.mode == "normal" and self.num_worst_tokens == 0:
            raise ValueError(
                "cuda_graph=True with a dropless dispatch: the split sizes (DeepEP: the receive "
                "counts) are read on the host, which cannot be captured; set num_worst_tokens > 0 "
                "or mode='low_latency'"
            )
        if self.backend == "deepep" and self.mode == "low_latency":
            H, n = self.hidden_size, self.num_max_dispatch_tokens_per_rank
            if H is not None and H not in deepep_limits.LOW_LATENCY_HIDDEN_SIZES:
                sizes = ", ".join(map(str, deepep_limits.LOW_LATENCY_HIDDEN_SIZES))
                raise ValueError(
                    f"hidden_size={H} is not one of DeepEP's low-latency hidden sizes ({sizes}): "
                    f"pad the rows, or use backend='auto'/'torch' (worst-case decode)"
                )
            if n > deepep_limits.LOW_LATENCY_MAX_TOKENS_PER_RANK:
                raise ValueError(
                    f"num_max_dispatch_tokens_per_rank={n} exceeds DeepEP's low-latency limit "
                    f"{deepep_limits.LOW_LATENCY_MAX_TOKENS_PER_RANK}"
                )
        return self

    def check_world(self, num_ranks: int, ranks_per_node: int | None = None) -> None:
        """Raise ValueError when ``backend='deepep'`` cannot run on this world (R, L).

        Catches at set-up what would otherwise fail at the first dispatch or at graph capture:
        DeepEP's rank-count rules and its intranode-only worst-case (CUDA-graph) mode.

        Args:
            num_ranks: R.
            ranks_per_node: L as launched; None takes ``self.ranks_per_node``, then the
                launcher's ``LOCAL_WORLD_SIZE``, then R (the dispatcher's own order).
        """
        api = deepep_release(self.deepep_api)
        if self.backend != "deepep" or api == "v25":
            return  # NOTE: DeepEP 2.5 has rules of its own, applied at selection (v25_rules)
        L = deepep_limits.resolve_ranks_per_node(num_ranks, ranks_per_node, self.ranks_per_node)
        # NOTE: DeepEP's V2 path takes worst-case mode across nodes too; 'auto' runs V2
        # in worst-case mode where deep_ep has ElasticBuffer (backend selection raises otherwise)
        W = self.num_worst_tokens if api == "v1" else 0
        # NOTE: every node count some DeepEP release compiles (v1.2.1 and 2.1.0): the backend
        # applies the exact list of the installed release when it is built
        ok, why = deepep_limits.check_topology(
            num_ranks,
            L,
            num_worst_tokens=W,
            internode_node_counts=deepep_limits.ANY_RELEASE_INTERNODE_NODE_COUNTS,
            low_latency=self.mode == "low_latency",  # NOTE: any node count
        )
        if not ok:
            extra = " (cuda_graph=True needs it)" if self.cuda_graph else ""
            raise ValueError(f"backend='deepep' cannot run here{extra}: {why}")


class MoEConfig(_Strict):
    """One MoE layer: router + dispatch + grouped experts."""

    name: str = "custom"
    hidden_size: _Int = Field(gt=0, le=_MAX, description="H.")
    ffn_hidden_size: _Int = Field(gt=0, le=_MAX, description="F, hidden size of each expert's MLP.")
    activation: Literal["swiglu", "swiglu_oai", "gelu", "relu", "relu2", "silu"] = Field(
        "swiglu",
        description=(
            "Expert MLP: swiglu = silu(x w1) * (x w3); swiglu_oai = gpt-oss's clamped GLU "
            "(gate clamped above by swiglu_limit, up clamped to +-swiglu_limit, "
            "gate * sigmoid(swiglu_alpha * gate) * (up + 1)); relu2 = relu(x w1)^2 (non-gated)."
        ),
    )
    swiglu_limit: _Float | None = Field(
        None,
        gt=0,
        description=(
            "Clamp of a gated activation: swiglu clamps the gate above and the up projection to "
            "+-limit before the product; required by swiglu_oai."
        ),
    )
    swiglu_alpha: _Float | None = Field(
        None, gt=0, description="swiglu_oai's sigmoid slope (gpt-oss: 1.702); swiglu_oai only."
    )
    expert_mlp_bias: bool = Field(False, description="Expert projections carry biases (gpt-oss).")
    num_shared_experts: _Int = Field(
        0,
        ge=0,
        le=_MAX,
        description="Shared experts, computed locally on every rank beside the routed ones.",
    )
    shared_expert_ffn_hidden_size: _Int | None = Field(
        None,
        gt=0,
        le=_MAX,
        description="F of the shared expert MLP (all shared experts fused into one).",
    )
    shared_expert_gate: bool = Field(
        False,
        description="A sigmoid gate Linear(H, 1) scales the shared experts' output (Qwen2-MoE).",
    )
    probs_on_input: bool = Field(
        False,
        description=(
            "Multiply the routing weight into the expert's input instead of its output "
            "(Llama-4; top-1 only)."
        ),
    )
    impl: Literal["auto", "torch", "triton"] = Field(
        "auto",
        description="The layer's permute/unpermute implementation: 'auto' = Triton kernels on "
        "CUDA when triton imports (torch otherwise), 'torch', or 'triton'; the router's own is "
        "router.impl. See docs/kernels.md.",
    )
    router: RouterConfig
    dispatch: DispatchConfig = DispatchConfig()
    source: dict[str, str] = Field(
        default_factory=dict, description="Where the preset's numbers come from (model card, etc.)."
    )

    @model_validator(mode="after")
    def _check_mlp(self) -> MoEConfig:
        gated = self.activation in ("swiglu", "swiglu_oai")
        if self.swiglu_limit is not None and not gated:
            raise ValueError(
                f"swiglu_limit={self.swiglu_limit} applies to a gated activation, "
                f"not activation={self.activation!r}: drop it or use swiglu/swiglu_oai"
            )
        if self.activation == "swiglu_oai" and self.swiglu_limit is None:
            raise ValueError("activation='swiglu_oai' needs swiglu_limit (gpt-oss: 7.0)")
        if self.swiglu_alpha is not None and self.activation != "swiglu_oai":
            raise ValueError(
                f"swiglu_alpha={self.swiglu_alpha} belongs to activation='swiglu_oai', "
                f"not {self.activation!r}"
            )
        if self.num_shared_experts == 0 and (
            self.shared_expert_ffn_hidden_size is not None or self.shared_expert_gate
        ):
            raise ValueError(
                "shared_expert_ffn_hidden_size / shared_expert_gate are set but "
                "num_shared_experts=0: set num_shared_experts or drop them"
            )
        if self.probs_on_input and self.router.topk != 1:
            raise ValueError(
                f"probs_on_input=True weights the expert input and needs router.topk=1, "
                f"got topk={self.router.topk}"
            )
        return self

    @property
    def num_experts(self) -> int:
        return self.router.num_experts

    def check_world(
        self, num_ranks: int, ranks_per_node: int | None = None, *, check_dispatch: bool = True
    ) -> None:
        """Raise ValueError when this config cannot run on ``num_ranks`` EP ranks.

        ``check_dispatch=False`` leaves out ``DispatchConfig.check_world`` (DeepEP's topology
        rules): for a caller whose dispatcher is built already and has checked them against the
        ``deep_ep`` module it runs (``MoELayer``)."""
        E = self.router.num_experts
        if num_ranks <= 0:
            raise ValueError(f"num_ranks must be positive, got {num_ranks}")
        if E % num_ranks:
            raise ValueError(
                f"router.num_experts={E} is not divisible by the expert-parallel world size "
                f"{num_ranks}: experts are sharded contiguously, pick a world size dividing {E}"
            )
        W = self.dispatch.num_worst_tokens
        if W and W % num_ranks:
            raise ValueError(
                f"dispatch.num_worst_tokens={W} is not a multiple of the world size {num_ranks}: "
                f"round it up to {math.ceil(W / num_ranks) * num_ranks}"
            )
        if ranks_per_node is not None and num_ranks % ranks_per_node:
            raise ValueError(
                f"world size {num_ranks} is not a multiple of ranks_per_node={ranks_per_node}"
            )
        if check_dispatch:
            self.dispatch.check_world(num_ranks, ranks_per_node)


def _presets_dir() -> Path:
    # Presets ship inside the package (flexdispatch/presets is a copy-free link to configs/ in a
    # source checkout; in a wheel it is package data).
    return Path(str(resources.files("flexdispatch") / "presets"))


def list_presets() -> list[str]:
    """Names of the YAML presets shipped with the package."""
    return sorted(p.stem for p in _presets_dir().glob("*.yaml"))


def preset_path(name: str) -> Path:
    """Path of preset ``name`` (without ``.yaml``)."""
    path = _presets_dir() / f"{name}.yaml"
    if not path.is_file():
        raise InputError(
            f"unknown preset {name!r}: choose one of {', '.join(list_presets())}",
            problem="unknown preset",
            fix="see flexdispatch presets, or pass a YAML file",
        )
    return path


def load_config(preset_name_or_path: str | Path) -> MoEConfig:
    """Load a ``MoEConfig`` from a preset name (see ``list_presets()``) or a YAML file path.

    A ``Path``, a name with a folder separator or a ``.yaml`` / ``.yml`` suffix is a file; a
    preset's name is the preset (a file or folder of that name in the working directory does
    not hide it: pass ``./name`` for the file); any other name is a file when one exists.

    Raises:
        ValueError: unknown preset, unreadable file, or a config that fails validation (the
            message names the offending fields).
    """
    text = str(preset_name_or_path)
    path = Path(text)
    # NOTE: a name with a folder in it (/dev/zero, ./x) or a YAML suffix is a path, whatever is
    # there (read_config_file names what it is); a preset's name is the preset, even where a
    # file or folder of that name sits in the working directory (`tiny_cpu/`); any other name
    # is a file when one has that name, else an unknown preset
    separators = {"/", os.sep, *([os.altsep] if os.altsep else [])}
    is_path = (
        isinstance(preset_name_or_path, Path)
        or path.suffix in (".yaml", ".yml")
        or any(sep in text for sep in separators)
        or (text not in list_presets() and os.path.lexists(path))
    )
    if not is_path:
        path = preset_path(text)
    data = read_config_file(path, kind="yaml", what="config file")
    if not isinstance(data, dict):
        raise InputError(
            f"config file {path} must hold a mapping, got {type(data).__name__}",
            problem=f"holds a {type(data).__name__}, not a mapping of config fields",
        )
    try:
        return MoEConfig.model_validate(data)
    except ValidationError as exc:
        raise invalid_config(exc, f"config file {path} is invalid", data) from None


def invalid_config(exc: ValidationError, what: str, data: object = None) -> InputError:
    """A config that fails validation: ``WHAT: N validation errors: ...`` (``validation_message``:
    the first five, values cut short, unknown keys not quoted); the short problem names the first
    error and how many more there are. ``data``: the validated mapping (the place of an unknown
    key)."""
    known = _field_names()
    return InputError(
        f"{what}: {validation_message(exc, data=data, known=known)}",
        problem=validation_message(exc, 1, data=data, known=known),
    )


def _field_names() -> set[str]:
    """Every field name of ``MoEConfig``, ``RouterConfig`` and ``DispatchConfig`` (what an error
    may quote of a config file's keys; ``flexdispatch._checks.files.key_text``)."""
    return {n for m in (MoEConfig, RouterConfig, DispatchConfig) for n in m.model_fields}
