"""The whole path on a real local Ray: OpenAI client -> Serve proxy -> Ingress ->
two EngineReplicas (the `tiny` preset on CPU) and back, compared with the offline
engine. One app for the module; Serve and Ray always shut down afterwards."""
from __future__ import annotations

import asyncio
import json
import math
import re
import time

import httpx
import jsonschema
import pytest

from cluster_support import engine_handle, serve_app, wait_until
from loadtests.serving.client_wait import ClientWait
from loadtests.serving.openai_stream import StreamParser
from metrics_support import dashboard, dashboard_queries, names_in, scrape
from reliability_support import pinned_stats
from structured_output_schemas import SCHEMAS

pytestmark = [pytest.mark.ray, pytest.mark.shared_ray, pytest.mark.timeout(900)]

MODEL = "tiny"
ENGINE_ARGS = {"max_num_seqs": 64, "num_kv_blocks": 1024, "num_scheduler_steps": 4,
               "max_model_len": 2048}
API_KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
APP_ARGS = {"model": MODEL, "num_engine_replicas": 2, "engine_num_cpus": 1,
            "ingress_num_cpus": 0.5, "num_threads": 1, "api_key": API_KEY, **ENGINE_ARGS}
PROMPT = "Once upon a time there was a little"


@pytest.fixture(scope="module")
def server():
    # NOTE: Ray exports what workers record every 10 s by default; the shared Ray
    # exports every second (cluster_support.SHARED_RAY_SYSTEM_CONFIG) for the metrics tests.
    with serve_app(APP_ARGS) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    with OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def offline():
    from replicas import Engine, EngineConfig

    return Engine(EngineConfig(model=MODEL, **ENGINE_ARGS))


@pytest.fixture(scope="module")
def tokenizer():
    from deltas.tokenization.tokenizer import Tokenizer
    from replicas.checkpoints.presets import resolve_tokenizer_dir

    return Tokenizer.from_dir(resolve_tokenizer_dir(MODEL))


def reference(offline, tokenizer, prompt_ids: list[list[int]], **params):
    """(text, token_ids) per prompt from the offline engine."""
    from replicas import SamplingParams

    outs = offline.generate(prompt_ids, SamplingParams(**params))
    return [(tokenizer.decode(o.token_ids), list(o.token_ids)) for o in outs]


def all_replica_stats() -> dict[str, dict]:
    """The latest stats of every engine replica, each asked directly.

    NOTE: unpinned calls go where the router's cached queue lengths say, so while one
    replica streams they all land on the other one until that cache expires (10 s)."""
    return pinned_stats(engine_handle())


def engines_idle() -> bool:
    stats = all_replica_stats()
    return len(stats) == 2 and all(
        s["num_running"] == 0 and s["num_waiting"] == 0
        and s["num_free_blocks"] == s["num_total_blocks"] for s in stats.values())


def test_health_and_models(server, client):
    health = httpx.get(server + "/health").json()  # no key needed
    assert health == {"status": "ok", "num_healthy_replicas": 2, "num_replicas": 2,
                      "unhealthy_replicas": {}}, health
    head = httpx.head(server + "/health")
    assert head.status_code == 200 and head.content == b""
    # NOTE: the first request of this module: the card has the context length before
    # any generation asked the engine for it
    models = httpx.get(server + "/v1/models", headers=AUTH).json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert models["data"][0]["max_model_len"] > 0
    one = httpx.get(server + f"/v1/models/{MODEL}", headers=AUTH)
    assert one.status_code == 200 and one.json() == models["data"][0]
    assert client.models.retrieve(MODEL).id == MODEL
    other = httpx.get(server + "/v1/models/gpt-4o", headers=AUTH)
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"


