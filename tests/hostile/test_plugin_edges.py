"""The plug-ins' edges that one process can check (reliability-5 S10, integrations-5 section 4):
torchtitan's ``FlexTokenDispatcher.Config`` checked when it is made, the job values
``update_flex_token_dispatcher_config`` reads, the save list of torchtitan's selective activation
checkpointing, and the Megatron plug-in's release check and ``uninstall``. The 2-rank edges
(compile, SAC recompute, the overflow on the ``-1`` path) are in tests/dist/test_torchtitan.py;
``moe_permute_fusion`` in tests/dist/test_megatron.py."""

from __future__ import annotations

import warnings

import pytest

pytestmark = pytest.mark.timeout(120)


def _cfg(**kw):
    from flexdispatch.integrations.torchtitan import FlexTokenDispatcher

    return FlexTokenDispatcher.Config(num_experts=8, top_k=2, **kw)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("backend", "nccl", "'auto', 'torch' or 'deepep'"),
        ("deepep_api", "v3", "'auto', 'v1', 'v2' or 'v25'"),
        ("ranks_per_node", 0, "greater than 0"),
    ],
)
def test_tt_config_values_are_checked_when_the_config_is_made(field, value, says):
    # NOTE: they were accepted until parallelize, then refused as a DispatchConfig's fields
    with pytest.raises(ValueError, match=rf"^FlexTokenDispatcher.Config {field}={value!r}: ") as e:
        _cfg(**{field: value})
    assert says in str(e.value), str(e.value)


def test_tt_config_takes_the_release_names_and_maps_the_old_ones():
    for api in ("auto", "v1", "v2", "v25"):
        assert _cfg(deepep_api=api).deepep_api == api
    with pytest.warns(DeprecationWarning, match="deepep_api='elastic' is now deepep_api='v2'"):
        _cfg(deepep_api="elastic")


@pytest.mark.parametrize("value", ["64", 1.5, True, None])
def test_tt_num_worst_tokens_must_be_an_int(value):
    # NOTE: "64" (what a JSON kwarg gives) raised "'<' not supported between str and int"
    with pytest.raises(TypeError, match=r"Config num_worst_tokens must be an int, got "):
        _cfg(num_worst_tokens=value)


@pytest.mark.parametrize("value", [0, -5])
def test_tt_num_max_tokens_per_rank_must_be_positive(value):
    # NOTE: 0 ran dropless silently (W = R x 0); -5 named a derived W the user never set
    with pytest.raises(ValueError, match=rf"num_max_tokens_per_rank must be None .* got {value}"):
        _cfg(num_worst_tokens=-1, num_max_tokens_per_rank=value)
    with pytest.raises(TypeError, match="num_max_tokens_per_rank must be an int"):
        _cfg(num_worst_tokens=-1, num_max_tokens_per_rank=2.5)


class _NS:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Model:
    def __init__(self, c):
        self.c, self.dim = c, 16

    def traverse(self, cls, recurse=True):
        return [("x", self.c, None, None)]


@pytest.mark.parametrize(
    ("tp", "cp", "lbs", "seq", "name"),
    [
        (0, 1, 1, 8, "parallelism.tensor_parallel_degree"),  # NOTE: was ZeroDivisionError
        (1, 0, 1, 8, "parallelism.context_parallel_degree"),
        (1, 1, -2, 8, "training.local_batch_size"),  # NOTE: was num_max_tokens_per_rank = -16
        (1, 1, 1, 0, "training.seq_len"),
        (1, 1, 1.5, 8, "training.local_batch_size"),
    ],
)
def test_tt_update_config_checks_the_job(tp, cp, lbs, seq, name):
    from flexdispatch.integrations.torchtitan import update_flex_token_dispatcher_config

    c = _cfg(num_worst_tokens=-1)
    job = _NS(
        parallelism=_NS(context_parallel_degree=cp, tensor_parallel_degree=tp),
        training=_NS(local_batch_size=lbs, seq_len=seq),
    )
    with pytest.raises(ValueError, match=rf"^{name} must be an int >= 1"):
        update_flex_token_dispatcher_config(_Model(c), job)
    assert c.num_max_tokens_per_rank is None


