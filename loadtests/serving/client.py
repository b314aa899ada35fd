"""One benchmark request over aiohttp: send, time every content chunk, keep the reason of a failure."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp

from loadtests.serving.datasets import SampleRequest, TokenizerLike
from loadtests.serving.metrics import RequestTimeline, itls_s, latency_s, tpot_s, ttft_s
from loadtests.serving.openai_stream import StreamParser, build_payload, parse_full_response


@dataclass(slots=True)
class RequestSpec:
    """What every request of one run shares."""
    api_url: str
    endpoint: str
    model: str
    stream: bool = True
    ignore_eos: bool = False
    temperature: float | None = None  # None: not sent (the server's default, 1.0)
    timeout_s: float = 300.0
    headers: dict = field(default_factory=dict)


@dataclass(slots=True)
class RequestRecord:
    index: int
    request: SampleRequest
    timeline: RequestTimeline
    text: str = ""
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    output_tokens_source: str = ""  # usage | tokenizer | chunks

    def resolve_output_tokens(self, tokenizer: TokenizerLike | None) -> None:
        """Server usage first, else re-tokenize the text, else one token a chunk."""
        t = self.timeline
        if self.usage_completion_tokens:
            t.num_output_tokens, self.output_tokens_source = self.usage_completion_tokens, "usage"
        elif tokenizer is not None:
            t.num_output_tokens, self.output_tokens_source = len(tokenizer.encode(self.text)), "tokenizer"
        else:
            t.num_output_tokens, self.output_tokens_source = t.num_chunks, "chunks"

    def to_json(self, run_start: float) -> dict:
        t = self.timeline
        ok = t.success and bool(t.chunk_times)
        tpot = tpot_s(t) if ok else None
        return {
            "index": self.index, "success": ok, "error": t.error,
            "prompt_len": self.request.prompt_len,
            "expected_output_len": self.request.expected_output_len,
            "output_tokens": t.num_output_tokens if ok else 0,
            "output_tokens_source": self.output_tokens_source,
            "usage_prompt_tokens": self.usage_prompt_tokens,
            "num_chunks": t.num_chunks,
            "send_offset_s": t.send_time - run_start,
            "ttft_ms": ttft_s(t) * 1000 if ok else None,
            "tpot_ms": tpot * 1000 if tpot is not None else None,
            "latency_ms": latency_s(t) * 1000 if ok else None,
            "itl_ms": [x * 1000 for x in itls_s(t)] if ok else [],
            "chunk_num_tokens": t.chunk_num_tokens,
            "output_chars": len(self.text),
        }


def failed_record(index: int, request: SampleRequest, send_time: float, error: str) -> RequestRecord:
    timeline = RequestTimeline(send_time=send_time, prompt_len=request.prompt_len,
                               success=False, error=error)
    return RequestRecord(index, request, timeline)


async def send_request(session: aiohttp.ClientSession, spec: RequestSpec,
                       index: int, request: SampleRequest) -> RequestRecord:
    payload = build_payload(spec.endpoint, spec.model, request.prompt, request.expected_output_len,
                            stream=spec.stream, ignore_eos=spec.ignore_eos,
                            temperature=spec.temperature)
    parser = StreamParser()
    timeline = RequestTimeline(send_time=time.perf_counter(), prompt_len=request.prompt_len)
    record = RequestRecord(index, request, timeline)
    error = ""
    try:
        timeout = aiohttp.ClientTimeout(total=spec.timeout_s)
        async with session.post(spec.api_url, json=payload, headers=spec.headers, timeout=timeout) as resp:
            if not 200 <= resp.status < 300:
                body = await resp.text()
                error = f"HTTP {resp.status}: {body[:200]}"
            elif spec.stream:
                # NOTE: StreamReader iteration yields whole lines as they arrive; the time
                # of a chunk is the time its line was read, as in vLLM's client.
                async for line in resp.content:
                    parser.feed(line, time.perf_counter())
                error = parser.failure_reason(resp.status)
            else:
                body = await resp.json(content_type=None)
                # NOTE: without streaming the whole answer is one chunk: TTFT = latency.
                text, parser.completion_tokens, parser.prompt_tokens = parse_full_response(body)
                parser.chunk_times.append(time.perf_counter())
                parser.text_parts.append(text)
    except asyncio.TimeoutError:
        error = f"timeout after {spec.timeout_s:g}s"
    except (aiohttp.ClientError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    timeline.chunk_times = parser.chunk_times
    timeline.chunk_num_tokens = parser.chunk_num_tokens or None
    timeline.success = not error and bool(parser.chunk_times)
    timeline.error = error or ("" if parser.chunk_times else "no content chunk")
    record.text = parser.text
    record.usage_completion_tokens = parser.completion_tokens
    record.usage_prompt_tokens = parser.prompt_tokens
    return record