def test_completion_stream_and_non_stream_equal_offline(client, offline, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    (ref_text, ref_ids), = reference(offline, tokenizer, [prompt_ids], temperature=0.0,
                                     max_tokens=24)
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert full.choices[0].text == ref_text
    assert full.usage.prompt_tokens == len(prompt_ids)
    assert full.usage.completion_tokens == len(ref_ids)
    assert full.usage.total_tokens == len(prompt_ids) + len(ref_ids)

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref_text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # include_usage not asked for


def test_same_seed_same_text_as_offline(client, offline, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    (ref_text, _), = reference(offline, tokenizer, [prompt_ids], temperature=1.0, seed=1234,
                               max_tokens=20)
    texts = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20,
                                       temperature=1.0, seed=1234).choices[0].text
             for _ in range(2)]
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20,
                                       temperature=1.0, seed=1234, stream=True)
    texts.append("".join(c.choices[0].text for c in stream))
    assert texts == [ref_text] * 3
    other = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20,
                                      temperature=1.0, seed=99).choices[0].text
    assert other != ref_text  # the seed matters (20 sampled tokens of 8k)


def test_chat_stream_with_include_usage_equals_non_stream_and_offline(client, offline,
                                                                      tokenizer):
    messages = [{"role": "system", "content": "You tell stories."},
                {"role": "user", "content": "A story about a fox, please."}]
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages),
                                  add_special_tokens=False)
    (ref_text, ref_ids), = reference(offline, tokenizer, [prompt_ids], temperature=0.0,
                                     max_tokens=16)
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                          temperature=0)
    assert full.choices[0].message.content == ref_text
    assert full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref_text
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens) == \
        (len(prompt_ids), len(ref_ids))
    assert all(c.usage is None for c in chunks[:-1])


def test_logprobs_one_per_token(client, offline, tokenizer):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                    logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens == 6
    assert all(v <= 0.0 for v in lp.token_logprobs)
    assert all(len(top) >= 1 for top in lp.top_logprobs)
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                          messages=messages, logprobs=True, top_logprobs=2)
    assert len(chat.choices[0].logprobs.content) == 4
    # Streamed, each token's `bytes` are its own, also where it holds part of a UTF-8
    # character (its text alone is U+FFFD): logit_bias lifts the byte tokens of an emoji.
    emoji_ids = tokenizer.encode("\U0001F600", add_special_tokens=False)
    assert len(emoji_ids) > 1
    bias = {i: 100.0 for i in emoji_ids}
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages),
                                  add_special_tokens=False)
    (_, ref_ids), = reference(offline, tokenizer, [prompt_ids], temperature=0.0, max_tokens=12,
                              logit_bias=tuple(bias.items()))
    chunks = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0,
                                            messages=messages, logprobs=True, stream=True,
                                            logit_bias={str(i): b for i, b in bias.items()})
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert set(ref_ids) <= set(emoji_ids) and {e.token for e in entries} == {"\ufffd"}
    assert [e.bytes for e in entries] == [list(tokenizer.token_bytes(t)) for t in ref_ids]


def test_64_concurrent_streams_each_equal_offline(server, offline, tokenizer):
    from openai import AsyncOpenAI

    prompts = [f"Story number {i}: the {['cat', 'dog', 'owl', 'fox'][i % 4]} went to"
               for i in range(64)]
    refs = reference(offline, tokenizer, [tokenizer.encode(p) for p in prompts],
                     temperature=0.0, max_tokens=32)

    async def one(client, prompt):
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=32,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True})
        parts, usage = [], None
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].text)
            if chunk.usage is not None:
                usage = chunk.usage
        return "".join(parts), usage.completion_tokens

    async def run_all():
        async with AsyncOpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0,
                               timeout=300) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(run_all())
    assert [text for text, _ in results] == [text for text, _ in refs]
    assert [n for _, n in results] == [len(ids) for _, ids in refs]


def test_two_engine_replicas_share_load(server):
    before = {rid: s["num_requests_admitted"] for rid, s in all_replica_stats().items()}
    assert len(before) == 2

    async def burst():
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as c:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 48, "temperature": 0}
            return await asyncio.gather(*(c.post(server + "/v1/completions", json=body)
                                          for _ in range(24)))

    assert all(r.status_code == 200 for r in asyncio.run(burst()))
    after = {rid: s["num_requests_admitted"] for rid, s in all_replica_stats().items()}
    served = {rid: after[rid] - before.get(rid, 0) for rid in after}
    assert sum(served.values()) == 24
    assert all(n > 0 for n in served.values()), served


