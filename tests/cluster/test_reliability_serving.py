"""Reliability on a real local Ray (issue 6): overload, client disconnects, hostile
input and access. One app for the module (the `tiny` preset, one engine replica
with small queue bounds, an API key, a 64 KiB body limit); Serve and Ray always
shut down afterwards. Figures are printed for RELIABILITY.md (`pytest -s`)."""
from __future__ import annotations

import asyncio
import pathlib
import random
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from cluster_support import engine_handle, serve_app, wait_until
from fuzz_bodies import MAX_MODEL_LEN, hostile_bodies
from reliability_support import (engine_stats, gather_bounded, greedy_texts, is_idle,
                                 is_openai_error, stream_request)

pytestmark = [pytest.mark.ray, pytest.mark.shared_ray, pytest.mark.timeout(600)]

MODEL = "tiny"
API_KEY = "rel-key-7f3a9c"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_NUM_SEQS = 16
MAX_WAITING = 16
ENGINE_ARGS = {"max_num_seqs": MAX_NUM_SEQS, "num_kv_blocks": 512, "num_scheduler_steps": 4,
               "max_model_len": MAX_MODEL_LEN}
APP_ARGS = {"model": MODEL, "engine_num_cpus": 1, "ingress_num_cpus": 0.5, "num_threads": 1,
            "api_key": API_KEY, "max_waiting_requests": MAX_WAITING,
            "max_body_bytes": 64 * 1024, **ENGINE_ARGS}
PROMPTS = [f"Story {i}: the {['cat', 'dog', 'owl', 'fox'][i % 4]} went to" for i in range(8)]


@pytest.fixture(scope="module")
def server():
    with serve_app(APP_ARGS) as base:
        yield base


@pytest.fixture(scope="module")
def reference():
    """Greedy texts of PROMPTS from the offline engine, per max_tokens."""
    return greedy_texts(MODEL, ENGINE_ARGS, PROMPTS)


def _body(i: int, max_tokens: int, stream: bool) -> dict:
    return {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}


REFUSAL_BOUND_S = 15.0


def test_burst_past_the_bounds_is_refused_at_once_and_admitted_streams_complete(
        server, reference):
    num_requests, max_tokens = 8 * (MAX_NUM_SEQS + MAX_WAITING) // 2, 48
    expected = reference(max_tokens)
    handle = engine_handle()
    max_waiting_seen, stop = [0], threading.Event()

    def watch_queue():  # the engine's waiting queue never grows past its bound
        while not stop.is_set():
            max_waiting_seen[0] = max(max_waiting_seen[0],
                                      handle.stats.remote().result(timeout_s=30)["num_waiting"])
            time.sleep(0.05)

    async def one(client, i):
        started = time.monotonic()
        r = await stream_request(client, server + "/v1/completions", _body(i, max_tokens,
                                                                           i % 2 == 0))
        return i, r, time.monotonic() - started

    async def burst():
        limits = httpx.Limits(max_connections=num_requests)
        async with httpx.AsyncClient(timeout=300, headers=AUTH, limits=limits) as client:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, i) for i in range(num_requests))), 300)

    watcher = threading.Thread(target=watch_queue, daemon=True)
    watcher.start()
    try:
        results = asyncio.run(burst())
    finally:
        stop.set()
        watcher.join()
    admitted, refused, other = [], [], []
    for i, r, latency_s in results:
        if r.status == 200:
            admitted.append(latency_s)
            text = r.text if r.events else r.json()["choices"][0]["text"]
            assert text == expected[i % len(PROMPTS)], i  # complete, not truncated
            if r.events:
                assert r.done and not r.error_events and r.events[-2]["usage"][
                    "completion_tokens"] == max_tokens
            else:
                assert r.json()["usage"]["completion_tokens"] == max_tokens
        elif r.status == 429:
            refused.append(latency_s)
            assert int(r.headers["retry-after"]) >= 1
            body = r.json()
            assert is_openai_error(body) and body["error"]["type"] == "rate_limit_error"
        else:
            other.append((r.status, r.body[:200]))
    assert all(status == 503 for status, _ in other), other  # Serve's own queue limit only
    assert refused and len(admitted) >= MAX_NUM_SEQS
    assert max_waiting_seen[0] <= MAX_WAITING
    # At once: a refusal does not wait for the queue to drain (two waves of admitted
    # requests would): bounded by the ingress's own pace through the burst.
    assert max(refused) < REFUSAL_BOUND_S, sorted(refused)[-5:]
    print(f"\nburst of {num_requests} (bound {MAX_NUM_SEQS} running + {MAX_WAITING} waiting): "
          f"{len(admitted)} admitted and complete, {len(refused)} refused with 429, "
          f"{len(other)} Serve 503; median latency refused {_ms(refused)} vs admitted "
          f"{_ms(admitted)}; most waiting seen {max_waiting_seen[0]}")
    assert wait_until(lambda: all(is_idle(s) for s in engine_stats(handle).values()), 60)


