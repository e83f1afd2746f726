"""torchtitan 0.3.0's own trainer (``torchtitan.train.main``) on CPUs over gloo (run.sh starts it
under torchrun). No installed file is edited: five patches are applied here, in this process,
before the trainer starts:

1. the device: torchtitan picks ``"cuda"`` when it finds no accelerator
   (``torchtitan/tools/utils.py`` ``get_device_info``, run when it is imported), so torch's
   ``_get_available_device_type`` answers ``"cpu"`` before torchtitan is imported (gloo then
   comes from torch's default backend map);
2. ``torch.cpu`` gets what torchtitan's metrics and timeout code call on its device module:
   ``get_device_name``, ``get_device_properties`` (the machine's memory from ``/proc/meminfo``),
   ``memory_stats`` (``{}``), ``reset_peak_memory_stats`` / ``empty_cache`` (no-ops) and
   ``current_device`` returning 0 (``barrier(device_ids=[...])`` takes an int, not ``'cpu'``);
3. FlexAttention has no backward on CPUs: ``FlexAttention._compiled_flex_attn`` is replaced by
   the same block mask materialised (``create_mask``) and ``scaled_dot_product_attention`` (a
   dense kernel, the same mask), with the log-sum-exp computed where the caller asks for it;
4. gloo has no ``PREMUL_SUM`` / ``AVG``: FSDP2's ``_get_gradient_divide_factors`` is called with
   ``force_sum_reduction_for_comms=True`` (a SUM, then a division: its MTIA path);
5. torch 2.13 has no ``torch.distributed.set_timeout`` (torchtitan 0.3.0 calls it after the
   first step): ``distributed_c10d._set_pg_timeout`` stands in.

Every argument goes to torchtitan's own command line (run.sh passes the model, the steps, the
parallelism and, for flexdispatch, ``--override.imports``).
"""

from __future__ import annotations

import math
import sys

import torch
import torch._utils

# 1. before torchtitan is imported: it reads the device type at import
torch._utils._get_available_device_type = lambda: "cpu"


def _patch_torch_cpu() -> None:
    """2. ``torch.cpu`` as torchtitan's device module."""
    import collections

    def total_memory() -> int:
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemTotal:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 1 << 34

    props = collections.namedtuple("CpuProperties", "name total_memory")
    cpu = torch.cpu
    cpu.get_device_name = lambda *a, **k: "cpu"
    cpu.get_device_properties = lambda *a, **k: props("cpu", total_memory())
    cpu.memory_stats = lambda *a, **k: {}
    cpu.reset_peak_memory_stats = lambda *a, **k: None
    cpu.empty_cache = lambda *a, **k: None
    cpu.current_device = lambda: 0


def _dense_flex_attention(
    q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
    return_aux=None, kernel_options=None,
):  # fmt: skip
    """3. FlexAttention's call, as a dense ``scaled_dot_product_attention`` under the same mask."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    if score_mod is not None:
        raise NotImplementedError("tt_train_cpu.py: a score_mod is not supported on CPUs")
    del kernel_options
    L, S = q.shape[-2], k.shape[-2]
    mask = None
    if block_mask is not None:
        B, H = block_mask.kv_num_blocks.shape[:2]
        mask = create_mask(block_mask.mask_mod, B, H, L, S, device=q.device)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
    )
    lse = None
    if return_aux is not None and getattr(return_aux, "lse", False):
        kk = k
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            kk = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        s = (q.float() @ kk.float().transpose(-2, -1)) * (
            scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        )
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
    return out, AuxOutput(lse=lse, max_scores=None)


def _patch_fsdp_sum() -> None:
    """4. FSDP2's gradient reduction as SUM, then a division (gloo has no PREMUL_SUM)."""
    import inspect

    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fc

    factors = fc._get_gradient_divide_factors
    signature = inspect.signature(factors)

    def sum_then_divide(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["force_sum_reduction_for_comms"] = True
        return factors(*bound.args, **bound.kwargs)

    fc._get_gradient_divide_factors = sum_then_divide


def _patch_set_timeout() -> None:
    """5. ``torch.distributed.set_timeout`` where torch lacks it."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = distributed_c10d._set_pg_timeout


def _count_dispatches() -> None:
    """Count the dispatches flexdispatch ran in this rank (each ``FlexDispatcher._dispatch``: an
    all-to-all; a dispatch that selective activation checkpointing saved is not run again in the
    backward) and say, when the run ends, how many ran per step: 8 for the 8 MoE layers, 16 when
    every one is recomputed."""
    import atexit
    import os

    from flexdispatch.dispatch.dispatcher import FlexDispatcher

    calls = [0]
    dispatch = FlexDispatcher._dispatch

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return dispatch(self, *args, **kwargs)

    FlexDispatcher._dispatch = counted
    argv = sys.argv[1:]
    steps = int(argv[argv.index("--training.steps") + 1]) if "--training.steps" in argv else 0

    def report() -> None:
        if calls[0] and os.environ.get("RANK", "0") == "0":
            per = f" ({calls[0] / steps:g} per step)" if steps else ""
            print(f"flexdispatch dispatches on rank 0: {calls[0]}{per}", flush=True)

    atexit.register(report)


def main() -> None:
    _count_dispatches()
    _patch_torch_cpu()
    _patch_fsdp_sum()
    _patch_set_timeout()
    from torchtitan.models.common.attention import FlexAttention

    FlexAttention._compiled_flex_attn = _dense_flex_attention
    from torchtitan.train import main as train

    sys.argv[0] = "torchtitan.train"
    train()


if __name__ == "__main__":
    main()