def test_prompts_sharing_a_long_prefix_meet_on_one_replica(server):
    stats = all_replica_stats()
    before = {rid: s["num_requests_admitted"] for rid, s in stats.items()}
    hits_before = sum(s["num_prefix_cache_hit_tokens"] for s in stats.values())
    system = list(range(300, 560))  # a 260-token shared prefix: 16 whole blocks
    with httpx.Client(timeout=120, headers=AUTH) as c:
        for i in range(8):
            body = {"model": MODEL, "prompt": system + [10 + i, 20 + i], "max_tokens": 2,
                    "temperature": 0}
            assert c.post(server + "/v1/completions", json=body).status_code == 200
    stats = all_replica_stats()
    served = {rid: s["num_requests_admitted"] - before.get(rid, 0) for rid, s in stats.items()}
    assert sum(served.values()) == 8
    # NOTE: the first may go elsewhere when the router still holds queue lengths from
    # the last test's burst that look imbalanced; the rest follow the prefix.
    assert max(served.values()) >= 7, served
    hits = sum(s["num_prefix_cache_hit_tokens"] for s in stats.values()) - hits_before
    assert hits >= 6 * 256, hits


def _disconnect_mid_stream(server, body: dict, after_events: int,
                           while_open=lambda: None) -> tuple[int, float]:
    """Stream `body` and close the connection after `after_events` SSE events (and
    `while_open()`). Returns the requests cancelled on the replicas meanwhile, and
    the seconds from the close until the engines were idle (blocks freed)."""
    assert wait_until(engines_idle, timeout_s=30)
    cancelled_before = sum(s["num_requests_cancelled"] for s in all_replica_stats().values())
    with httpx.Client(timeout=60, headers=AUTH) as c:
        with c.stream("POST", server + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines, parser = r.iter_lines(), StreamParser()
            while parser.num_events < after_events:
                parser.feed(next(lines), 0.0)
            while_open()
            disconnected_at = time.monotonic()
    assert wait_until(engines_idle, timeout_s=30), all_replica_stats()
    freed_after_s = time.monotonic() - disconnected_at
    cancelled = sum(s["num_requests_cancelled"] for s in all_replica_stats().values())
    return cancelled - cancelled_before, freed_after_s


def _one_request_running() -> None:
    assert any(s["num_running"] == 1 for s in all_replica_stats().values())


def test_client_disconnect_aborts_on_replica_and_frees_blocks(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1900, "temperature": 0,
            "ignore_eos": True, "stream": True}
    cancelled, freed_after_s = _disconnect_mid_stream(server, body, 5, _one_request_running)
    assert cancelled == 1
    # 1900 tokens would take far longer than this at the tiny model's pace.
    assert sum(s["num_deltas_sent"] for s in all_replica_stats().values()) > 0
    print(f"disconnect -> request aborted and blocks free after {freed_after_s * 1000:.0f} ms")


def test_stop_string_across_tokens_cuts_text_and_stops_replica(client, offline, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    (text, ids), = reference(offline, tokenizer, [prompt_ids], temperature=0.0, max_tokens=40,
                             ignore_eos=True)
    # A stop string that spans the boundary between two tokens of the greedy output.
    for k in range(3, 30):
        head = tokenizer.decode(ids[:k])
        left, right = head[-2:], text[len(head):len(head) + 2]
        stop = left + right
        if len(left) == 2 and len(right) == 2 and stop.strip() and text.find(stop) == len(head) - 2:
            break
    else:
        pytest.skip("no token boundary with 2+2 printable characters in this output")
    cancelled_before = sum(s["num_requests_cancelled"] for s in all_replica_stats().values())
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1500, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].text == text[:text.find(stop)]
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == k + 1  # up to the token that completed the stop
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1500,
                                         temperature=0, stop=[stop], stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == text[:text.find(stop)]
    # The replica stopped generating: both requests were aborted, nothing is running.
    assert wait_until(engines_idle, timeout_s=30)
    stats = all_replica_stats()
    assert sum(s["num_requests_cancelled"] for s in stats.values()) == cancelled_before + 2


LONG_PROMPT_IDS = [100] * 2100  # > max_model_len (2048)

BAD_REQUESTS = [
    # (path, body (dict or raw bytes), status, param)
    ("/v1/completions", {"prompt": "x"}, 400, "model"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": 42}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 1000}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 129}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "whatever": 1}, 400, "whatever"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": LONG_PROMPT_IDS}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 99999]}, 400, "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": ', 400, None),
    ("/v1/completions", b"[1, 2, 3]", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", b'{"model":"tiny","prompt":"x","temperature":NaN}', 400, "temperature"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "x", "content": "y"}]},
     400, "messages.0.role"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/nowhere", {"model": MODEL}, 404, None),
]