def _ms(values: list[float]) -> str:
    return f"{sorted(values)[len(values) // 2] * 1000:.0f} ms" if values else "-"


def test_500_disconnects_at_random_points_free_everything(server, reference):
    num_disconnects, num_complete, max_tokens = 500, 24, 32
    expected = reference(max_tokens)
    handle = engine_handle()
    before = engine_stats(handle)
    rng = random.Random(6)
    plan = [("complete", 0)] * num_complete + [
        ("before_headers", 0) if rng.random() < 0.1 else ("hang_up", rng.randint(1, 12))
        for _ in range(num_disconnects)]
    rng.shuffle(plan)

    async def one(client, i, kind, after):
        url = server + "/v1/completions"
        for _ in range(100):  # a 429 (queue full) is retried: every stream must run
            if kind == "complete":
                r = await stream_request(client, url, _body(i, max_tokens, True))
            elif kind == "hang_up":
                r = await stream_request(client, url, _body(i, 400, True), hang_up_after_events=after)
            else:
                try:
                    r = await asyncio.wait_for(stream_request(client, url, _body(i, 400, True)),
                                               rng.uniform(0.0, 0.3))
                except asyncio.TimeoutError:
                    return kind, None
            if r.status != 429:
                return kind, (i, r)
            await asyncio.sleep(0.2)
        raise AssertionError("refused 100 times")

    async def run_all():
        async with httpx.AsyncClient(timeout=300, headers=AUTH) as client:
            return await gather_bounded([one(client, i, kind, after)
                                         for i, (kind, after) in enumerate(plan)], 24)

    started = time.monotonic()
    results = asyncio.run(run_all())
    elapsed_s = time.monotonic() - started
    num_hung_up = 0
    for kind, outcome in results:
        if kind == "complete":
            i, r = outcome
            assert r.status == 200 and r.done and not r.error_events
            assert r.text == expected[i % len(PROMPTS)]
        elif kind == "hang_up":
            _, r = outcome
            assert r.status == 200 and r.disconnected and not r.done
            num_hung_up += 1
    idle_at = time.monotonic()
    assert wait_until(lambda: all(is_idle(s) for s in engine_stats(handle).values()), 60), \
        engine_stats(handle)
    after = engine_stats(handle)
    (rid, stats), = after.items()
    cancelled = stats["num_requests_cancelled"] - before[rid]["num_requests_cancelled"]
    assert cancelled >= num_hung_up  # each hang-up reached the replica and aborted there
    print(f"\n{num_disconnects} disconnects ({num_hung_up} mid-stream, "
          f"{num_disconnects - num_hung_up} before the headers) + {num_complete} complete "
          f"streams in {elapsed_s:.1f} s; afterwards running {stats['num_running']}, waiting "
          f"{stats['num_waiting']}, free blocks {stats['num_free_blocks']}/"
          f"{stats['num_total_blocks']} ({time.monotonic() - idle_at:.2f} s after the last)")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_hostile_bodies_get_4xx_in_openai_shape_never_5xx(server, path):
    statuses: dict[int, int] = {}
    with httpx.Client(timeout=60, headers={**AUTH, "content-type": "application/json"}) as c:

        @settings(max_examples=200, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(hostile_bodies(chat=path.endswith("chat/completions")))
        def check(body: bytes):
            r = c.post(server + path, content=body)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert 400 <= r.status_code < 500, (r.status_code, body[:300], r.text[:300])
            assert is_openai_error(r.json()), r.text[:300]
            assert "Traceback" not in r.text and API_KEY not in r.text

        check()
        ok = c.post(server + path, json={"model": MODEL, "max_tokens": 3, "temperature": 0, **(
            {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
            else {"prompt": "Once upon a time"})})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    print(f"\n{path}: {sum(statuses.values())} hostile bodies, statuses {dict(sorted(statuses.items()))}")


def test_body_over_the_limit_is_413_declared_or_streamed(server):
    big = b'{"model": "tiny", "prompt": "' + b"a " * 40_000 + b'"}'

    def chunks():
        for i in range(0, len(big), 4096):
            yield big[i:i + 4096]
    for content in (big, chunks()):  # with a Content-Length, and chunked without one
        r = httpx.post(server + "/v1/completions", content=content, timeout=60,
                       headers={**AUTH, "content-type": "application/json"})
        assert r.status_code == 413 and is_openai_error(r.json()), r.text[:200]


# NOTE: seconds of decoding here: it must not end before the close reaches the engine
MAX_ANSWER_TOKENS = MAX_MODEL_LEN - 32


def test_a_non_streamed_request_whose_client_leaves_is_aborted(server):
    """Through Serve's Python proxy: nothing is written until the answer is complete,
    so only the client's close tells the ingress (RELIABILITY.md, promise 2: behind
    HAProxy that close does not always come through)."""
    handle = engine_handle()
    before, = engine_stats(handle).values()

    async def leave_once_running():
        async with httpx.AsyncClient(timeout=300, headers=AUTH) as client:
            post = asyncio.ensure_future(client.post(server + "/v1/completions",
                                                     json=_body(0, MAX_ANSWER_TOKENS, False)))
            running = await asyncio.to_thread(wait_until, lambda: next(iter(
                engine_stats(handle).values()))["num_running"] > 0, 60)
            post.cancel()  # the client leaves: its connection closes
            await asyncio.gather(post, return_exceptions=True)
            return running

    assert asyncio.run(leave_once_running()), "the request never ran"
    assert wait_until(lambda: all(is_idle(s) for s in engine_stats(handle).values()), 30)
    after, = engine_stats(handle).values()
    assert after["num_requests_cancelled"] == before["num_requests_cancelled"] + 1
    assert after["num_requests_finished"] == before["num_requests_finished"]


ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
          ("GET", "/v1/models/tiny"), ("GET", "/"), ("GET", "/docs"), ("GET", "/openapi.json"),
          ("GET", "/metrics"), ("PUT", "/v1/completions"), ("DELETE", "/v1/models"),
          ("PATCH", "/x"), ("POST", "/health"), ("GET", "/health/x"), ("GET", "/HEALTH")]


def test_every_route_but_health_needs_the_key_and_no_key_leaks(server):
    wrong = [{}, {"Authorization": "Bearer"}, {"Authorization": "Bearer wrong"},
             {"Authorization": f"Bearer {API_KEY}x"}, {"Authorization": f"Bearer {API_KEY[:-1]}"},
             {"Authorization": API_KEY}, {"Authorization": f"Basic {API_KEY}"},
             {"X-Api-Key": API_KEY}]
    with httpx.Client(timeout=60) as c:
        for headers in wrong:
            for method, path in ROUTES:
                r = c.request(method, server + path, headers=headers, json={"model": MODEL})
                assert r.status_code == 401, (method, path, headers, r.status_code)
                assert r.json()["error"]["code"] == "invalid_api_key"
                assert API_KEY not in r.text
        assert c.get(server + "/health").status_code == 200
        assert c.get(server + "/v1/nowhere", headers=AUTH).status_code == 404
        assert c.get(server + "/v1/models", headers={"Authorization": f"bearer {API_KEY}"}
                     ).status_code == 200
    import ray

    log_dir = pathlib.Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    leaks = [str(p) for p in log_dir.rglob("*") if p.is_file() and API_KEY.encode() in
             p.read_bytes()]
    assert not leaks, leaks


def test_replica_refuses_inject_fault_unless_enabled(server):
    """This app does not enable fault injection: every fault is refused through the
    handle, and the replica keeps serving."""
    handle = engine_handle()
    for kind in ("raise", "hang", "slow", "fail_request:x", "clear"):
        with pytest.raises(Exception, match="fault injection is disabled"):
            handle.inject_fault.remote(kind).result(timeout_s=30)
    r = httpx.post(server + "/v1/completions", headers=AUTH, timeout=60, json=_body(0, 4, False))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_key_compared_as_sha256_digests_in_constant_time(monkeypatch):
    import hashlib
    from types import SimpleNamespace

    from cluster.api import ingress

    calls = []
    real = ingress.hmac.compare_digest
    monkeypatch.setattr(ingress.hmac, "compare_digest",
                        lambda a, b: calls.append((a, b)) or real(a, b))
    from cluster.api.access import key_sha256_hex

    digest = bytes.fromhex(key_sha256_hex(API_KEY, None))
    assert digest == hashlib.sha256(API_KEY.encode()).digest()
    assert key_sha256_hex(None, digest.hex()) == digest.hex()  # api_key_sha256: no key in configs
    for token, ok in ((API_KEY, True), ("x", False), (API_KEY * 10, False)):
        request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(
            api_key_digest=digest)), headers={"authorization": f"Bearer {token}"})
        assert ingress._is_authorized(request) is ok
    assert len(calls) == 3 and all(len(a) == len(b) == 32 for a, b in calls)


def test_trust_remote_code_does_not_exist():
    """We never execute code from a checkpoint: configs are read as data, tokenizers
    by `tokenizers`, chat templates in a sandboxed jinja2. No flag to turn it on."""
    from pydantic import ValidationError

    from cluster.app import AppArgs

    with pytest.raises(ValidationError):
        AppArgs(trust_remote_code=True)
    root = pathlib.Path(__file__).resolve().parents[2]
    users = [str(p) for d in ("cluster", "replicas", "deltas") for p in (root / d).rglob("*.py")
             if "trust_remote_code" in p.read_text()]
    assert not users, users
