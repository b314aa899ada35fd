"""The tokenizer a GGUF file describes, written as Hugging Face tokenizer files
(tokenizer.json, tokenizer_config.json with the chat template), which
deltas/tokenization reads like any other checkpoint's.

Byte-level BPE only (`tokenizer.ggml.model == "gpt2"`: Llama 3, SmolLM, Qwen,
StarCoder vocabularies). The text is split before BPE the way the vocabulary was
trained, as `tokenizer.ggml.pre` names it; a name this table lacks is refused,
because a wrong split still tokenizes, into ids the model never saw.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from replicas.gguf.reader import GgufFile

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2_split() -> list:
    return [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]


def _digits_then_gpt2() -> list:
    # NOTE: every digit on its own first, then GPT-2's split (llama.cpp's "smollm")
    return [pre_tokenizers.Digits(individual_digits=True), *_gpt2_split()]


def _regex_split(pattern: str):
    return lambda: [pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]


# tokenizer.ggml.pre -> the pre-tokenizers of that vocabulary, in order
PRE_TOKENIZERS = {
    "default": _gpt2_split, "gpt2": _gpt2_split,
    "smollm": _digits_then_gpt2, "starcoder": _digits_then_gpt2, "refact": _digits_then_gpt2,
    "llama-bpe": _regex_split(_LLAMA3_SPLIT), "llama3": _regex_split(_LLAMA3_SPLIT),
    "qwen2": _regex_split(_QWEN2_SPLIT),
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the spelling of byte-level vocabularies)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def build_tokenizer(checkpoint: GgufFile) -> Tokenizer:
    meta = checkpoint.metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise checkpoint.fail(f"tokenizer model {kind!r} is not supported (stepstream reads "
                              f"byte-level BPE vocabularies, tokenizer.ggml.model 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise checkpoint.fail(f"pre-tokenizer {pre!r} is not supported (known: "
                              f"{', '.join(sorted(PRE_TOKENIZERS))})")
    tokens = checkpoint.array("tokenizer.ggml.tokens")
    merges = checkpoint.array("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise checkpoint.fail("the file has no tokenizer vocabulary or merges")
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())

    def spelling(token: str) -> str:
        # NOTE: a few files store a token's raw text instead of its byte spelling
        if set(token) <= spelled:
            return token
        return "".join(alphabet[b] for b in token.encode("utf-8"))

    vocab = {spelling(token): i for i, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(PRE_TOKENIZERS[pre]())
    tokenizer.decoder = decoders.ByteLevel()
    token_types = checkpoint.array("tokenizer.ggml.token_type") or []
    # NOTE: control tokens (<|im_start|>, ...) match whole and are special; a control
    # token spelled outside the byte alphabet is a mislabel and stays a plain token.
    tokenizer.add_special_tokens([
        AddedToken(token, normalized=False, special=True)
        for token, kind_id in zip(tokens, token_types)
        if kind_id == _CONTROL and set(token) <= spelled])
    tokenizer.add_tokens([
        AddedToken(token, normalized=False, special=False)
        for token, kind_id in zip(tokens, token_types) if kind_id == _USER_DEFINED])
    return tokenizer


def write_tokenizer_files(checkpoint: GgufFile, config: dict, out_dir: Path) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json into out_dir."""
    tokenizer = build_tokenizer(checkpoint)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    meta = checkpoint.metadata
    tokens = checkpoint.array("tokenizer.ggml.tokens")

    def token_at(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None and int(index) < len(tokens) else None

    tokenizer_config = {
        "bos_token": token_at("bos_token_id"),
        "eos_token": token_at("eos_token_id"),
        "unk_token": token_at("unknown_token_id"),
        "pad_token": token_at("padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": config["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        tokenizer_config["chat_template"] = template
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "generation_config.json", {
        key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
        if config.get(key) is not None})


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                    encoding="utf-8")
