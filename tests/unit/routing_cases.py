"""Case generators of the routing property tests: logits of every kind and valid routing
configurations (hypothesis strategies). See ``test_routing_properties.py``.

Shape letters: T tokens · E experts · k top-k · G expert groups of X = E / G experts.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from tests.unit.routing_reference import RoutingOptions

# kinds of logits: rounded to halves or to {-1, 0, 1} (ties in nearly every row), with NaN and
# +-inf entries, random, constant rows, all zero (a zero-initialised router)
KINDS = ("halves", "nonfinite", "random", "coarse", "constant", "zero")
VARIANTS = ("softmax", "softmax_pre", "sigmoid", "sqrtsoftplus")
RULES = (None, "sum_topk", "max")  # no groups, Megatron's sum of the top, DeepSeek-V2's max
# every score variant with every group rule, each drawing the rest of its cases
MATRIX = pytest.mark.parametrize(("variant", "rule"), [(v, r) for v in VARIANTS for r in RULES])

# NaN/inf logits make numpy (under Triton's interpreter) warn; the results are checked
NUMPY_WARNINGS = pytest.mark.filterwarnings(
    "ignore:.*(invalid value|All-NaN|divide by zero):RuntimeWarning"
)

# the same cases on every run (a fixed CI budget: max_examples is set per test)
CI = settings(
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)


def make_logits(kind: str, T: int, E: int, seed: int) -> torch.Tensor:
    """``[T, E]`` fp32 logits of one kind (exact in bf16 except ``random``)."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(T, E, generator=g)
    if kind == "random":
        return r * 1.5
    if kind == "halves":
        return ((r * 2).round() / 2).clamp(-3, 3)
    if kind == "coarse":
        return r.round().clamp(-1, 1)
    if kind == "constant":
        return (r[:, :1] * 2).round().expand(T, E).contiguous()
    if kind == "zero":
        return torch.zeros(T, E)
    x = ((r * 2).round() / 2).clamp(-3, 3)
    u = torch.rand(T, E, generator=g)
    x[u < 0.08] = float("nan")
    x[(u >= 0.08) & (u < 0.16)] = float("inf")
    x[(u >= 0.16) & (u < 0.24)] = float("-inf")
    if T > 2:
        x[1] = float("-inf")  # a row without a finite logit
    return x


@st.composite
def routing_options(
    draw: st.DrawFn, E: int, variant: str, rule: str | None, *, max_k: int = 16
) -> RoutingOptions:
    """A valid routing configuration for E experts, score variant and group rule (None: no
    groups; also None where E has no valid grouping for the k drawn)."""
    fn = "softmax" if variant.startswith("softmax") else variant
    k = draw(st.integers(1, min(E, max_k)))
    groups = None
    if rule is not None:
        options = [
            (G, g)
            for G in range(2, E + 1)
            if E % G == 0
            for g in range(1, G + 1)
            if g * (E // G) >= k and (rule == "max" or k % g == 0)
        ]
        if options:
            G, g = draw(st.sampled_from(options))
            groups = (G, g, rule)
    bias = None
    if fn != "softmax":
        bias_kind = draw(st.sampled_from([None, "random", "zero", "grid"]))
        gb = torch.Generator().manual_seed(E)
        if bias_kind == "random":
            bias = torch.randn(E, generator=gb) * 0.1
        elif bias_kind == "zero":
            bias = torch.zeros(E)  # as a freshly built aux-loss-free router holds it: ties stay
        elif bias_kind == "grid":
            bias = torch.randint(-2, 3, (E,), generator=gb).float() / 8
    capacity = draw(
        st.one_of(
            st.none(),
            st.tuples(st.sampled_from([0.5, 1.0, 1.5]), st.sampled_from(["probs", "position"])),
        )
    )
    return RoutingOptions(
        topk=k,
        score_function=fn,
        use_pre_softmax=variant == "softmax_pre",
        groups=groups,
        normalize_topk=draw(st.sampled_from([None, True, False])),
        scaling_factor=draw(st.sampled_from([None, 2.5])),
        expert_bias=bias,
        capacity=capacity,
    )
