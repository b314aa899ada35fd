"""Locust load test for any OpenAI-compatible server, streaming over SSE
(loadtests/README.md: its flags, rows and the staged shape).

Besides each request (timed to the end of the stream, not to the headers) it logs
TTFT, ITL and TPOT (loadtests/serving/metrics.py) into rows of their own type, not as
request events, so the Aggregated row and its req/s count real requests only.
"""
from __future__ import annotations

import json
import os
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

from locust import FastHttpUser, LoadTestShape, events, task

if __package__ != "loadtests":  # run by path from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from loadtests.serving import datasets  # noqa: E402
from loadtests.serving.metrics import Distribution, RequestTimeline, itls_s, tpot_s, ttft_s  # noqa: E402
from loadtests.serving.openai_stream import (CHAT_COMPLETIONS, COMPLETIONS, StreamParser,  # noqa: E402
                                     build_payload, join_url)


def _shape_requested() -> str:
    # NOTE: locust picks shape classes at import, before it parses custom flags,
    # so the choice is read from argv / the environment here.
    argv = sys.argv
    for i, arg in enumerate(argv):
        if arg == "--shape" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--shape="):
            return arg.split("=", 1)[1]
    return os.environ.get("LOCUST_SHAPE", "")


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    group = parser.add_argument_group("stepstream")
    group.add_argument("--dataset-path", default="", help="ShareGPT JSON; empty: random prompts of --input-len words")
    group.add_argument("--tokenizer", default="", help="tokenizer dir/json, for ShareGPT lengths")
    group.add_argument("--input-len", type=int, default=128, help="words per generated prompt")
    group.add_argument("--output-len", type=int, default=128, help="max_tokens (with a dataset: its lengths)")
    group.add_argument("--model", default="tiny")
    group.add_argument("--chat-ratio", type=float, default=0.0, help="share of chat completions, 0..1")
    group.add_argument("--api-key", default="", help="sent as a Bearer token")
    group.add_argument("--ignore-eos", action="store_true", help="ask for exactly --output-len tokens")
    group.add_argument("--shape", default="", choices=["", "staged"], help="staged: ramp, hold, stop")
    group.add_argument("--peak-users", type=int, default=32)
    group.add_argument("--ramp-time", type=float, default=30.0, help="seconds to reach --peak-users")
    group.add_argument("--hold-time", type=float, default=60.0, help="seconds at --peak-users")
    group.add_argument("--soak-out", default="", help="JSON file for per-minute figures")


_PROMPTS: list[datasets.SampleRequest] = []


@events.test_start.add_listener
def _load_prompts(environment, **_kwargs) -> None:
    opts = environment.parsed_options
    if opts is None:
        return
    if opts.dataset_path:
        tokenizer = datasets.load_tokenizer(opts.tokenizer or None)
        _PROMPTS[:] = datasets.sample_sharegpt_requests(opts.dataset_path, 1000, tokenizer)
    else:
        _PROMPTS[:] = datasets.sample_random_requests(256, opts.input_len, opts.output_len)


# -- per-minute figures for --soak-out --------------------------------------------------------
_started_at = [0.0]
_minutes: dict = defaultdict(lambda: {"requests": 0, "failures": 0, "TTFT": [], "ITL": []})