def test_min_tokens_holds_back_stop_strings_too(client, offline, tokenizer):
    """A stop string inside the first min_tokens tokens does not end the answer: it
    ends at the first one after them, as the engine holds EOS and stop ids back."""
    prompt_ids = tokenizer.encode(PROMPT)
    (text, ids), = reference(offline, tokenizer, [prompt_ids], temperature=0.0, max_tokens=40,
                             ignore_eos=True)
    early = tokenizer.decode(ids[:3])
    stop = next((c for c in early if c.strip()), None)
    if stop is None:
        pytest.skip("no printable character in the first tokens of this output")
    min_tokens = 12
    free = tokenizer.decode(ids[:min_tokens])
    after = text.find(stop, len(free))
    expected = text if after < 0 else text[:after]
    for stream in (False, True):
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40,
                                        temperature=0, stop=[stop], stream=stream,
                                        extra_body={"ignore_eos": True, "min_tokens": min_tokens})
        got = "".join(c.choices[0].text for c in out) if stream else out.choices[0].text
        assert got == expected and len(got) >= len(free)


def test_bad_requests_get_openai_errors_and_server_keeps_serving(server, client):
    with httpx.Client(timeout=60, headers=AUTH) as c:
        for path, body, status, param in BAD_REQUESTS:
            kwargs = {"content": body, "headers": {"content-type": "application/json"}} \
                if isinstance(body, bytes) else {"json": body}
            r = c.post(server + path, **kwargs)
            assert r.status_code == status, (path, body if isinstance(body, bytes) else
                                             json.dumps(body)[:80], r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, r.text
            assert error["message"] and "Traceback" not in r.text
            assert error["param"] == param, r.text
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": LONG_PROMPT_IDS},
                   headers=AUTH)
    assert "2048" in r.json()["error"]["message"] and "2100" in r.json()["error"]["message"]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4


def test_a_huge_prompt_is_refused_without_stalling_other_requests(server):
    huge = "word " * 760_000  # 3.8 MB: far more than the context can hold

    async def run():
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as c:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            stream = asyncio.ensure_future(c.post(server + "/v1/completions", json=body))
            huge_r = await c.post(server + "/v1/completions",
                                  json={"model": MODEL, "prompt": huge, "max_tokens": 4})
            models = await c.get(server + "/v1/models")
            return huge_r, models, await stream

    huge_r, models, stream = asyncio.run(run())
    assert huge_r.status_code == 400, huge_r.text
    error = huge_r.json()["error"]
    assert error["code"] == "context_length_exceeded" and "characters" in error["message"]
    assert models.status_code == 200
    assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")


# NOTE: under the character bound (2048 tokens x 65 characters a token at most x 4), so
# it reaches the tokenizer: 1.5M byte-level tokens, about 0.6 s of tokenizing here.
SLOW_TO_TOKENIZE = "".join(chr(0x4E00 + (i * 7919) % 0x51FF) for i in range(500_000))
MAX_STREAM_GAP_S = 0.45  # at least: three quarters of the tokenizing time on a slower machine