def test_tt_a_torchtitan_without_the_interface_is_named(monkeypatch):
    # NOTE: reliability-5's inconclusive "older torchtitan without config.override" row
    import sys

    import torchtitan.config

    import flexdispatch.integrations.torchtitan as fd_tt

    monkeypatch.delitem(sys.modules, "flexdispatch.integrations._torchtitan")
    monkeypatch.delattr(torchtitan.config, "override")
    monkeypatch.setitem(sys.modules, "torchtitan.config.override", None)
    with pytest.raises(ImportError, match=r"needs torchtitan's 0\.3\.0 interface .* is installed"):
        fd_tt.update_flex_token_dispatcher_config(None, None)


def test_tt_selective_ac_saves_flexdispatch_ops_by_default():
    import torch
    from torchtitan.distributed import activation_checkpoint as ac
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    import flexdispatch.integrations.torchtitan as fd_tt

    saved = SelectiveAC(SelectiveAC.Config()).get_save_ops()
    assert saved >= fd_tt.FLEXDISPATCH_SAVE_OPS
    assert {
        torch.ops.flexdispatch.dispatch.default,
        torch.ops.flexdispatch.combine.default,
    } == fd_tt.FLEXDISPATCH_SAVE_OPS
    assert torch.ops._c10d_functional.all_to_all_single.default in saved  # torchtitan's own kept
    patched = ac._get_default_save_ops
    fd_tt._impl()._save_flexdispatch_ops()  # NOTE: idempotent: not wrapped twice
    assert ac._get_default_save_ops is patched


def test_megatron_version_outside_the_checked_one_is_named(monkeypatch):
    import megatron.core

    import flexdispatch as fd
    import flexdispatch.integrations.megatron as meg

    monkeypatch.setattr(megatron.core, "__version__", "0.12.0", raising=False)
    try:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            meg.install(fd.DispatchConfig(backend="torch"))
        text = " ".join(str(w.message) for w in got)
        assert "megatron-core 0.12.0 is installed" in text, text  # NOTE: was silent
        assert f"checked on megatron-core {meg.MEGATRON_CORE_CHECKED}" in text, text
        monkeypatch.setattr(megatron.core, "__version__", "0.19.7", raising=False)
        with warnings.catch_warnings(record=True) as same:
            warnings.simplefilter("always")
            meg.install(fd.DispatchConfig(backend="torch"))
        assert not [w for w in same if "megatron-core" in str(w.message)]
    finally:
        meg.uninstall()


def test_megatron_interface_missing_is_named_with_both_releases(monkeypatch):
    import sys

    from megatron.core.transformer.moe import token_dispatcher

    import flexdispatch.integrations.megatron as meg

    monkeypatch.delattr(token_dispatcher, "_DispatchManager")
    monkeypatch.delitem(sys.modules, "flexdispatch.integrations._megatron", raising=False)
    with pytest.raises(ImportError, match=r"needs megatron-core 0\.19\.2's dispatcher interface"):
        meg.install()
    assert meg.installed_config() is None


def test_megatron_uninstall_leaves_a_later_rebinding_alone():
    from megatron.core.transformer.moe import moe_layer

    import flexdispatch as fd
    import flexdispatch.integrations.megatron as meg

    original = moe_layer.MoEFlexTokenDispatcher
    third = type("ThirdParty", (), {})
    try:
        meg.install(fd.DispatchConfig(backend="torch"))
        moe_layer.MoEFlexTokenDispatcher = third
        with pytest.warns(UserWarning, match="now ThirdParty, bound after install"):
            meg.uninstall()
        assert moe_layer.MoEFlexTokenDispatcher is third  # NOTE: Megatron's class was put back
        assert meg.installed_config() is None
    finally:
        moe_layer.MoEFlexTokenDispatcher = original
