"""Per-token byte strings, so output text can be decoded one token at a time.

`tokenizers` decodes ids by running a decoder chain over the token strings and
then reading the joined bytes as UTF-8. For the chains real checkpoints use,
every token contributes a fixed byte string wherever it stands, with two
exceptions at the very start of the output, which the detokenizer tracks as
stream state:
- Metaspace (prepend_scheme != never) drops every "▁" of the first token;
- Strip after Fuse (Llama 2, Mistral v1) drops leading spaces of the whole text.
Supported: ByteLevel (GPT-2, Llama 3, Qwen2), Metaspace, and Sequences of
Replace(string) / ByteFallback / Fuse / Strip(start only) / Metaspace / ByteLevel.
Anything else returns None and the detokenizer falls back to windowed decoding.
"""
from __future__ import annotations

import json
import re
from typing import Any

_BYTE_FALLBACK_RE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    byte_to_char = {b: chr(b) for b in printable}
    num_shifted = 0
    for b in range(256):
        if b not in byte_to_char:
            byte_to_char[b] = chr(256 + num_shifted)
            num_shifted += 1
    return byte_to_char


BYTE_LEVEL_CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in _bytes_to_unicode().items()}
# str.translate table: byte-level chars -> the code point of their byte, so that
# latin-1 encoding yields the bytes; other chars below 256 -> U+FFFF, which latin-1
# cannot encode, so they (like chars above 255) fail the encode: "not a byte token".
_BYTE_LEVEL_TRANSLATION = {ord(c): b for c, b in BYTE_LEVEL_CHAR_TO_BYTE.items()}
_BYTE_LEVEL_TRANSLATION.update({b: 0xFFFF for b in range(256) if b not in _BYTE_LEVEL_TRANSLATION})


class UnsupportedDecoder(ValueError):
    pass


class _DecoderPlan:
    """What the decoder chain does to one token string, in order."""

    __slots__ = ("replacements", "metaspace_index", "byte_mode", "leading_strip")

    def __init__(self) -> None:
        # (old, new) str.replace steps; Metaspace adds ("▁", " ")
        self.replacements: list[tuple[str, str]] = []
        # index in `replacements` whose `new` becomes "" for the first token
        self.metaspace_index: int | None = None
        self.byte_mode = "utf8"  # "utf8" | "byte_level" | "byte_fallback"
        # (byte, max count) stripped from the start of the whole output
        self.leading_strip: tuple[int, int] | None = None


def _plan_decoder(spec: dict[str, Any] | None) -> _DecoderPlan:
    if spec is None:
        raise UnsupportedDecoder("no decoder (tokens are joined with spaces)")
    steps = spec["decoders"] if spec.get("type") == "Sequence" else [spec]
    plan = _DecoderPlan()
    is_fused = False
    for step in steps:
        kind = step.get("type")
        if kind == "Fuse":
            is_fused = True
            continue
        if kind == "Strip":
            content, start, stop = step.get("content", " "), step.get("start", 0), step.get("stop", 0)
            # NOTE: before Fuse, Strip acts on each token; we only model the fused case.
            if not is_fused or stop or len(content.encode()) != 1 or plan.leading_strip:
                raise UnsupportedDecoder(f"Strip {step}")
            plan.leading_strip = (content.encode()[0], start)
            continue
        if is_fused or plan.byte_mode != "utf8":
            # after Fuse or a byte stage, steps see joined or re-decoded text
            raise UnsupportedDecoder(f"{kind} after Fuse/bytes")
        if kind == "Replace":
            pattern = step.get("pattern", {})
            if "String" not in pattern:
                raise UnsupportedDecoder("Replace with a regex")
            plan.replacements.append((pattern["String"], step.get("content", "")))
        elif kind == "Metaspace":
            replacement = step.get("replacement", "▁")
            scheme = step.get("prepend_scheme")
            if scheme is None:  # older files: add_prefix_space
                scheme = "always" if step.get("add_prefix_space", True) else "never"
            if scheme != "never":
                if plan.metaspace_index is not None:
                    raise UnsupportedDecoder("two Metaspace steps")
                plan.metaspace_index = len(plan.replacements)
            plan.replacements.append((replacement, " "))
        elif kind == "ByteFallback":
            plan.byte_mode = "byte_fallback"
        elif kind == "ByteLevel":
            plan.byte_mode = "byte_level"
        else:
            raise UnsupportedDecoder(f"decoder {kind}")
    return plan


class TokenByteTable:
    """Bytes of each token id, built once per tokenizer (a pass over the whole vocabulary).

    NOTE: ids with no token (out of range, holes) and, when skipping, special
    tokens decode to nothing; `skipped_ids` tells them apart from empty tokens,
    which matters only for "the first token" at the start of the output.
    """

    __slots__ = (
        "piece_bytes", "piece_bytes_no_special", "special_ids", "missing_ids",
        "leading_strip", "has_first_token_rule", "_plan", "_backend",
    )

    def __init__(self, backend: Any, plan: _DecoderPlan, num_ids: int) -> None:
        self._plan = plan
        self._backend = backend
        special_contents = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        self.piece_bytes: list[bytes] = []
        self.special_ids: set[int] = set()
        self.missing_ids: set[int] = set()
        for token_id in range(num_ids):
            token = backend.id_to_token(token_id)
            if token is None:
                self.missing_ids.add(token_id)
                self.piece_bytes.append(b"")
                continue
            if token in special_contents:
                self.special_ids.add(token_id)
            self.piece_bytes.append(self._token_to_bytes(token, is_first=False))
        self.piece_bytes_no_special = list(self.piece_bytes)
        for token_id in self.special_ids:
            self.piece_bytes_no_special[token_id] = b""
        self.leading_strip = plan.leading_strip
        self.has_first_token_rule = plan.metaspace_index is not None

    @classmethod
    def from_backend(cls, backend: Any, num_ids: int) -> "TokenByteTable | None":
        """None when the decoder chain is not one we can map to bytes."""
        decoder = backend.decoder
        try:
            plan = _plan_decoder(None if decoder is None else json.loads(decoder.__getstate__()))
        except UnsupportedDecoder:
            return None
        return cls(backend, plan, num_ids)

    def is_skipped(self, token_id: int, skip_special_tokens: bool) -> bool:
        """True when decode() leaves the token out entirely (not even counted)."""
        if token_id >= len(self.piece_bytes) or token_id in self.missing_ids:
            return True
        return skip_special_tokens and token_id in self.special_ids

    def first_token_bytes(self, token_id: int) -> bytes:
        """Bytes of `token_id` when it is the first token of the output."""
        if not self.has_first_token_rule:
            return self.piece_bytes[token_id]
        return self._token_to_bytes(self._backend.id_to_token(token_id), is_first=True)

    def _token_to_bytes(self, token: str, is_first: bool) -> bytes:
        plan = self._plan
        for index, (old, new) in enumerate(plan.replacements):
            if is_first and index == plan.metaspace_index:
                new = ""
            token = token.replace(old, new)
        if plan.byte_mode == "byte_level":
            try:
                return token.translate(_BYTE_LEVEL_TRANSLATION).encode("latin-1")
            except UnicodeEncodeError:  # like tokenizers: a token outside the table is kept as text
                return token.encode("utf-8")
        if plan.byte_mode == "byte_fallback" and len(token) == 6:
            match = _BYTE_FALLBACK_RE.fullmatch(token)
            if match:
                return bytes([int(match.group(1), 16)])
        return token.encode("utf-8")
