"""pytest plugin: run Megatron-LM's own dispatcher unit tests (tag core_v0.19.0) on CPU over gloo,
through flexdispatch's Megatron plug-in (run.sh beside this file; never run by CI).

Env:
  MLM_VIA=flex       install flexdispatch.integrations.megatron (TestFlexDispatcher "deepep" cases)
  MLM_VIA=a2a-flex   also route the alltoall tests' dispatcher to the plug-in's flex dispatcher
  MLM_VIA=none       Megatron's own dispatchers (baseline)
  MLM_BREAK=1        the plug-in's combine returns half its sum (negative control)
  MLM_DROP_TE=1      also run the tests marked "TE 1.7.0 is required for MoE with FP8"
"""

import contextlib
import os

import torch
import torch.distributed as dist


class _HostStream:
    def wait_stream(self, other):
        pass

    def record_event(self):
        return self

    def synchronize(self):
        pass


_STREAM = _HostStream()
CALLS = {"dispatch": 0}


def pytest_configure(config):
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    # CUDA calls of the tests and of Megatron, on a CPU
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    torch.cuda.memory.empty_cache = lambda *a, **k: None
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.current_stream = lambda *a, **k: _STREAM
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    from megatron.core.transformer.moe import token_dispatcher as td

    td.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _STREAM
    moved = td.maybe_move_tensor_to_cpu

    def to_host(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return moved(tensor, as_numpy=as_numpy, record_stream=record_stream)

    td.maybe_move_tensor_to_cpu = to_host

    via = os.environ.get("MLM_VIA", "flex")
    if via in ("flex", "a2a-flex"):
        import flexdispatch.integrations.megatron as fd_megatron
        from flexdispatch import DispatchConfig
        from flexdispatch.integrations import _megatron

        fd_megatron.install(DispatchConfig(backend="torch"))
        right_dispatch = _megatron.FlexdispatchManager.dispatch

        def counted(self, *a, **k):
            CALLS["dispatch"] += 1
            return right_dispatch(self, *a, **k)

        _megatron.FlexdispatchManager.dispatch = counted
        if os.environ.get("MLM_BREAK") == "1":
            right_combine = _megatron.FlexdispatchManager.combine
            _megatron.FlexdispatchManager.combine = lambda self, h, *a, **k: (
                0.5 * right_combine(self, h, *a, **k)
            )
        if via == "a2a-flex":
            from megatron.core.transformer.moe import moe_layer

            def a2a_via_flex(num_local_experts, local_expert_indices, config, pg_collection=None):
                config.moe_flex_dispatcher_backend = "deepep"
                return moe_layer.MoEFlexTokenDispatcher(
                    num_local_experts, local_expert_indices, config, pg_collection
                )

            moe_layer.MoEAlltoAllTokenDispatcher = a2a_via_flex


def pytest_collection_modifyitems(config, items):
    drop = ("CUDA not available", "Deep EP and Hybrid EP")
    if os.environ.get("MLM_DROP_TE") == "1":
        drop += ("TE 1.7.0 is required",)
    for item in items:
        for node in item.listchain():
            node.own_markers[:] = [
                m
                for m in node.own_markers
                if not (
                    m.name == "skipif" and any(d in str(m.kwargs.get("reason", "")) for d in drop)
                )
            ]
        mod = item.module
        if hasattr(mod, "is_deep_ep_available"):
            mod.is_deep_ep_available = lambda: os.environ.get("MLM_VIA", "flex") != "none"
            mod.is_hybrid_ep_available = lambda: False
            mod.is_nccl_ep_available = lambda: False


def pytest_sessionfinish(session, exitstatus):
    print(
        f"\n[mlm_cpu_plugin] rank {os.environ.get('RANK')}: "
        f"FlexdispatchManager.dispatch calls = {CALLS['dispatch']}"
    )