def test_tokenizing_a_long_prompt_does_not_stall_other_streams(server, tokenizer):
    """The tokenizer runs off the event loop: a concurrent stream's largest gap between
    events stays under the time the long prompt takes to tokenize.

    NOTE: three quarters of it: a tokenizer on the loop stalls the stream for all of
    it; beside the suite's other lanes a gap of 0.56 of it was seen without one."""
    started = time.monotonic()
    tokenizer.encode(SLOW_TO_TOKENIZE)
    max_gap_s = max(MAX_STREAM_GAP_S, 0.75 * (time.monotonic() - started))
    async def run():
        own_wait = ClientWait().start()
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as c:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 300, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            arrivals, big, parser = [], None, StreamParser()
            async with c.stream("POST", server + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    num_before = parser.num_events
                    parser.feed(line, 0.0)
                    if parser.num_events > num_before:
                        arrivals.append(time.monotonic())
                    if len(arrivals) == 3:
                        big = asyncio.ensure_future(c.post(
                            server + "/v1/completions",
                            json={"model": MODEL, "prompt": SLOW_TO_TOKENIZE, "max_tokens": 4}))
            big = await big
        own_wait.take()
        return arrivals, big, own_wait

    arrivals, big, own_wait = asyncio.run(run())
    assert big.status_code == 400, big.text[:300]
    error = big.json()["error"]
    # refused after tokenizing: the message counts tokens, not characters
    assert error["code"] == "context_length_exceeded" and "1500" in error["message"], error
    # NOTE: less the time this test's own loop was stalled within each gap (it shares
    # the cores with the server; loadtests/serving/client_wait.py): that part is not the server's
    gaps = own_wait.gaps_less_stalls(arrivals)
    print(f"\nlargest gap of a concurrent stream while 1.5M tokens were made: {max(gaps):.3f} s"
          f" (bound {max_gap_s:.2f} s; the reader's own stalls taken out)")
    assert max(gaps) < max_gap_s, sorted(gaps)[-5:]


def test_api_key_required_everywhere_but_health(server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                    {"Authorization": f"Basic {API_KEY}"}):
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("GET", "/v1/models"), ("GET", "/v1/unknown"), ("GET", "/")):
            r = httpx.request(method, server + path, json=body, headers=headers)
            assert r.status_code == 401, (method, path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert API_KEY not in r.text
    assert httpx.get(server + "/health").status_code == 200
    assert httpx.post(server + "/v1/completions", json=body, headers=AUTH).status_code == 200


def test_post_bodies_must_be_json_with_a_key_too(server):
    """As the OpenAI API does: 415 for a body that is not application/json (after the
    key check), whatever it holds; with a key any Host may be served."""
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2})
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {**AUTH, **({"content-type": content_type} if content_type else {})}
        r = httpx.post(server + "/v1/completions", content=body, headers=headers)
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    assert httpx.post(server + "/v1/completions", content=body, headers={"content-type": "text/plain"}
                      ).status_code == 401
    r = httpx.post(server + "/v1/completions", content=body,
                   headers={**AUTH, "content-type": "application/json; charset=utf-8",
                            "host": "api.example.com"})
    assert r.status_code == 200, r.text


def test_metrics_are_exported_for_prometheus(server):
    wanted = ["stepstream_requests", "stepstream_time_to_first_token_seconds",
              "stepstream_inter_chunk_latency_seconds", "stepstream_time_per_output_token_seconds",
              "stepstream_num_requests_running", "stepstream_num_requests_waiting",
              "stepstream_kv_cache_usage", "stepstream_replica_step_messages",
              "stepstream_replica_deltas_sent", "stepstream_tokens_per_event"]

    def missing():
        names = scrape()
        return [w for w in wanted if not any(w in name for name in names)]

    assert wait_until(lambda: not missing(), timeout_s=60, interval_s=2), missing()


TOKEN_SERIES = ("ray_stepstream_requests_total", "ray_stepstream_prompt_tokens_total",
                "ray_stepstream_output_tokens_total")


def _scraped_totals() -> dict[str, float]:
    totals = scrape()
    return {name: totals.get(name, 0.0) for name in TOKEN_SERIES}


