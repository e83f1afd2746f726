"""``scripts/launch/serve_hf_expert_parallel.sh`` under a real ``torchrun`` (2 gloo ranks on
127.0.0.1): a tiny random-weight checkpoint written with ``save_pretrained`` is loaded from its
directory, run expert-parallel, and greedy ``generate()`` gives exactly the unsharded model's
tokens (computed here, in this process, from the same directory).

No downloads: the models are built from their config classes, the tokenizer from a word list.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers  # a pinned test dependency (pyproject.toml [test])

from flexdispatch.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
SERVE = ROOT / "scripts" / "launch" / "serve_hf_expert_parallel.sh"
VOCAB, NEW = 64, 5


def _save_model(family: str, path: Path) -> None:
    torch.manual_seed(5)
    common = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "num_experts_per_tok": 2,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    if family == "mixtral":
        cfg = transformers.MixtralConfig(num_local_experts=4, intermediate_size=48, **common)
        model = transformers.MixtralForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3MoeConfig(
            num_experts=4,
            moe_intermediate_size=24,
            intermediate_size=48,
            head_dim=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **common,
        )
        model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # decisive routers (the init's std=0.02 leaves near-ties)
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    model.save_pretrained(path)


def _save_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "<unk>", "<eos>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )
    fast.save_pretrained(path)


def _unsharded(path: Path, ids: list[int]) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
        )
    return out[0, len(ids) :].tolist()


def _serve(path: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "TORCHRUN"):
        env.pop(k, None)
    env.update(
        NPROC_PER_NODE="2",
        MASTER_PORT=str(free_port()),
        PYTHON=sys.executable,
        OMP_NUM_THREADS="1",
        FLEXDISPATCH_DEVICE="cpu",  # 2 gloo ranks on any machine, GPUs or not
    )
    return subprocess.run(
        ["bash", str(SERVE), str(path), "--max-new-tokens", str(NEW), *argv],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=ROOT,
        env=env,
        check=False,
    )


def _generated(stdout: str) -> list[int]:
    m = re.search(r"expert-parallel on 2 rank\(s\): generated token ids \[([0-9, ]*)\]", stdout)
    assert m, stdout
    return [int(t) for t in m.group(1).split(",")]


@pytest.mark.dist
@pytest.mark.timeout(200)
def test_mixtral_checkpoint_with_tokenizer_serves_the_unsharded_tokens(tmp_path: Path) -> None:
    _save_model("mixtral", tmp_path)
    _save_tokenizer(tmp_path)
    prompt = "w7 w3 w40 w12"
    ids = transformers.AutoTokenizer.from_pretrained(tmp_path)(prompt).input_ids
    assert ids == [10, 6, 43, 15]
    proc = _serve(tmp_path, "--prompt", prompt, "--check")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    want = _unsharded(tmp_path, ids)
    assert _generated(proc.stdout) == want and len(want) == NEW
    assert proc.stdout.count("generated token ids") == 1  # rank 0 prints, rank 1 does not
    assert "unsharded model: same tokens" in proc.stdout
    assert "2 MoE block(s) expert-parallel, rank 0 holds experts [0, 2) of 4" in proc.stdout
    assert "dispatch host syncs on rank 0: 0" not in proc.stdout  # dropless: one per dispatch
    assert f"text: '{prompt} " in proc.stdout  # decoded with the checkpoint's tokenizer


@pytest.mark.dist
@pytest.mark.timeout(200)
def test_qwen3_moe_checkpoint_input_ids_worst_case_serves_the_unsharded_tokens(
    tmp_path: Path,
) -> None:
    _save_model("qwen3_moe", tmp_path)  # no tokenizer in the directory: --input-ids
    ids = [5, 17, 33, 2, 60, 9]
    proc = _serve(tmp_path, "--input-ids", *map(str, ids), "--worst-case")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert _generated(proc.stdout) == _unsharded(tmp_path, ids)
    assert "text:" not in proc.stdout
    assert "2 MoE block(s) expert-parallel, rank 0 holds experts [0, 2) of 4" in proc.stdout
    assert "dispatch host syncs on rank 0: 0\n" in proc.stdout  # static shapes


def test_outside_a_launcher_it_says_how_to_run_it() -> None:
    proc = subprocess.run(
        [sys.executable, str(SERVE.with_suffix(".py")), "ckpt", "--input-ids", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "RANK"},
        check=False,
    )
    assert proc.returncode == 2 and "run it under torchrun" in proc.stderr
