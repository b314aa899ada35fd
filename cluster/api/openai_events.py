"""OpenAI response bodies and server-sent events, for completions and chat.

One formatter per request. The per-chunk path only splices the JSON-encoded text
(and logprobs) between a prefix and a suffix computed once per request, because
it runs for every event of every stream.

Event order of a stream: text chunks (the last one of each choice carries its
finish_reason; with n > 1 the choices' chunks interleave, each with its `index`), a
usage chunk when `stream_options.include_usage`, then `data: [DONE]`. With
`continuous_usage_stats` too, each text chunk carries its choice's usage so far (its
prompt's tokens, its output tokens), as vLLM's do. A stream that fails
after its headers went out ends with an error event and no [DONE]
(`cluster.errors.sse_error_event`).
"""
from __future__ import annotations

import json
from typing import Callable

DONE_EVENT = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# NOTE: ensure_ascii keeps every event valid UTF-8 whatever the text holds.
_dumps = json.JSONEncoder(separators=(",", ":")).encode


def sse_event(payload: str) -> bytes:
    return b"data: " + payload.encode() + b"\n\n"


def usage_dict(num_prompt_tokens: int, num_output_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens,
            "total_tokens": num_prompt_tokens + num_output_tokens}


class _Formatter:
    object_name = ""
    chunk_object_name = ""

    def __init__(self, response_id: str, model: str, created: int,
                 include_usage: bool = False) -> None:
        self.response_id = response_id
        self.model = model
        self.created = created
        self.include_usage = include_usage
        head = (f'{{"id":{_dumps(response_id)},"object":"{self.chunk_object_name}",'
                f'"created":{created},"model":{_dumps(model)},"choices":[{{"index":')
        self._chunk_head = head
        self._chunk_tail = ',"usage":null}' if include_usage else "}"

    def usage_event(self, num_prompt_tokens: int, num_output_tokens: int) -> bytes:
        return sse_event(_dumps({
            "id": self.response_id, "object": self.chunk_object_name,
            "created": self.created, "model": self.model, "choices": [],
            "usage": usage_dict(num_prompt_tokens, num_output_tokens)}))

    def response_of(self, choices: list[dict], num_prompt_tokens: int,
                    num_output_tokens: int) -> dict:
        """The body of a request with `choices` (from `choice`); usage counts each
        prompt once and the output tokens of every choice."""
        return {"id": self.response_id, "object": self.object_name, "created": self.created,
                "model": self.model, "choices": choices,
                "usage": usage_dict(num_prompt_tokens, num_output_tokens)}

    def _choice_event(self, index: int, content: str, finish_reason, logprobs,
                      stop_reason, usage: tuple[int, int] | None) -> bytes:
        """One chunk event: `content` is the choice's text or delta field; `usage`
        (prompt tokens, output tokens so far) for continuous usage."""
        fields = _choice_fields(content, finish_reason, logprobs, stop_reason)
        tail = self._chunk_tail if usage is None else f',"usage":{_dumps(usage_dict(*usage))}}}'
        return sse_event(f"{self._chunk_head}{index},{fields}}}]{tail}")


def _json(value) -> str:
    # NOTE: most chunks carry no logprobs and no finish: the encoder's general path
    # costs more for a None than formatting the rest of the chunk.
    return "null" if value is None else _dumps(value)


def _choice_fields(content: str, finish_reason, logprobs, stop_reason) -> str:
    fields = f'{content},"logprobs":{_json(logprobs)},"finish_reason":{_json(finish_reason)}'
    if finish_reason is not None:
        fields += f',"stop_reason":{_json(stop_reason)}'
    return fields


