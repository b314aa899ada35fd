"""Incremental detokenizing: new token ids in, only the new text out.

Mapped decoders (see deltas/tokenization/token_bytes.py): each token's bytes come
from a table and go through an incremental UTF-8 decoder, so a character split
across tokens stays pending until its last byte arrives: O(1) work per token,
never a re-decode. The concatenation of all push() outputs plus flush() equals
`tokenizer.decode(all_ids)` for any split of the ids into pushes.

NOTE: on invalid UTF-8 (a model emitting a broken byte sequence) we replace
each maximal invalid subsequence with one U+FFFD; tokenizers' ByteFallback
writes one per byte, so the count of U+FFFD may differ there, and only there.

Other decoders fall back to prefix/read offsets with `tokenizer.decode` on a
small window (as vLLM does): correct for the usual decoders, a bit slower.
"""
from __future__ import annotations

import codecs
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deltas.tokenization.tokenizer import Tokenizer


class IncrementalDetokenizer:
    __slots__ = ("_impl",)

    def __init__(self, tokenizer: "Tokenizer", skip_special_tokens: bool = True) -> None:
        table = tokenizer.byte_table
        if table is None:
            self._impl: _TableDetokenizer | _WindowDetokenizer = _WindowDetokenizer(tokenizer, skip_special_tokens)
        else:
            self._impl = _TableDetokenizer(table, skip_special_tokens)

    def push(self, token_ids: list[int]) -> str:
        """Text completed by `token_ids` (may be "" while a character is pending)."""
        return self._impl.push(token_ids)

    def flush(self) -> str:
        """At the finish: whatever is pending (U+FFFD if the stream ends mid-character)."""
        return self._impl.flush()

    def get_state(self) -> object:
        """An opaque snapshot, to replay a push token by token (see TextStream)."""
        return self._impl.get_state()

    def set_state(self, state: object) -> None:
        self._impl.set_state(state)


class _TableDetokenizer:
    __slots__ = ("_table", "_pieces", "_skip_special_tokens", "_utf8", "_is_first_pending", "_num_strip_left")

    def __init__(self, table, skip_special_tokens: bool) -> None:
        self._table = table
        self._pieces = table.piece_bytes_no_special if skip_special_tokens else table.piece_bytes
        self._skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._is_first_pending = table.has_first_token_rule
        self._num_strip_left = table.leading_strip[1] if table.leading_strip else 0

    def push(self, token_ids: list[int]) -> str:
        if self._is_first_pending or self._num_strip_left:
            return self._utf8.decode(self._start_bytes(token_ids))
        pieces = self._pieces
        try:
            data = b"".join([pieces[token_id] for token_id in token_ids])
        except IndexError:  # an id past the vocabulary (padded embeddings): decode skips it
            num_ids = len(pieces)
            data = b"".join([pieces[i] for i in token_ids if i < num_ids])
        return self._utf8.decode(data)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)

    def _start_bytes(self, token_ids: list[int]) -> bytes:
        """Token by token while the start-of-output rules are still pending."""
        table = self._table
        chunks: list[bytes] = []
        for token_id in token_ids:
            if table.is_skipped(token_id, self._skip_special_tokens):
                continue
            if self._is_first_pending:
                self._is_first_pending = False
                chunk = table.first_token_bytes(token_id)
            else:
                chunk = self._pieces[token_id]
            if self._num_strip_left:
                strip_byte = table.leading_strip[0]
                while self._num_strip_left and chunk[:1] == bytes([strip_byte]):
                    chunk = chunk[1:]
                    self._num_strip_left -= 1
                if chunk:  # the text has begun with something else: Strip is done
                    self._num_strip_left = 0
            chunks.append(chunk)
        return b"".join(chunks)

    def get_state(self) -> object:
        return (self._utf8.getstate(), self._is_first_pending, self._num_strip_left)

    def set_state(self, state: object) -> None:
        utf8_state, self._is_first_pending, self._num_strip_left = state
        self._utf8.setstate(utf8_state)


class _WindowDetokenizer:
    """Decode a short window: text of ids[prefix:] minus text of ids[prefix:read].

    Holds text back while it ends in U+FFFD (an incomplete character), but at
    most `MAX_HELD_TOKENS` tokens, so a broken byte stream cannot grow the window.
    """

    MAX_HELD_TOKENS = 8
    __slots__ = ("_tokenizer", "_skip_special_tokens", "_ids", "_prefix_offset", "_read_offset")

    def __init__(self, tokenizer: "Tokenizer", skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        return self._advance(is_final=False)

    def flush(self) -> str:
        return self._advance(is_final=True)

    def _advance(self, is_final: bool) -> str:
        decode, skip = self._tokenizer.decode, self._skip_special_tokens
        ids, prefix_offset = self._ids, self._prefix_offset
        prefix_text = decode(ids[prefix_offset:self._read_offset], skip_special_tokens=skip)
        new_read_offset = len(ids)
        new_text = decode(ids[prefix_offset:], skip_special_tokens=skip)
        if not is_final and new_text.endswith("\ufffd"):
            # An incomplete character: emit up to the last few tokens (a character
            # has at most 4 bytes) and hold those back; force it after too many.
            new_read_offset = self._read_offset
            for offset in range(len(ids) - 1, max(self._read_offset, len(ids) - 4) - 1, -1):
                text = decode(ids[prefix_offset:offset], skip_special_tokens=skip)
                if not text.endswith("\ufffd"):
                    new_read_offset, new_text = offset, text
                    break
            if new_read_offset == self._read_offset:
                if len(ids) - self._read_offset < self.MAX_HELD_TOKENS:
                    return ""
                new_read_offset = len(ids)
        self._prefix_offset, self._read_offset = self._read_offset, new_read_offset
        # NOTE: drop ids before the window, so memory stays bounded too.
        del ids[:self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0
        return new_text[len(prefix_text):]

    def get_state(self) -> object:
        return (list(self._ids), self._prefix_offset, self._read_offset)

    def set_state(self, state: object) -> None:
        ids, self._prefix_offset, self._read_offset = state
        self._ids = list(ids)
