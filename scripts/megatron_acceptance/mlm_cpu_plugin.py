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
import gc
import os
import re

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
    _destroy_groups_with_the_state()

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


_GROUP_NAME = re.compile(r"^_[A-Z0-9_]*GROUPS?(_[A-Z0-9]+)*$")


def _state_groups(module):
    """The process groups Megatron's model-parallel state holds in its module globals
    (``_TENSOR_MODEL_PARALLEL_GROUP``, ``..._GLOO``, lists of them), WORLD excluded, each once."""
    found, seen = [], set()

    def add(value):
        if isinstance(value, dist.ProcessGroup):
            if value is not dist.group.WORLD and id(value) not in seen:
                seen.add(id(value))
                found.append(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                add(v)
        elif isinstance(value, dict):
            for v in value.values():
                add(v)

    for name, value in vars(module).items():
        if _GROUP_NAME.match(name):
            add(value)
    return found


def _destroy_groups_with_the_state():
    """Megatron's tests re-create the model-parallel state for every test, and
    ``destroy_model_parallel`` drops its references without destroying most groups: each test
    left its gloo groups (and their threads) behind, ~900 threads per rank by the third step.
    Wrapped here (nothing in Megatron edited) to destroy every group the state held and collect
    them (measured with megatron-core 0.19.2 on one rank: 10 init / destroy cycles left 201
    groups and 609 threads; wrapped, 1 group and 12 threads)."""
    from megatron.core import parallel_state

    original = parallel_state.destroy_model_parallel

    def destroy_model_parallel(*args, **kwargs):
        groups = _state_groups(parallel_state)
        result = original(*args, **kwargs)
        for group in groups:
            with contextlib.suppress(Exception):  # NOTE: already destroyed by Megatron itself
                dist.destroy_process_group(group)
        del groups
        gc.collect()  # NOTE: the groups sit in reference cycles: their threads end when collected
        return result

    # NOTE: the tests' Utils.destroy_model_parallel calls it through the module attribute
    parallel_state.destroy_model_parallel = destroy_model_parallel


def _threads():
    with open("/proc/self/status") as f:
        return next((line.split()[1] for line in f if line.startswith("Threads:")), "?")


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
        f"FlexdispatchManager.dispatch calls = {CALLS['dispatch']}, threads = {_threads()}"
    )
