"""The assets torchtitan's trainer reads, made here without a network (run.sh calls it).

- ``WORK/assets/tokenizer``: a byte-level BPE tokenizer (``tokenizer.json`` and
  ``tokenizer_config.json``, BOS/EOS tokens) trained with ``tokenizers`` (installed with
  transformers) on the Python standard library's sources, with at most the qwen3 debug model's
  vocabulary (2048);
- ``WORK/tests/assets/c4_test/data.json``: 1,614 ``{"text": ...}`` records (JSON lines) cut from
  the same sources, in the place torchtitan's ``c4_test`` data set is read from (relative to the
  working folder: the trainer runs with ``cwd=WORK``).

Deterministic: the files are taken in sorted order and cut the same way every time.

    python make_assets.py WORK [--vocab 2048] [--records 1614]
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def _sources(limit_chars: int) -> list[str]:
    """Texts of the standard library's ``.py`` files, sorted by path, up to ``limit_chars``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        total += len(text)
        if total >= limit_chars:
            break
    return texts


def make_tokenizer(out: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_sources(4_000_000), trainer=trainer)
    if tok.get_vocab_size() > vocab:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} tokens, more than {vocab}")
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 1 << 20,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def make_data(out: Path, records: int, chars: int = 2000) -> None:
    text = "\n".join(_sources(records * chars + chars))
    rows = [text[i * chars : (i + 1) * chars] for i in range(records)]
    if len(rows[-1]) < chars:
        raise SystemExit(f"the standard library holds fewer than {records} records of {chars}")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "data.json", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({"text": row}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--records", type=int, default=1614)
    args = ap.parse_args()
    make_tokenizer(args.work / "assets" / "tokenizer", args.vocab)
    make_data(args.work / "tests" / "assets" / "c4_test", args.records)
    print(f"assets in {args.work}")


if __name__ == "__main__":
    main()
