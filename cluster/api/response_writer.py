"""Text deltas of one request's choices -> SSE events, or one JSON body.

Every stream ends honestly: `[DONE]` after a complete answer, or an error event
in the OpenAI shape (and no `[DONE]`) when anything fails after the headers went
out. A client disconnect cancels the generator; `Relay` then stops the replica. A
response that ends before its generator started (cancelled that early, or its
headers' send failed) aborts the relays in `SSEResponse`'s `on_end`.

An engine replica lost while generating ends a stream with a 503-shaped error
event (a client's retry lands on a replica still there). A non-streamed answer
sent nothing yet, so `json_answer` runs it again, once, on the choices' new
engine requests (cluster/api/choice_runs.py), unless the request already used its
retry after a lost replica before its first token; a loss it may not run again
after is its 503.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Awaitable, Callable

from starlette.responses import StreamingResponse

from cluster.errors import ApiError, sse_error_event
from cluster.api.choices import merged_text_deltas
from cluster.transport.relay import Relay, aclosing, is_error
from cluster.api.openai_events import DONE_EVENT, TokenLabels, chat_logprobs, completion_logprobs
from deltas.types import TextDelta

logger = logging.getLogger("ray.serve")



# Runs of a non-streamed request after the first, each after its replica was lost
# mid-answer: one, so a request that takes its replica down cannot take the next.
MAX_LOST_ANSWER_RETRIES = 1


class AnswerLost(Exception):
    """A non-streamed answer's replica was lost while generating; nothing of it
    reached the client, so the request may run again."""


def _engine_failure(text_delta: TextDelta, relay: Relay) -> ApiError:
    if relay.timed_out:
        return ApiError(504, f"The request timed out: {text_delta.error}", code="timeout")
    if relay.replica_lost:
        return ApiError(503, "The engine replica was lost while generating; retry later",
                        code="engine_unavailable", retry_after_s=1.0)
    return ApiError(500, f"The request failed while generating: {text_delta.error}",
                    code="engine_error")


def _finish_reason(text_delta: TextDelta) -> str | None:
    reason = text_delta.finish_reason
    return None if reason is None else str(reason)


def _logprobs(token_ids, logprobs, top_logprobs, chat: bool, labels: TokenLabels,
              text_offset: int) -> dict | None:
    if logprobs is None:
        return None
    if chat:
        return chat_logprobs(token_ids, logprobs, top_logprobs, labels)
    return completion_logprobs(token_ids, logprobs, top_logprobs, labels.text, text_offset)


def count_tokens(metrics, num_prompt_tokens: int, num_output_tokens: int) -> None:
    if metrics is not None:
        metrics.count_tokens(num_prompt_tokens, num_output_tokens)


class _Timing:
    """TTFT, ITL and TPOT of one choice's stream, into the ingress metrics.

    NOTE: the ITL goes through the ingress's sampler (a Ray metric record costs
    more than formatting the event itself); the rest is a few records per stream."""

    __slots__ = ("metrics", "started_at", "first_at", "last_at", "num_events")

    def __init__(self, metrics, started_at: float | None) -> None:
        """`started_at` None: no TTFT (not the request's first choice)."""
        self.metrics = metrics
        self.started_at = started_at
        self.first_at = 0.0
        self.last_at = 0.0
        self.num_events = 0

    def event(self) -> None:
        if self.metrics is None:
            return
        now = time.monotonic()
        if self.num_events == 0:
            self.first_at = now
            if self.started_at is not None:
                self.metrics.ttft_s.observe(now - self.started_at)
        else:
            self.metrics.itl_sample.observe(now - self.last_at, now)
        self.last_at = now
        self.num_events += 1

    def finish(self, num_output_tokens: int) -> None:
        """TPOT and tokens per event of a complete stream (tokens: `count_tokens`)."""
        if self.metrics is None:
            return
        if self.num_events:
            self.metrics.tokens_per_event.observe(num_output_tokens / self.num_events)
        if num_output_tokens > 1 and self.num_events:
            self.metrics.tpot_s.observe((self.last_at - self.first_at) / (num_output_tokens - 1))


class StreamEnd(bytes):
    """A stream's last events: `SSEResponse` sends them with the end of the body, so
    the step that finishes a stream writes to its connection once (its last chunk,
    the usage chunk, `[DONE]` and the chunked-encoding terminator together)."""

    __slots__ = ()


class SSEResponse(StreamingResponse):
    """Starlette's streaming response, except that a `StreamEnd` item ends the body
    in the same `send` (one socket write where Starlette makes two: the chunk,
    then an empty end), and `on_end` runs when the response ends, however it ends.

    NOTE: a body generator that never started (the request cancelled before its
    first item, or the headers' send failed) runs none of its clean-up; `on_end`
    lets go of what the body would have (the relays: `Relay.abort` does nothing
    for a relay its body closed)."""

    def __init__(self, content, *args, on_end: Callable[[], None] | None = None,
                 **kwargs) -> None:
        super().__init__(content, *args, **kwargs)
        self._on_end = on_end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._on_end is not None:
                self._on_end()

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async with aclosing(self.body_iterator) as chunks:
            async for chunk in chunks:
                is_end = type(chunk) is StreamEnd
                await send({"type": "http.response.body", "body": chunk,
                            "more_body": not is_end})
                if is_end:
                    return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def abort_all(relays: list[Relay]) -> None:
    """Let go of every relay not closed yet (a response that ended before its body did)."""
    for relay in relays:
        relay.abort()


async def sse_events(relays: list[Relay], formatter, chat: bool, labels: TokenLabels | None,
                     metrics, started_at: float, num_prompt_tokens: int,
                     choice_prompt_tokens: list[int] | None = None,
                     tool_answers=None) -> AsyncIterator[bytes]:
    """The events of the request whose choices `relays` read (one per choice);
    usage counts each prompt once (`num_prompt_tokens`) and every choice's output
    tokens. Each item is one write: one step's chunk of one choice, or the `StreamEnd`.
    `choice_prompt_tokens` (each choice's prompt tokens) asks for continuous usage:
    each chunk with its choice's usage so far.

    NOTE: each choice has its own ITL and TPOT; the first choice's first token is
    the request's (its prompt's other choices are admitted once it came:
    cluster/api/choices.py). `tool_answers` (cluster/api/tools/stream.py): each
    choice's text is parsed for tool calls, one parser per choice, and its chunks
    carry content and tool-call deltas."""
    timings = [_Timing(metrics, started_at if i == 0 else None) for i in range(len(relays))]
    tool_streams = None if tool_answers is None else [tool_answers.stream() for _ in relays]
    text_offsets = [0] * len(relays)
    num_output_tokens = [0] * len(relays)
    num_unfinished = len(relays)
    last_event = b""  # the last choice's finish chunk: it goes out with the end
    try:
        async with aclosing(merged_text_deltas(relays)) as text_deltas:
            async for i, td in text_deltas:
                if is_error(td):
                    yield sse_error_event(_engine_failure(td, relays[i]))
                    return
                logprobs = None
                if labels is not None and td.token_ids:
                    logprobs = _logprobs(td.token_ids, td.logprobs, td.top_logprobs, chat,
                                         labels, text_offsets[i])
                text_offsets[i] += len(td.text)
                num_output_tokens[i] = td.num_output_tokens
                num_unfinished -= td.finish_reason is not None
                finished = td.finish_reason is not None
                delta = tool_streams[i].feed(td.text, finished) if tool_streams else None
                has_text = bool(delta) if tool_streams else bool(td.text)
                if not (has_text or finished or logprobs is not None):
                    continue
                usage = (None if choice_prompt_tokens is None else
                         (choice_prompt_tokens[i], td.num_output_tokens))
                if delta is None:
                    event = formatter.chunk_event(td.text, _finish_reason(td), logprobs,
                                                  td.stop_reason, i, usage)
                else:  # a tool-calling choice's content and tool-call deltas
                    finish = tool_answers.finish_reason(_finish_reason(td),
                                                        tool_streams[i].made_calls)
                    event = formatter.delta_event(i, delta, finish, logprobs, td.stop_reason,
                                                  usage)
                timings[i].event()
                if num_unfinished:
                    yield event
                else:
                    last_event = event
        for timing, n in zip(timings, num_output_tokens):
            timing.finish(n)
        usage = (formatter.usage_event(num_prompt_tokens, sum(num_output_tokens))
                 if formatter.include_usage else b"")
        # NOTE: the last item: SSEResponse closes the generator once it is sent.
        yield StreamEnd(last_event + usage + DONE_EVENT)
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception:
        logger.exception("stream %s failed", relays[0].request_id)
        yield sse_error_event(ApiError(500, "Internal server error", code="internal_error"))
    finally:
        # NOTE: every ending counts: a stream cut short sent its tokens too.
        count_tokens(metrics, num_prompt_tokens, sum(num_output_tokens))


class _ChoiceText:
    """One choice's text, and its logprobs when asked, gathered for a JSON body."""

    __slots__ = ("texts", "token_ids", "logprobs", "top_logprobs", "last")

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list = []
        self.last: TextDelta | None = None

    def add(self, td: TextDelta, with_logprobs: bool) -> None:
        self.texts.append(td.text)
        if with_logprobs and td.logprobs is not None:
            self.token_ids.extend(td.token_ids)
            self.logprobs.extend(td.logprobs)
            self.top_logprobs.extend(td.top_logprobs or [])
        self.last = td

    def choice(self, index: int, formatter, chat: bool, labels: TokenLabels | None,
               tool_answers=None) -> dict:
        last = self.last
        lp = None
        if labels is not None:
            lp = _logprobs(self.token_ids, self.logprobs, self.top_logprobs or None, chat,
                           labels, 0)
        if tool_answers is not None:
            content, calls = tool_answers.message("".join(self.texts))
            return formatter.choice(index, content,
                                    tool_answers.finish_reason(_finish_reason(last), bool(calls)),
                                    last.stop_reason, lp, calls)
        return formatter.choice(index, "".join(self.texts), _finish_reason(last),
                                last.stop_reason, lp)


async def json_answer(relays: list[Relay], reopen: Callable[[int], Awaitable[list[Relay]]],
                      formatter, chat: bool, labels: TokenLabels | None,
                      num_prompt_tokens: int, metrics=None, tool_answers=None) -> dict:
    """The body of the request whose choices `relays` read; where a replica is lost
    mid-answer, `reopen(run)` opens the choices again (run 1, ...: its relays get no
    retry after a lost replica) and they answer. A request whose choices already
    used that retry before their first token is not run again (cluster/api/choice_runs.py)."""
    for run in range(MAX_LOST_ANSWER_RETRIES + 1):
        retry_lost = (run < MAX_LOST_ANSWER_RETRIES
                      and not any(relay.num_replica_losses for relay in relays))
        try:
            return await json_body(relays, formatter, chat, labels, num_prompt_tokens,
                                   metrics, retry_lost=retry_lost, tool_answers=tool_answers)
        except AnswerLost:
            logger.warning("an engine replica was lost while answering %s: running it again",
                           relays[0].request_id)
        try:
            relays = await reopen(run + 1)
        except BaseException:
            count_tokens(metrics, num_prompt_tokens, 0)  # the lost run's prompt, no answer
            raise
    raise AssertionError("unreachable: the last run raises the loss as a 503")


async def json_body(relays: list[Relay], formatter, chat: bool, labels: TokenLabels | None,
                    num_prompt_tokens: int, metrics=None, retry_lost: bool = False,
                    tool_answers=None) -> dict:
    """The body of the request whose choices `relays` read (one per choice).
    `retry_lost`: a replica lost mid-answer raises `AnswerLost` (and counts no
    tokens: the run that answers does), not its 503."""
    choices = [_ChoiceText() for _ in relays]
    answered = lost = False
    try:
        async with aclosing(merged_text_deltas(relays)) as text_deltas:
            async for i, td in text_deltas:
                if is_error(td):
                    lost = retry_lost and relays[i].replica_lost and not relays[i].timed_out
                    if lost:
                        raise AnswerLost()
                    raise _engine_failure(td, relays[i])
                choices[i].add(td, labels is not None)
        # NOTE: merged_text_deltas ends once every choice has its finish
        answered = True
    finally:
        if not lost:
            # NOTE: output tokens only with an answer: a failed one sends none.
            num_output_tokens = (sum(c.last.num_output_tokens for c in choices)
                                 if answered else 0)
            count_tokens(metrics, num_prompt_tokens, num_output_tokens)
    return formatter.response_of([c.choice(i, formatter, chat, labels, tool_answers)
                                  for i, c in enumerate(choices)],
                                 num_prompt_tokens, num_output_tokens)
