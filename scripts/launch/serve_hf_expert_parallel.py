"""Serve a prompt with a Hugging Face MoE checkpoint run expert-parallel (run under torchrun).

    torchrun --nproc-per-node 2 scripts/launch/serve_hf_expert_parallel.py /path/to/ckpt \\
        --prompt "The capital of France is" --max-new-tokens 8
    NPROC_PER_NODE=2 scripts/launch/serve_hf_expert_parallel.sh /path/to/ckpt --input-ids 1 2 3

(the first needs flexdispatch installed, ``pip install -e .``; the wrapper sets ``PYTHONPATH``
to the checkout).

Every rank loads the checkpoint from the local directory (``from_pretrained(path)``, float32:
flexdispatch routes in fp32), calls ``flexdispatch.integrations.hf.expert_parallel`` so that it
keeps only its slice of each MoE layer's experts (router, attention, embeddings and shared experts
stay whole), and runs greedy ``generate()`` on the same prompt; the tokens move between the ranks
through ``FlexDispatcher`` (gloo on CPUs, NCCL on GPUs: one rank per GPU, more ranks per node than
GPUs is refused, ``FLEXDISPATCH_DEVICE=cpu`` runs gloo on the CPU). Rank 0 prints which experts it
holds, the generated token ids, the text when the directory holds a tokenizer, and the
dispatcher's host syncs. ``--check`` also runs the unsharded model on rank 0 and exits 1 unless
it generates the same tokens.

The prompt is tokenised with the directory's tokenizer (``--prompt``), or given as token ids
(``--input-ids``, for checkpoints without one). Exactly ``--max-new-tokens`` tokens are generated
(``min_new_tokens`` too): every rank must run the same number of forward steps, since each step
is a collective. ``--worst-case`` uses the static-shape dispatch (no host sync per step;
``num_worst_tokens`` = world size × prompt length, the prefill being the largest step).

Supported families are those of ``flexdispatch.integrations.hf.SUPPORTED_BLOCKS`` (Mixtral,
Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, gpt-oss). Each rank holds the whole checkpoint while it loads,
then only its experts.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="serve_hf_expert_parallel", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("checkpoint", help="local directory written by save_pretrained")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text, tokenised with the checkpoint's tokenizer")
    src.add_argument("--input-ids", type=int, nargs="+", metavar="ID", help="prompt token ids")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--worst-case", action="store_true", help="static-shape dispatch")
    p.add_argument("--check", action="store_true", help="compare with the unsharded model")
    p.add_argument("--timeout", type=float, default=300.0, help="process-group timeout, seconds")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    return args


def _load(path: str, device):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.to(device).eval()


def _generate(model, ids, new_tokens: int):
    import torch

    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0 if model.generation_config.pad_token_id is None else None,
        )


def _report(args, world, blocks, ids, out, tokenizer, device) -> int:
    """Rank 0's printout (and ``--check``); the exit status."""
    import torch

    held = list(blocks[0].layer.experts.global_expert_ids)
    E = blocks[0].layer.config.router.num_experts
    print(
        f"{len(blocks)} MoE block(s) expert-parallel, rank 0 holds experts "
        f"[{held[0]}, {held[-1] + 1}) of {E} in each"
    )
    new = out[0, ids.shape[1] :].tolist()
    print(f"expert-parallel on {world} rank(s): generated token ids {new}")
    syncs = sum(b.layer.dispatcher.stats.host_syncs for b in blocks)
    print(f"dispatch host syncs on rank 0: {syncs}")
    if tokenizer is not None:
        print(f"text: {tokenizer.decode(out[0], skip_special_tokens=True)!r}")
    if not args.check:
        return 0
    want = _generate(_load(args.checkpoint, device or "cpu"), ids, args.max_new_tokens)
    same = torch.equal(out.cpu(), want.cpu())
    print(
        "unsharded model: same tokens"
        if same
        else f"unsharded model: DIFFERENT tokens {want[0, ids.shape[1] :].tolist()}"
    )
    return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if "RANK" not in os.environ:
        print(
            "serve_hf_expert_parallel: run it under torchrun, e.g. "
            "torchrun --nproc-per-node 2 scripts/launch/serve_hf_expert_parallel.py CKPT ...",
            file=sys.stderr,
        )
        return 2
    import torch
    import torch.distributed as dist

    from flexdispatch.config import DispatchConfig
    from flexdispatch.integrations.hf import EPSparseMoeBlock, expert_parallel
    from flexdispatch.launch.devices import plan_devices

    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    try:  # NOTE: before the process group: more local ranks than GPUs is refused, not a hang
        plan = plan_devices(local, ranks_hint="--nproc-per-node {gpus}")
    except ValueError as exc:
        print(f"serve_hf_expert_parallel: {exc}", file=sys.stderr)
        return 2
    cuda = plan.uses_gpus
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout)
    )
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        tokenizer = None
        if args.prompt is not None:
            import transformers

            tokenizer = transformers.AutoTokenizer.from_pretrained(args.checkpoint)
            ids = tokenizer(args.prompt, return_tensors="pt").input_ids
        else:
            ids = torch.tensor([args.input_ids], dtype=torch.int64)
        ids = ids.to(device or "cpu")
        model = _load(args.checkpoint, device or "cpu")
        worst = world * ids.numel() if args.worst_case else 0
        expert_parallel(model, dispatch=DispatchConfig(num_worst_tokens=worst))
        blocks = [m for m in model.modules() if isinstance(m, EPSparseMoeBlock)]
        out = _generate(model, ids, args.max_new_tokens)
        code = _report(args, world, blocks, ids, out, tokenizer, device) if rank == 0 else 0
        # NOTE: every rank tears its group down together, after rank 0's report: a gloo peer
        # that closes its pairs while another still uses its group can abort that process
        dist.barrier()
        return code
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
