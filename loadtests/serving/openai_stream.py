"""OpenAI-compatible requests and their SSE streams, independent of the HTTP client.

Both the async benchmark (aiohttp) and the locust file (gevent) feed raw lines into
`StreamParser`, which times content chunks and collects usage, so the two tools
agree on what a chunk, a token count and a failure are. The tests read our server's
streams with it too (`keep_events`, `StreamParser.of`).
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


def is_chat(endpoint: str) -> bool:
    return endpoint.rstrip("/").endswith("chat/completions")


def join_url(base_url: str, endpoint: str) -> str:
    """http://h:p/v1 + /v1/completions -> http://h:p/v1/completions (no doubled /v1)."""
    base = base_url.rstrip("/")
    if base.endswith("/v1") and endpoint.startswith("/v1/"):
        base = base[: -len("/v1")]
    return base + endpoint


def build_payload(endpoint: str, model: str, prompt: str, max_tokens: int, *,
                  stream: bool = True, ignore_eos: bool = False,
                  temperature: float | None = None) -> dict:
    """`temperature` None sends none: the server's default (1.0 in the OpenAI API),
    what most clients send, and vLLM's benchmark client too."""
    payload: dict = {"model": model, "max_tokens": max_tokens, "stream": stream}
    if temperature is not None:
        payload["temperature"] = temperature
    if is_chat(endpoint):
        payload["messages"] = [{"role": "user", "content": prompt}]
    else:
        payload["prompt"] = prompt
    if stream:
        payload["stream_options"] = {"include_usage": True}
    if ignore_eos:
        payload["ignore_eos"] = True  # vLLM extension; OpenAI ignores unknown keys
    return payload


def choice_text(choice: dict) -> str:
    if "delta" in choice:  # chat: a role-only first chunk carries no content
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    if "message" in choice:  # chat, non-streamed
        return (choice.get("message") or {}).get("content") or ""
    return choice.get("text") or ""


def event_text(data: dict) -> str:
    """The content an event (or a non-streamed answer) carries, all choices joined."""
    return "".join(choice_text(c) for c in (data.get("choices") or ()))


def _error_text(data: dict) -> str:
    err = data.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


@dataclass(slots=True)
class StreamParser:
    """Feed SSE lines as they arrive; content chunks are the ones with text."""
    chunk_times: list[float] = field(default_factory=list)
    chunk_num_tokens: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    completion_tokens: int | None = None  # from the server's usage
    prompt_tokens: int | None = None
    is_done: bool = False  # saw data: [DONE]
    error: str = ""
    num_events: int = 0  # data events, [DONE] included
    keep_events: bool = False
    events: list = field(default_factory=list)  # with keep_events: each decoded, "[DONE]" as is
    _is_error_event: bool = False

    @classmethod
    def of(cls, stream: str | bytes | Iterable, now: float = 0.0) -> "StreamParser":
        """A parser that has read a whole stream (its text, or its lines), keeping events."""
        if isinstance(stream, bytes):
            stream = stream.decode("utf-8", "replace")
        parser = cls(keep_events=True)
        for line in stream.splitlines() if isinstance(stream, str) else stream:
            parser.feed(line, now)
        return parser

    def feed(self, raw_line: bytes | str, now: float) -> None:
        line = raw_line.decode("utf-8", "replace") if isinstance(raw_line, bytes) else raw_line
        line = line.strip()
        if not line or line.startswith(":"):
            return  # blank separator or SSE comment (keep-alive)
        if line.startswith("event:"):
            self._is_error_event = line[len("event:"):].strip() == "error"
            return
        if not line.startswith("data:"):
            return  # id:, retry:, or noise
        data_text = line[len("data:"):].strip()
        self.num_events += 1
        if data_text == "[DONE]":
            self.is_done = True
            if self.keep_events:
                self.events.append(data_text)
            return
        try:
            data = json.loads(data_text)
        except json.JSONDecodeError:
            self.error = self.error or f"bad JSON in stream: {data_text[:120]}"
            return
        if self.keep_events:
            self.events.append(data)
        if self._is_error_event or "error" in data:
            self.error = self.error or f"error event: {_error_text(data)}"
            self._is_error_event = False
            return
        self._take_chunk(data, now)

    def _take_chunk(self, data: dict, now: float) -> None:
        usage = data.get("usage")
        prior_tokens = self.completion_tokens
        if usage:
            self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
        text = event_text(data)
        if not text:
            return
        self.chunk_times.append(now)
        self.text_parts.append(text)
        # NOTE: per-chunk token counts exist only when every chunk carries usage
        # (vLLM's continuous_usage_stats); otherwise the list stays short and unused.
        if usage and self.completion_tokens is not None and len(self.chunk_num_tokens) == len(self.chunk_times) - 1:
            self.chunk_num_tokens.append(self.completion_tokens - (prior_tokens or 0))

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def failure_reason(self, status: int) -> str:
        """Empty when the stream is a success."""
        if not 200 <= status < 300:
            return f"HTTP {status}"
        if self.error:
            return self.error
        if not self.is_done:
            return "stream ended without [DONE]"
        if not self.chunk_times:
            return "stream had no content chunk"
        return ""


def parse_full_response(body: dict) -> tuple[str, int | None, int | None]:
    """Non-streamed answer: (text, completion_tokens, prompt_tokens)."""
    text = event_text(body)
    usage = body.get("usage") or {}
    return text, usage.get("completion_tokens"), usage.get("prompt_tokens")