def _minute() -> int:
    return int((time.monotonic() - _started_at[0]) // 60)


@events.test_start.add_listener
def _start_clock(environment, **_kwargs) -> None:
    _started_at[0] = time.monotonic()


@events.request.add_listener
def _count(request_type, name, response_time, exception=None, **_kwargs) -> None:
    if _started_at[0]:  # only real requests fire events (see _log_pseudo)
        m = _minutes[_minute()]
        m["requests"] += 1
        m["failures"] += exception is not None


def _dist(values_ms: list[float]) -> dict:
    return Distribution.from_seconds([v / 1000 for v in values_ms], (50.0, 99.0)).to_dict() \
        if values_ms else {"count": 0}


def soak_summary() -> dict:
    minutes = sorted(_minutes)
    every = {kind: [v for m in minutes for v in _minutes[m][kind]] for kind in ("TTFT", "ITL")}
    return {"per_minute": [{"minute": m, "requests": _minutes[m]["requests"],
                            "failures": _minutes[m]["failures"], "ttft": _dist(_minutes[m]["TTFT"]),
                            "itl": _dist(_minutes[m]["ITL"])} for m in minutes],
            "requests": sum(_minutes[m]["requests"] for m in minutes),
            "failures": sum(_minutes[m]["failures"] for m in minutes),
            "ttft": _dist(every["TTFT"]), "itl": _dist(every["ITL"])}


@events.quitting.add_listener
def _write_soak(environment, **_kwargs) -> None:
    path = environment.parsed_options.soak_out if environment.parsed_options else ""
    if path:
        with open(path, "w") as f:
            json.dump(soak_summary(), f, indent=1)


def _log_pseudo(environment, kind: str, name: str, values_s: list[float], length: int = 0) -> None:
    """Into the (kind, name) row only: firing a request event would also count each value in
    the Aggregated row (locust has no request type that totals leave out)."""
    entry = environment.stats.get(name, kind)
    for value in values_s:
        entry.log(value * 1000.0, length)
    if _started_at[0] and kind in ("TTFT", "ITL"):
        _minutes[_minute()][kind].extend(v * 1000.0 for v in values_s)


class OpenAIStreamUser(FastHttpUser):
    """Streams one request at a time, back to back."""

    network_timeout = 600.0  # between two reads; long prompts may take a while
    connection_timeout = 30.0

    @task
    def stream_one(self) -> None:
        opts = self.environment.parsed_options
        sample = random.choice(_PROMPTS) if _PROMPTS else datasets.SampleRequest("Hello", 1, opts.output_len)
        endpoint = CHAT_COMPLETIONS if random.random() < opts.chat_ratio else COMPLETIONS
        max_tokens = sample.expected_output_len if opts.dataset_path else opts.output_len
        payload = build_payload(endpoint, opts.model, sample.prompt, max_tokens, ignore_eos=opts.ignore_eos)
        headers = {"Accept": "text/event-stream", "Accept-Encoding": "identity"}
        if opts.api_key:
            headers["Authorization"] = f"Bearer {opts.api_key}"
        url = join_url(self.host or "", endpoint)
        self._stream(url, endpoint, payload, headers)

    def _stream(self, url: str, name: str, payload: dict, headers: dict) -> None:
        parser = StreamParser()
        num_bytes = 0
        send = time.perf_counter()
        with self.client.post(url, name=name, json=payload, headers=headers,
                              stream=True, catch_response=True) as resp:
            reason = ""
            if resp.status_code and 200 <= resp.status_code < 300:
                try:
                    num_bytes = self._read_lines(resp, parser)
                    reason = parser.failure_reason(resp.status_code)
                except Exception as exc:  # socket errors, timeouts mid-stream
                    reason = f"{type(exc).__name__}: {exc}"
            else:
                reason = self._http_failure(resp)
            end = time.perf_counter()
            # NOTE: locust timed only up to the headers; the request's time is the whole stream.
            resp.request_meta["response_time"] = (end - send) * 1000.0
            resp.request_meta["response_length"] = num_bytes
            if reason:
                resp.failure(reason)
            else:
                resp.success()
        if not reason:
            self._report_stream(name, send, parser)

    @staticmethod
    def _read_lines(resp, parser: StreamParser) -> int:
        # NOTE: read line by line from the raw geventhttpclient response: locust's
        # iter_content waits for 1 KiB blocks, which would delay chunk times.
        raw = resp._response
        num_bytes = 0
        while True:
            line = raw.readline(b"\n")
            if not line:
                return num_bytes
            num_bytes += len(line)
            parser.feed(line, time.perf_counter())

    @staticmethod
    def _http_failure(resp) -> str:
        if not resp.status_code:
            return f"connection error: {getattr(resp, 'error', '')!r}"
        try:
            body = (resp.text or "")[:200]
        except Exception:  # body unreadable: the status is reason enough
            body = ""
        return f"HTTP {resp.status_code}: {body}"

    def _report_stream(self, name: str, send: float, parser: StreamParser) -> None:
        env = self.environment
        t = RequestTimeline(send, parser.chunk_times, parser.completion_tokens or len(parser.chunk_times))
        _log_pseudo(env, "TTFT", name, [ttft_s(t)], t.num_output_tokens)
        _log_pseudo(env, "ITL", name, itls_s(t))
        tpot = tpot_s(t)
        if tpot is not None:
            _log_pseudo(env, "TPOT", name, [tpot], t.num_output_tokens)


class StagedShape(LoadTestShape):
    """Ramp to --peak-users over --ramp-time, hold --hold-time, then stop."""

    abstract = _shape_requested() != "staged"

    def tick(self):
        opts = self.runner.environment.parsed_options
        run_time = self.get_run_time()
        if run_time >= opts.ramp_time + opts.hold_time:
            return None
        spawn_rate = opts.peak_users / opts.ramp_time if opts.ramp_time > 0 else opts.peak_users
        return opts.peak_users, max(spawn_rate, 0.1)
