"""flexdispatch inside Megatron-Core with expert tensor parallelism (``expert_tensor_parallel_size
= 2``, ``expert_model_parallel_size = 1`` on 2 gloo ranks): the flex dispatcher sends every token to
both expert-TP ranks, each computes half of every expert's FFN, and the combine sums the halves.

The same comparison against Megatron's all-to-all dispatcher and the same dispatcher properties as
``tests/dist/test_megatron.py``, in a module of its own: Megatron's parallel state takes one
layout per process (it names some groups by their ranks), and the pooled ranks live per module.
"""

from __future__ import annotations

import pytest

from tests.dist import megatron_host as mh
from tests.dist.test_megatron import check_comparison, check_properties, run

pytestmark = pytest.mark.dist


def test_expert_tp_layer_equals_megatrons_alltoall_dispatcher() -> None:
    case = {"E": 4, "k": 2, "ep": 1, "etp": 2}
    check_comparison(case, run(mh.compare, case))


def test_expert_tp_dispatcher_properties_through_the_plugin() -> None:
    check_properties(run(mh.dispatcher_properties, {"ep": 1, "etp": 2}))