def test_non_streaming_requests_count_their_tokens(server):
    """`stream: false` moves the token counters by the usage it answers with."""
    # NOTE: Ray exports what workers recorded every second here (see `server`):
    # start from totals that held still over more than one export, so no earlier
    # test's tokens arrive in between.
    before = _scraped_totals()
    for _ in range(15):
        time.sleep(2.5)
        now = _scraped_totals()
        if now == before:
            break
        before = now
    r = httpx.post(server + "/v1/completions", headers=AUTH, timeout=60, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 9, "ignore_eos": True,
        "temperature": 0, "stream": False})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    expected = {"ray_stepstream_requests_total": 1.0,
                "ray_stepstream_prompt_tokens_total": float(usage["prompt_tokens"]),
                "ray_stepstream_output_tokens_total": float(usage["completion_tokens"])}

    def moved() -> dict[str, float]:
        now = _scraped_totals()
        return {name: now[name] - before[name] for name in TOKEN_SERIES}

    assert wait_until(lambda: moved()["ray_stepstream_requests_total"] >= 1, timeout_s=60,
                      interval_s=1)
    assert moved() == expected


def test_every_name_the_dashboard_queries_is_scraped(server):
    """configs/grafana/stepstream.json's queries find series in a real scrape."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", headers=AUTH, json=body,
                      timeout=60) as r:
        assert r.status_code == 200 and "[DONE]" in "".join(r.iter_text())
    wanted = names_in(dashboard_queries(dashboard()))

    def missing() -> set[str]:
        return wanted - set(scrape())

    assert wait_until(lambda: not missing(), timeout_s=60, interval_s=2), sorted(missing())


def test_serve_routes_outside_the_key_reveal_only_the_route_table(server):
    """The front door answers these itself, before the app (RELIABILITY.md, 6)."""
    routes = httpx.get(server + "/-/routes")
    assert routes.status_code == 200 and routes.json() == {"/": "stepstream"}
    health = httpx.get(server + "/-/healthz")
    assert health.status_code == 200 and len(health.text) < 64


def _prefix_cache_hit_tokens() -> int:
    return sum(s["num_prefix_cache_hit_tokens"] for s in all_replica_stats().values())


def test_n_seeded_choices_share_the_prompt_and_equal_offline(client, offline, tokenizer):
    from openai.types import Completion

    # NOTE: a prompt no earlier test sent, of two full KV blocks and more: the first
    # choice computes it, the other two find its blocks in the prefix cache.
    prompt = f"Choice test {time.time_ns()}: " + "the fox ran over the hill and far away " * 3
    prompt_ids = tokenizer.encode(prompt)
    assert len(prompt_ids) > 2 * 16
    refs = [reference(offline, tokenizer, [prompt_ids], temperature=1.0, seed=1234 + i,
                      max_tokens=12)[0] for i in range(3)]
    assert len({text for text, _ in refs}) == 3
    assert wait_until(engines_idle, timeout_s=30)
    hits_before = _prefix_cache_hit_tokens()
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0,
                                     seed=1234, n=3)
    assert isinstance(full, Completion)
    assert [c.index for c in full.choices] == [0, 1, 2]
    assert [c.text for c in full.choices] == [text for text, _ in refs]
    assert all(c.finish_reason == "length" for c in full.choices)
    assert full.usage.prompt_tokens == len(prompt_ids)
    assert full.usage.completion_tokens == sum(len(ids) for _, ids in refs) == 36
    assert full.usage.total_tokens == len(prompt_ids) + 36
    assert _prefix_cache_hit_tokens() - hits_before >= 2 * 2 * 16

    texts, finishes, usage = {}, {}, None
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                           temperature=1.0, seed=1234, n=3, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {i: refs[i][0] for i in range(3)}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), 36)


def test_a_batch_of_prompts_answers_n_seeded_choices_each_as_offline(client, server, offline,
                                                                     tokenizer):
    """`prompt` as a list (of token ids, or of strings): each prompt's `n` choices,
    indexed prompt by prompt (as OpenAI and vLLM order them), each as the same prompt
    alone; usage counts each prompt once; one prompt past the context refuses the
    whole batch, naming it."""
    prompts = ["The owl said", "A long road went over the hills and"]
    token_prompt = tokenizer.encode("Far away in the north")
    prompts_ids = [tokenizer.encode(p) for p in prompts] + [token_prompt]
    refs = [reference(offline, tokenizer, [ids], temperature=1.0, seed=99 + i, max_tokens=6)[0]
            for ids in prompts_ids for i in range(2)]
    full = client.completions.create(model=MODEL, prompt=prompts_ids, n=2, max_tokens=6,
                                     temperature=1.0, seed=99)
    assert [c.index for c in full.choices] == list(range(6))
    assert [c.text for c in full.choices] == [text for text, _ in refs]
    assert full.usage.prompt_tokens == sum(len(ids) for ids in prompts_ids)
    assert full.usage.completion_tokens == 36

    texts, usage = {}, None
    for chunk in client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6,
                                           temperature=1.0, seed=99, stream=True,
                                           stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {i: refs[i][0] for i in range(4)}
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        sum(len(ids) for ids in prompts_ids[:2]), 24)

    too_long = [1] * 3000  # past the context of 2,048
    r = httpx.post(f"{server}/v1/completions", headers=AUTH, timeout=30, json={
        "model": MODEL, "prompt": [prompts_ids[0], too_long], "max_tokens": 4})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("Prompt 1 of the batch: ")
    assert r.json()["error"]["param"] == "prompt"
    r = httpx.post(f"{server}/v1/completions", headers=AUTH, timeout=30, json={
        "model": MODEL, "prompt": ["a"] * 65, "n": 2, "max_tokens": 4})
    assert r.status_code == 400 and "130 choices" in r.json()["error"]["message"], r.text


def test_continuous_usage_carries_each_chunks_count_so_far(client, offline, tokenizer):
    """stream_options.continuous_usage_stats (vLLM's): every text chunk carries its
    choice's prompt tokens and output tokens so far, ending at the output's length."""
    prompt_ids = tokenizer.encode(PROMPT)
    (ref_text, ref_ids), = reference(offline, tokenizer, [prompt_ids], temperature=0.0,
                                     max_tokens=10)
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == ref_text
    counts = [c.usage.completion_tokens for c in text_chunks]
    assert counts == sorted(counts) and counts[-1] == len(ref_ids) == 10
    assert {c.usage.prompt_tokens for c in text_chunks} == {len(prompt_ids)}
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 10


def test_n_chat_choices_stream_and_not(client):
    messages = [{"role": "user", "content": "Tell me about foxes."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, n=3,
                                          temperature=1.0, seed=7)
    assert [c.index for c in full.choices] == [0, 1, 2]
    assert len({c.message.content for c in full.choices}) == 3
    assert all(c.message.role == "assistant" for c in full.choices)
    assert full.usage.completion_tokens == 24
    texts, roles, usage = {}, {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                n=3, temperature=1.0, seed=7, stream=True,
                                                stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.delta.role:
                roles[c.index] = c.delta.role
    assert texts == {c.index: c.message.content for c in full.choices}
    assert roles == {0: "assistant", 1: "assistant", 2: "assistant"}
    assert (usage.prompt_tokens, usage.completion_tokens) == (full.usage.prompt_tokens, 24)


def test_client_disconnect_aborts_every_choice(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1900, "temperature": 1.0,
            "ignore_eos": True, "stream": True, "n": 3}
    assert _disconnect_mid_stream(server, body, 9)[0] == 3


def test_logit_bias_bans_and_forces_tokens(client, offline, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    (plain_text, plain_ids), = reference(offline, tokenizer, [prompt_ids], temperature=0.0,
                                         max_tokens=8)
    banned = {plain_ids[0]: -100.0}
    (ref_text, ref_ids), = reference(offline, tokenizer, [prompt_ids], temperature=0.0,
                                     max_tokens=8, logit_bias=banned)
    assert ref_ids[0] != plain_ids[0]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                    logit_bias={str(t): b for t, b in banned.items()})
    assert out.choices[0].text == ref_text != plain_text
    forced = tokenizer.encode(" fox", add_special_tokens=False)[0]
    chat = client.chat.completions.create(model=MODEL, max_tokens=5, temperature=1.0,
                                          messages=[{"role": "user", "content": "hi"}],
                                          logit_bias={str(forced): 100})
    assert chat.choices[0].message.content == tokenizer.decode([forced] * 5)
    r = httpx.post(client.base_url.join("completions").__str__(), headers=AUTH,
                   json={"model": MODEL, "prompt": "x", "logit_bias": {"99999": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


# -- structured outputs: response_format and the structured_outputs extension --

STRUCTURED_MESSAGES = [{"role": "user", "content": "Describe a user as JSON."}]


def _schema_format(name):
    return {"type": "json_schema",
            "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_chat_json_schema_streamed_and_not_validate(client, name):
    for seed in (1, 2):
        kwargs = dict(model="tiny", messages=STRUCTURED_MESSAGES, max_tokens=160, seed=seed,
                      response_format=_schema_format(name))
        whole = client.chat.completions.create(**kwargs)
        assert whole.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(whole.choices[0].message.content), SCHEMAS[name])
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content  # same seed, same output
        # per-step streaming: the text arrives in pieces, not in one event at the end
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2


def test_completions_json_schema_and_json_object(client):
    out = client.completions.create(model="tiny", prompt="{", max_tokens=160, seed=3,
                                    extra_body={"response_format": _schema_format("pattern")})
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMAS["pattern"])
    out = client.completions.create(model="tiny", prompt="{", max_tokens=160, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    # NOTE: a random-weight model may not close an open string within max_tokens
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].text), dict)
    else:
        assert out.choices[0].finish_reason == "length" and out.choices[0].text.startswith("{")


def test_structured_outputs_regex_and_choice_stream(client):
    chunks = client.completions.create(
        model="tiny", prompt="id:", max_tokens=40, seed=4, stream=True,
        extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{2,4}"}})
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{2,4}", text)
    out = client.chat.completions.create(
        model="tiny", messages=STRUCTURED_MESSAGES, max_tokens=10, seed=5,
        extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert out.choices[0].message.content in ("left", "right")


def _strict_json(text: str):
    """JSON as the spec has it: -Infinity and NaN are not JSON."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("stream", [True, False])
def test_structured_outputs_with_top_logprobs_are_finite_json(server, stream):
    """A grammar's mask once gave its forbidden alternatives -inf: not JSON streamed,
    a 500 not streamed. Logprobs are the model's own, finite."""
    body = {"model": "tiny", "messages": STRUCTURED_MESSAGES, "max_tokens": 4, "seed": 3,
            "logprobs": True, "top_logprobs": 20, "stream": stream,
            "structured_outputs": {"choice": ["yes", "no"]}}
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=60, headers=AUTH)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [_strict_json(line[len("data: "):]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
    else:
        chunks = [_strict_json(r.text)]
    entries = [e for c in chunks for ch in c["choices"]
               for e in ((ch.get("logprobs") or {}).get("content") or [])]
    assert entries and all(len(e["top_logprobs"]) == 20 for e in entries)
    assert all(math.isfinite(e["logprob"]) and all(math.isfinite(a["logprob"])
                                                    for a in e["top_logprobs"])
               for e in entries)


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "t", "schema": {"type": "object", "required": "a"}}}},
     "response_format", "invalid JSON schema: Expected array for 'required'"),
    ({"structured_outputs": {"regex": "[a-z"}}, None, "unclosed character class"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, None, "missing_rule"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "response_format",
     "do not combine with ignore_eos"),
])
def test_bad_schemas_and_grammars_are_400s_naming_the_problem(server, extra, param, words):
    body = {"model": "tiny", "messages": STRUCTURED_MESSAGES, "max_tokens": 8, **extra}
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=60,
                   headers=AUTH)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"]
    if param is not None:
        assert error["param"] == param