class CompletionFormatter(_Formatter):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def chunk_event(self, text: str, finish_reason: str | None = None,
                    logprobs: dict | None = None, stop_reason=None, index: int = 0,
                    usage: tuple[int, int] | None = None) -> bytes:
        return self._choice_event(index, f'"text":{_dumps(text)}', finish_reason, logprobs,
                                  stop_reason, usage)

    @staticmethod
    def choice(index: int, text: str, finish_reason: str | None, stop_reason,
               logprobs: dict | None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": finish_reason, "stop_reason": stop_reason}


class ChatFormatter(_Formatter):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._role_sent_to: set[int] = set()  # choice indices

    def chunk_event(self, text: str, finish_reason: str | None = None,
                    logprobs: dict | None = None, stop_reason=None, index: int = 0,
                    usage: tuple[int, int] | None = None) -> bytes:
        # NOTE: the role rides on each choice's first text chunk instead of an empty
        # chunk of its own, so the first event a client sees already carries a token.
        if index not in self._role_sent_to:
            self._role_sent_to.add(index)
            delta = f'{{"role":"assistant","content":{_dumps(text)}}}'
        elif text or finish_reason is None:
            delta = f'{{"content":{_dumps(text)}}}'
        else:
            delta = "{}"
        return self._choice_event(index, f'"delta":{delta}', finish_reason, logprobs,
                                  stop_reason, usage)

    def delta_event(self, index: int, delta: dict, finish_reason: str | None = None,
                    logprobs: dict | None = None, stop_reason=None,
                    usage: tuple[int, int] | None = None) -> bytes:
        """A chunk whose `delta` holds `delta`'s fields (content and/or tool_calls:
        cluster/api/tools/stream.py); the role rides on each choice's first."""
        if index not in self._role_sent_to:
            self._role_sent_to.add(index)
            delta = {"role": "assistant", "content": delta.get("content"), **delta}
        return self._choice_event(index, f'"delta":{_dumps(delta)}', finish_reason, logprobs,
                                  stop_reason, usage)

    @staticmethod
    def choice(index: int, text: str | None, finish_reason: str | None, stop_reason,
               logprobs: dict | None, tool_calls: list[dict] | None = None) -> dict:
        message = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"index": index, "message": message,
                "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}


TokenText = Callable[[int], str]


class TokenLabels:
    """How logprobs name a token: its text, and the bytes it adds to a decode.

    The bytes are not the text's encoding: a byte-level token may hold part of a
    UTF-8 character (an emoji is often two or three tokens), whose text alone
    decodes to U+FFFD. Chat's `bytes` field exists so that a client can join those
    parts back into the character, so it carries the token's own bytes;
    `token_bytes` returns None where the tokenizer's decoder cannot be mapped to
    bytes, and the text's encoding stands in.

    A token's text is the text its bytes spell where they are whole UTF-8
    characters, else `decode` of it alone (U+FFFD for part of a character).
    NOTE: a SentencePiece piece decoded alone loses the leading space its bytes
    carry ("▁Hello" decodes to "Hello"): its text would then disagree with its
    `bytes`, and completions' `text_offset` with the text the stream sent. The one
    place the stream drops that space is the very start of an output (as a whole
    decode does), where the first token's label is one character longer than the
    text sent; each delta's offset comes from the text sent, so that stays inside
    the first delta.
    """

    __slots__ = ("_decode", "_token_bytes")

    def __init__(self, decode: TokenText,
                 token_bytes: Callable[[int], bytes | None] | None = None) -> None:
        self._decode = decode
        self._token_bytes = token_bytes

    @classmethod
    def of_tokenizer(cls, tokenizer) -> "TokenLabels":
        """Labels from a tokenizer's `decode` of one token and its `token_bytes`."""
        return cls(lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False),
                   tokenizer.token_bytes)

    def label(self, token_id: int) -> tuple[str, bytes]:
        """`token_id`'s text and its bytes, each looked up once."""
        raw = self._token_bytes(token_id) if self._token_bytes is not None else None
        if raw is None:
            text = self._decode(token_id)
            return text, text.encode("utf-8", "replace")
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:  # part of a character
            return self._decode(token_id), raw

    def text(self, token_id: int) -> str:
        return self.label(token_id)[0]


def completion_logprobs(token_ids: list[int], logprobs: list[float],
                        top_logprobs: list[list[tuple[int, float]]] | None,
                        token_text: TokenText, text_offset: int) -> dict:
    """The completions API's logprobs object for some consecutive tokens."""
    tokens = [token_text(t) for t in token_ids]
    offsets = []
    for tok in tokens:
        offsets.append(text_offset)
        text_offset += len(tok)
    tops = None
    if top_logprobs is not None:
        tops = [{token_text(t): _finite(lp) for t, lp in alts} for alts in top_logprobs]
    return {"tokens": tokens, "token_logprobs": [_finite(lp) for lp in logprobs],
            "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(token_ids: list[int], logprobs: list[float],
                  top_logprobs: list[list[tuple[int, float]]] | None,
                  labels: TokenLabels) -> dict:
    """The chat API's logprobs object (`{"content": [...]}`) for some tokens."""
    content = []
    for i, (tid, lp) in enumerate(zip(token_ids, logprobs)):
        alts = top_logprobs[i] if top_logprobs is not None and i < len(top_logprobs) else []
        content.append({**_chat_entry(labels, tid, lp),
                        "top_logprobs": [_chat_entry(labels, t, alp) for t, alp in alts]})
    return {"content": content}


def _chat_entry(labels: TokenLabels, token_id: int, logprob: float) -> dict:
    text, raw = labels.label(token_id)
    return {"token": text, "logprob": _finite(logprob), "bytes": list(raw)}


# OpenAI's logprob for a token of no probability. JSON has no -Infinity: an event
# holding one is not JSON a client can parse. The engine's logprobs are the
# model's own and finite (replicas/sampling/sampler.py); this floor keeps a
# model's -inf logit from ever breaking a stream.
LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN too
