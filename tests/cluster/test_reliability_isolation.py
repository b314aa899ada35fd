"""One request must never take the engine down, on a real local Ray (HTTP API and
public handle methods only). Valid but extreme values get a clear 200 or 400; a
request whose sampling raises inside the batched step fails alone, with one error
event; a hypothesis fuzz of valid requests across every accepted range
(temperature > 0 included) gets only 200s while normal streams run beside it, each
ending with `[DONE]` and its offline text. Throughout, the same engine replica
keeps serving and /health answers 200. One app for the module; Serve and Ray
always shut down."""
from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster_support import engine_handle, serve_app, wait_until
from loadtests.serving.openai_stream import StreamParser
from reliability_support import (engine_stats, greedy_texts, is_idle, is_openai_error,
                                 stream_request)

pytestmark = [pytest.mark.ray, pytest.mark.shared_ray, pytest.mark.timeout(600)]

MODEL = "tiny"
VOCAB_SIZE = 8192
ENGINE_ARGS = {"max_num_seqs": 16, "num_kv_blocks": 512, "num_scheduler_steps": 4,
               "max_model_len": 512}
APP_ARGS = {"model": MODEL, "engine_num_cpus": 1, "ingress_num_cpus": 0.5, "num_threads": 1,
            "enable_fault_injection": True, **ENGINE_ARGS}
PROMPTS = [f"Story {i}: the {['cat', 'dog', 'owl', 'fox'][i]} went to" for i in range(4)]
# A victim of 120 windows: it must outlast six hostile requests (about 30 windows
# with their HTTP round trips here) on a machine a few times slower.
VICTIM_TOKENS = 480
# NOTE: hypothesis draws every field's range in the first few dozen (derandomized)
NUM_FUZZED = 64


@pytest.fixture(scope="module")
def server():
    with serve_app(APP_ARGS) as base:
        yield base


@pytest.fixture(scope="module")
def reference():
    """Greedy texts of PROMPTS from the offline engine, per max_tokens."""
    return greedy_texts(MODEL, ENGINE_ARGS, PROMPTS)


def _greedy(i: int, max_tokens: int, stream: bool = True, **extra) -> dict:
    return {"model": MODEL, "prompt": PROMPTS[i], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream, **extra}


def _replica_id() -> str:
    (rid, _), = engine_stats(engine_handle()).items()
    return rid


def _all_finite(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_all_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_all_finite(v) for v in value)
    return True


def _assert_healthy_same_replica(server: str, replica_id: str) -> None:
    assert httpx.get(server + "/health", timeout=30).status_code == 200
    assert _replica_id() == replica_id, "the engine replica was replaced"
    handle = engine_handle()
    assert wait_until(lambda: all(is_idle(s) for s in engine_stats(handle).values()), 30)


def test_extreme_but_valid_values_answer_clearly_and_the_victim_completes(server, reference):
    url = server + "/v1/completions"
    handle = engine_handle()
    replica_id = _replica_id()
    hostile = [  # (body, expected status, the greedy text it must equal or None)
        ({"temperature": 1, "top_k": 2**63}, 400, None),
        ({"temperature": 1, "top_k": 2**63 - 1, "seed": 2**63 - 1}, 200, None),
        ({"temperature": 1e-300}, 200, "greedy"),
        ({"temperature": 1.0, "top_p": 1e-300}, 200, "greedy"),  # only the top token
        ({"temperature": 5e-3, "repetition_penalty": 1e-300, "min_p": 1.0}, 200, None),
        ({"temperature": 100, "presence_penalty": -2, "frequency_penalty": -2}, 200, None),
    ]

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            victim = asyncio.ensure_future(stream_request(client, url, _greedy(0, VICTIM_TOKENS)))
            await asyncio.to_thread(wait_until, lambda: engine_stats(engine_handle()).popitem()[1][
                "num_running"] >= 1, 30)
            answers = []
            for body, _, _ in hostile:
                answers.append(await client.post(url, json={**_greedy(1, 16, False), **body}))
                answers.append(await client.get(server + "/health"))
            assert not victim.done(), "the victim must still be running"
            return answers, await victim

    handle.inject_fault.remote("slow", 0.05).result(timeout_s=30)  # the victim stays in flight
    try:
        answers, victim = asyncio.run(run())
    finally:
        handle.inject_fault.remote("clear").result(timeout_s=30)
    greedy_text = reference(16)[1]
    for (body, status, expect), r, health in zip(hostile, answers[::2], answers[1::2]):
        assert r.status_code == status, (body, r.text[:300])
        assert health.status_code == 200
        if status == 400:
            error = r.json()["error"]
            assert is_openai_error(r.json()) and error["param"] == "top_k"
            assert "2**63 - 1" in error["message"], error["message"]  # the bound is stated
        else:
            answer = r.json()
            assert answer["usage"]["completion_tokens"] == 16 and _all_finite(answer)
            if expect == "greedy":
                assert answer["choices"][0]["text"] == greedy_text, body
    assert victim.done and not victim.error_events
    assert victim.text == reference(VICTIM_TOKENS)[0]
    _assert_healthy_same_replica(server, replica_id)
    print(f"\nextreme values: {[r.status_code for r in answers[::2]]} for {len(hostile)} "
          f"requests; /health 200 after each; the victim's {VICTIM_TOKENS} tokens complete")


