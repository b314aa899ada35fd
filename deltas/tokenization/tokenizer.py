"""A light tokenizer over the `tokenizers` library, loaded from an HF directory.

No transformers import: the Ray ingress loads this, and must stay light.
Reads tokenizer.json, tokenizer_config.json (chat template, bos/eos tokens,
add_bos_token), chat_template.jinja if present, and generation_config.json
(eos_token_id, int or list) if present.

NOTE: a rendered chat already holds its special tokens: encode it with
`add_special_tokens=False` (as transformers' apply_chat_template does). Encode a
chat with `encode_chat`: special-token text inside its messages stays text there.
"""
from __future__ import annotations

import json
import re
import secrets
from pathlib import Path
from typing import Any

import jinja2
import tokenizers

from deltas.tokenization.chat_template import mask_special_text, render_chat_template, unmask_special_text
from deltas.tokenization.token_bytes import TokenByteTable

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


def _read_chat_templates(directory: Path, config: dict[str, Any]) -> dict[str, str]:
    """Named templates; the unnamed one is "default". The .jinja file wins, as in transformers."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return {"default": jinja_file.read_text(encoding="utf-8")}
    template = _read_json(directory / "chat_template.json").get("chat_template")
    if template is None:
        template = config.get("chat_template")
    if template is None:
        return {}
    if isinstance(template, str):
        return {"default": template}
    return {entry["name"]: entry["template"] for entry in template}


# Above this many characters, encoding releases the GIL (see Tokenizer.encode).
_RELEASE_GIL_CHARS = 4096
# A non-special added token of the plain-text backend only: see Tokenizer._encode_split_chat.
_ANCHOR = "\ue002stepstream-anchor\ue003"


def _special_text_pattern(special_texts: set[str]) -> re.Pattern[str] | None:
    """Longest first, so that a match is the one the tokenizer's added vocabulary makes."""
    if not special_texts:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(special_texts, key=len, reverse=True)))


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_templates: dict[str, str] | None = None,
        special_tokens: dict[str, str | None] | None = None,
        add_bos_token: bool | None = None,
        generation_eos_token_ids: list[int] | None = None,
    ) -> None:
        self.backend = backend
        self.chat_templates = dict(chat_templates or {})
        self.special_tokens = {key: None for key in _SPECIAL_TOKEN_KEYS} | dict(special_tokens or {})
        self.bos_token_id = self._id_or_none(self.special_tokens["bos_token"])
        self.eos_token_ids = self._collect_eos_ids(generation_eos_token_ids or [])
        added = backend.get_added_tokens_decoder()
        # NOTE: added tokens may sit past a gap in the ids; the model's ids are dense.
        self.vocab_size = max(backend.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)
        self.all_special_ids = {i for i, token in added.items() if token.special}
        # Ids the backend makes of special-token text (control tokens), and that text.
        self._added_special_ids = frozenset(self.all_special_ids)
        self._special_text = _special_text_pattern({added[i].content for i in self._added_special_ids})
        self._plain_backend: tokenizers.Tokenizer | None = None  # built on first use
        self.all_special_ids.update(i for i in [self.bos_token_id, *self.eos_token_ids] if i is not None)
        self._prepend_bos, self._strip_bos = self._bos_policy(add_bos_token)
        self._byte_table: TokenByteTable | None = None
        self._has_byte_table = True  # until built and found unsupported

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {directory}")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config = _read_json(directory / "tokenizer_config.json")
        eos_ids = _read_json(directory / "generation_config.json").get("eos_token_id")
        if isinstance(eos_ids, int):
            eos_ids = [eos_ids]
        return cls(
            backend,
            chat_templates=_read_chat_templates(directory, config),
            special_tokens={key: _token_content(config.get(key)) for key in _SPECIAL_TOKEN_KEYS},
            add_bos_token=config.get("add_bos_token"),
            generation_eos_token_ids=list(eos_ids or []),
        )

    # -- encode / decode -------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """NOTE: a long text goes through `encode_batch`, which releases the GIL while
        it works (`encode` holds it for the whole text, during which a caller's other
        threads, an event loop among them, cannot run)."""
        if len(text) > _RELEASE_GIL_CHARS:
            ids = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            if self._prepend_bos and ids[:1] != [self.bos_token_id]:
                ids.insert(0, self.bos_token_id)
            elif self._strip_bos and ids[:1] == [self.bos_token_id]:
                del ids[0]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        template_name: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` to a prompt string (not tokenized).

        Raises ValueError when there is no template or the template rejects the chat.
        """
        if not self.chat_templates:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json has no chat_template)")
        name = template_name or "default"
        if name not in self.chat_templates:
            raise ValueError(f"no chat template named {name!r}; have {sorted(self.chat_templates)}")
        try:
            return render_chat_template(
                self.chat_templates[name], messages, add_generation_prompt=add_generation_prompt,
                special_tokens=self.special_tokens, tools=tools, **template_kwargs,
            )
        except jinja2.TemplateError as error:  # raise_exception(...) in the template, or a broken one
            raise ValueError(f"chat template: {error}") from error

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        template_name: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """The prompt ids of a chat, where only the chat template's own text makes
        control tokens: special-token text inside messages or tools (a user's
        "<|im_end|><|im_start|>system") is tokenized as plain text, as transformers'
        `split_special_tokens=True` does, so that it cannot forge a turn.

        A chat without such text takes the plain path (render, then one encode) and
        gets exactly its ids: its contents are not tokenized apart from the template.
        """
        hidden: list[str] = []
        nonce = str(secrets.randbelow(10**12))
        if self._special_text is not None:
            messages = mask_special_text(messages, self._special_text, nonce, hidden)
            tools = mask_special_text(tools, self._special_text, nonce, hidden)
        text = self.apply_chat_template(messages, add_generation_prompt, template_name=template_name,
                                        tools=tools, **template_kwargs)
        if not hidden:
            return self.encode(text, add_special_tokens=False)
        return self._encode_split_chat(text, nonce, hidden)

    def _encode_split_chat(self, text: str, nonce: str, hidden: list[str]) -> list[int]:
        """`text` (a chat rendered with its special-token text masked) to ids: every
        control token left is the template's; the pieces between them, unmasked, are
        encoded with special tokens as plain text.

        NOTE: the backend splits its input at added tokens and encodes each piece on
        its own anyway; a piece after one is encoded behind `_ANCHOR` (an added token
        of the plain backend, dropped after) so that offset-dependent rules (Metaspace
        `prepend_scheme="first"`) treat it as today, and ids match the plain path
        everywhere but at the hidden text."""
        encoding = self.backend.encode_batch([text], add_special_tokens=False)[0]
        controls: list[int] = []
        pieces: list[str] = []
        start = 0
        for token_id, (begin, end) in zip(encoding.ids, encoding.offsets):
            if token_id in self._added_special_ids:
                controls.append(token_id)
                pieces.append(text[start:begin])
                start = end
        pieces.append(text[start:])
        plain, anchor_id = self._plain_text_backend()
        texts = [unmask_special_text(p, nonce, hidden) for p in pieces]
        encodings = plain.encode_batch([texts[0]] + [_ANCHOR + t for t in texts[1:]], add_special_tokens=False)
        ids = list(encodings[0].ids)
        for control, piece in zip(controls, encodings[1:]):
            assert piece.ids[0] == anchor_id
            ids.append(control)
            ids.extend(piece.ids[1:])
        return ids

    def _plain_text_backend(self) -> tuple[tokenizers.Tokenizer, int]:
        """A copy of the backend that encodes special-token text as text, with `_ANCHOR`
        added; its own, since `encode_special_tokens` is per backend and other threads
        encode with ours."""
        if self._plain_backend is None:
            plain = tokenizers.Tokenizer.from_str(self.backend.to_str())
            plain.encode_special_tokens = True
            plain.add_tokens([tokenizers.AddedToken(_ANCHOR, special=False, normalized=False)])
            self._plain_backend = plain
        return self._plain_backend, self._plain_backend.token_to_id(_ANCHOR)

    # -- incremental detokenizing support ----------------------------------

    @property
    def byte_table(self) -> TokenByteTable | None:
        """Per-token bytes, built on first use; None when the decoder is not mappable."""
        if self._byte_table is None and self._has_byte_table:
            self._byte_table = TokenByteTable.from_backend(self.backend, self.vocab_size)
            self._has_byte_table = self._byte_table is not None
        return self._byte_table

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes `token_id` adds to a decode (special tokens as their content).

        None when the decoder cannot be mapped to bytes or the id has no token.
        NOTE: at the very start of an output, SentencePiece decoders may drop a
        leading space; the detokenizer handles that, this lookup does not.
        """
        table = self.byte_table
        if table is None or table.is_skipped(token_id, skip_special_tokens=False):
            return None
        return table.piece_bytes[token_id]

    # -- helpers -----------------------------------------------------------

    def _id_or_none(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def _collect_eos_ids(self, generation_eos_ids: list[int]) -> list[int]:
        eos_ids: list[int] = []
        config_eos_id = self._id_or_none(self.special_tokens["eos_token"])
        for token_id in [config_eos_id, *generation_eos_ids]:
            if token_id is not None and token_id not in eos_ids:
                eos_ids.append(token_id)
        return eos_ids

    def _bos_policy(self, add_bos_token: bool | None) -> tuple[bool, bool]:
        """(prepend, strip): make BOS follow add_bos_token whatever the post-processor does."""
        if add_bos_token is None or self.bos_token_id is None:
            return False, False
        post_processor_adds_bos = self.backend.encode("a", add_special_tokens=True).ids[:1] == [self.bos_token_id]
        return add_bos_token and not post_processor_adds_bos, not add_bos_token and post_processor_adds_bos
