"""Train the default byte-level BPE tokenizer (run once; kept for reference).

The committed `tokenizer.json` next to this file is the source of truth: the text
on each machine differs, so retraining gives a different vocabulary. Rerunning
this script replaces the committed tokenizer, and with it every generated preset
checkpoint must be regenerated (bump the preset version in `replicas/checkpoints/presets.py`).

Corpus: the interpreter's own standard library sources (code plus their
docstrings and comments), found offline on every machine.

    python replicas/assets/train_tokenizer.py [--out replicas/assets/tokenizer.json]
"""
from __future__ import annotations

import argparse
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 8192  # including the special tokens
# NOTE: order fixes the ids (0..4); replicas/checkpoints/presets.py and the json configs rely on it.
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
MAX_CORPUS_BYTES = 24 * 2**20  # enough for an 8k vocab; keeps training under a minute
SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not SKIPPED_DIRS & set(p.relative_to(root).parts)]
    files += sorted(root.glob("*.txt"))  # LICENSE.txt: some English prose
    return sorted(files)


def iter_texts(files: list[Path], max_bytes: int) -> Iterator[str]:
    num_bytes = 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        num_bytes += len(text.encode("utf-8"))
        if num_bytes > max_bytes:
            return
        yield text


def build_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # NOTE: no normalizer, so decode(encode(text)) == text for any text.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train(out_path: Path) -> Tokenizer:
    tokenizer = build_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        # Every byte gets a token, so any UTF-8 text is representable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(iter_texts(stdlib_files(), MAX_CORPUS_BYTES), trainer=trainer)
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == token_id, token
    assert tokenizer.get_vocab_size() == VOCAB_SIZE, tokenizer.get_vocab_size()
    tokenizer.save(str(out_path))
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("tokenizer.json"))
    args = parser.parse_args()
    tokenizer = train(args.out)
    sample = "def main():\n    print('héllo 世界 🚀')\n"
    assert tokenizer.decode(tokenizer.encode(sample).ids) == sample
    print(f"wrote {args.out}: {tokenizer.get_vocab_size()} tokens, "
          f"sample -> {len(tokenizer.encode(sample).ids)} ids")


if __name__ == "__main__":
    main()