# max_num_seqs, plus as many waiting (max_waiting_requests unset): cluster/app.py
MAX_ENGINE_REQUESTS = 2 * ENGINE_ARGS["max_num_seqs"]


@pytest.mark.parametrize("body, param", [
    ({"n": MAX_ENGINE_REQUESTS + 1}, "n"),
    ({"prompt": ["a"] * (MAX_ENGINE_REQUESTS // 2 + 1), "n": 2}, "prompt"),
    ({"prompt": ["a"] * (MAX_ENGINE_REQUESTS + 1)}, "prompt"),
])
def test_more_choices_than_the_engines_admit_at_once_is_a_clear_400(server, body, param):
    """Without the check, the engine replica refuses such a request 429 +
    Retry-After however often its client retries, unless its first choices finish
    before its last are admitted (the batch of single choices here always got 429)."""
    r = httpx.post(server + "/v1/completions", timeout=60, json={**_greedy(0, 2, False), **body})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert is_openai_error(r.json()) and error["param"] == param
    assert f"at most {MAX_ENGINE_REQUESTS} at once" in error["message"], error["message"]


def test_as_many_choices_as_the_engines_admit_at_once_are_answered(server):
    r = httpx.post(server + "/v1/completions", timeout=120,
                   json={**_greedy(0, 2, False), "n": MAX_ENGINE_REQUESTS})
    assert r.status_code == 200, r.text[:300]
    assert len(r.json()["choices"]) == MAX_ENGINE_REQUESTS


def test_a_request_whose_sampling_raises_fails_alone(server, reference):
    url = server + "/v1/completions"
    handle = engine_handle()
    replica_id = _replica_id()
    handle.inject_fault.remote("slow", 0.02).result(timeout_s=30)  # the victim stays in flight

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            normal = [asyncio.ensure_future(stream_request(client, url, _greedy(i, 96)))
                      for i in range(3)]
            parser = StreamParser(keep_events=True)
            events = parser.events
            async with client.stream("POST", url, json=_greedy(3, VICTIM_TOKENS)) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    num_before = len(events)
                    parser.feed(line, 0.0)
                    if num_before == 0 and len(events) == 1:  # its sampling raises from its next step on
                        await asyncio.to_thread(lambda: handle.inject_fault.remote(
                            f"fail_request:{events[0]['id']}").result(timeout_s=30))
            return events, await asyncio.gather(*normal)

    try:
        events, normal = asyncio.run(run())
    finally:
        handle.inject_fault.remote("clear").result(timeout_s=30)
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and events[-1] is errors[0] and "[DONE]" not in events
    assert is_openai_error(errors[0]) and "injected fault" in errors[0]["error"]["message"]
    assert len(events) >= 2  # it streamed before it failed
    for i, r in enumerate(normal):
        assert r.done and not r.error_events and r.text == reference(96)[i]
    _assert_healthy_same_replica(server, replica_id)
    print(f"\nfailing sampling: the request ended after {len(events) - 1} text events with "
          f"one error event; {len(normal)} streams beside it complete; same replica")


_FLOAT_0_1 = st.one_of(st.sampled_from([0.0, 5e-324, 1e-300, 1.0]),
                       st.floats(0.0, 1.0, allow_nan=False))


@st.composite
def valid_bodies(draw) -> dict:
    """A valid request: every sampling field anywhere in its accepted range (edges
    first), temperature > 0 included; either endpoint, streaming or not."""
    chat = draw(st.booleans())
    max_tokens = draw(st.integers(1, 8))
    stream = draw(st.booleans())
    body = {"model": MODEL, "stream": stream,
            "max_tokens": max_tokens,
            "temperature": draw(st.one_of(
                st.sampled_from([0.0, 5e-324, 1e-300, 1e-5, 0.009, 100.0]),
                st.floats(0.0, 100.0, allow_nan=False))),
            "top_p": draw(st.one_of(st.sampled_from([5e-324, 1e-300, 1.0]),
                                    st.floats(1e-300, 1.0, allow_nan=False))),
            "top_k": draw(st.one_of(st.just(-1), st.sampled_from(
                [1, VOCAB_SIZE, VOCAB_SIZE + 1, 2**63 - 1]), st.integers(1, 2**63 - 1))),
            "min_p": draw(_FLOAT_0_1),
            "seed": draw(st.one_of(st.none(), st.sampled_from([0, 2**63 - 1]),
                                   st.integers(0, 2**63 - 1))),
            "presence_penalty": draw(st.floats(-2.0, 2.0, allow_nan=False)),
            "frequency_penalty": draw(st.floats(-2.0, 2.0, allow_nan=False)),
            "repetition_penalty": draw(st.one_of(st.sampled_from([5e-324, 1e-300, 2.0]),
                                                 st.floats(5e-324, 2.0, allow_nan=False))),
            "min_tokens": draw(st.integers(0, max_tokens)),
            "ignore_eos": draw(st.booleans()),
            "stop": draw(st.one_of(st.none(), st.lists(st.text(min_size=1, max_size=3),
                                                       max_size=3))),
            "stop_token_ids": draw(st.one_of(st.none(), st.lists(
                st.integers(0, VOCAB_SIZE - 1), max_size=4)))}
    if stream and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    if chat:
        body["messages"] = [{"role": "user", "content": draw(st.sampled_from(PROMPTS))}]
        if draw(st.booleans()):
            body["max_completion_tokens"] = body.pop("max_tokens")
        if draw(st.booleans()):
            body["logprobs"] = True
            body["top_logprobs"] = draw(st.integers(0, 20))
    else:
        body["prompt"] = draw(st.one_of(st.sampled_from(PROMPTS), st.lists(
            st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=8)))
        body["logprobs"] = draw(st.one_of(st.none(), st.integers(0, 20)))
    # Optional fields are sometimes left out (their defaults); the length stays short.
    for name in draw(st.sets(st.sampled_from(sorted(k for k in body if k not in (
            "model", "messages", "prompt", "stream", "stream_options", "max_tokens",
            "max_completion_tokens", "logprobs", "top_logprobs"))))):
        body.pop(name)
    return body


class _NormalStreams:
    """Greedy streams read to the end, one after another on each of `lanes` threads,
    while the fuzz runs; each must end with [DONE] and its offline text."""

    def __init__(self, server: str, expected: list[str], max_tokens: int, lanes: int = 2):
        self._url, self._expected, self._max_tokens = server + "/v1/completions", expected, \
            max_tokens
        self._stop = threading.Event()
        self.results: list[tuple[int, bool, str]] = []  # (prompt, ended with [DONE], text)
        self._threads = [threading.Thread(target=self._lane, args=(n,), daemon=True)
                         for n in range(lanes)]

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def _lane(self, n: int) -> None:
        async def run():
            async with httpx.AsyncClient(timeout=120) as client:
                i = n
                while not self._stop.is_set():
                    r = await stream_request(client, self._url,
                                             _greedy(i % len(PROMPTS), self._max_tokens))
                    self.results.append((i % len(PROMPTS), r.done and not r.error_events,
                                         r.text))
                    i += 1
        asyncio.run(run())


def test_fuzzed_valid_requests_never_5xx_and_normal_streams_complete(server, reference):
    replica_id = _replica_id()
    expected = reference(48)
    statuses: dict[int, int] = {}
    started = time.monotonic()
    with httpx.Client(timeout=120) as c, _NormalStreams(server, expected, 48) as normal:

        @settings(max_examples=NUM_FUZZED, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(valid_bodies())
        def check(body: dict):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            if body["stream"]:
                with c.stream("POST", server + path, json=body) as r:
                    status, text = r.status_code, r.read().decode()
                parsed = StreamParser.of(text)  # an error event or bad JSON sets .error
                events = parsed.events
                ok = status == 200 and events and events[-1] == "[DONE]" and not parsed.error \
                    and all(_all_finite(e) for e in events[:-1])
            else:
                r = c.post(server + path, json=body)
                status, text = r.status_code, r.text
                ok = status == 200 and _all_finite(r.json()) and r.json()["usage"][
                    "completion_tokens"] <= body.get("max_tokens",
                                                     body.get("max_completion_tokens", 16))
            statuses[status] = statuses.get(status, 0) + 1
            assert ok, (status, body, text[-400:])

        check()
    elapsed_s = time.monotonic() - started
    assert statuses == {200: NUM_FUZZED}, statuses
    assert len(normal.results) >= 2
    for i, done, text in normal.results:
        assert done and text == expected[i], (i, text)
    _assert_healthy_same_replica(server, replica_id)
    print(f"\n{sum(statuses.values())} fuzzed valid requests: statuses {statuses}; "
          f"{len(normal.results)} normal streams beside them, all complete and equal to the "
          f"offline text; same replica, /health 200 ({elapsed_s:.1f} s)")


def test_without_a_key_a_web_page_cannot_reach_the_api(server):
    """No-key loopback mode: a request for another host name (DNS rebinding) is
    refused, and a POST body a page could send without a CORS preflight
    (text/plain, a form) is not read."""
    url = server + "/v1/completions"
    body = json.dumps(_greedy(0, 2, stream=False))
    port = server.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", f"10.1.2.3:{port}"):
        r = httpx.post(url, content=body, headers={"host": host, "content-type": "application/json"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", r.text
        r = httpx.get(server + "/v1/models", headers={"host": host})
        assert r.status_code == 403, r.text
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"content-type": content_type} if content_type else {}
        r = httpx.post(url, content=body, headers=headers)
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost"):
        r = httpx.post(url, content=body, headers={"host": host, "content-type": "application/json"})
        assert r.status_code == 200, r.text
    assert httpx.get(server + "/health", headers={"host": "evil.example"}).status_code == 200
