"""Redeploys and scale-downs drain in-flight streams (issue 6), on a real local Ray.

Streams are slowed on the running replicas (`inject_fault("slow")`, enabled only
for this app) so they are still running when Serve starts stopping the old
replicas; the test checks that it did (a replica in STOPPING while streams ran),
and that every stream still ended with a complete answer and `[DONE]`. Every stream
ends many of Serve's drain loops (`graceful_shutdown_wait_loop_s`, 0.25 s in tests)
after the first replica went STOPPING: a replica whose streams Serve did not count
would have stopped at the first loop and cut them. That the drain's limit is
`graceful_shutdown_timeout_s` (not Serve's 20 s default) is Serve's option on both
deployments, tests/cluster/test_cluster_configs.py: waiting out 20 s here would
prove Serve's code, not ours. One app for the module; Serve and Ray always shut down."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from cluster_support import (
    engine_handle, engine_states, serve_app, wait_healthy, wait_until, with_test_defaults,
)
from reliability_support import pinned_stats, stream_request

pytestmark = [pytest.mark.ray, pytest.mark.shared_ray, pytest.mark.timeout(600)]

MODEL = "tiny"
MAX_TOKENS = 144
STEP_DELAY_S = 0.5  # per 4-token window: a stream lasts over 18 s on a slowed replica
# NOTE: 16 of the test apps' drain loops; the streams outlast a busy machine's
# replica start (a redeploy starts the new replicas before it stops the old)
DRAINED_AT_LEAST_S = 4.0
# NOTE: deadlines for what a busy machine (the suite's other lanes) slows down: new
# replicas to start, streams to reach the engine. They bound waits; they time nothing.
DEADLINE_S = 180.0
APP_ARGS = {"model": MODEL, "num_engine_replicas": 2, "engine_num_cpus": 1,
            "ingress_num_cpus": 0.25, "num_threads": 1, "max_num_seqs": 16,
            "channel_idle_close_s": 1.0,
            "num_kv_blocks": 512, "num_scheduler_steps": 4, "max_model_len": 512,
            "enable_fault_injection": True, "graceful_shutdown_timeout_s": 120.0}


@pytest.fixture(scope="module")
def server():
    with serve_app(APP_ARGS) as base:
        yield base


def _slow_every_replica(num_replicas: int) -> None:
    handle = engine_handle()
    seen: set[str] = set()
    for _ in range(100):
        seen.add(handle.inject_fault.remote("slow", STEP_DELAY_S).result(timeout_s=30))
        if len(seen) >= num_replicas:
            return
    raise AssertionError(f"reached only {seen}")


def _redeploy(args: dict) -> None:
    from ray import serve

    from cluster.app import AppArgs, make_app

    serve.run(make_app(AppArgs.model_validate(with_test_defaults(args))), name="stepstream",
              route_prefix="/", blocking=False)


def _streams_through_a_change(server: str, new_args: dict, num_replicas: int,
                              num_streams: int = 6):
    """Start slowed streams, change the app while they run; (results, seconds from the
    first replica seen STOPPING to the first stream's end (None: none seen while streams
    ran), seconds of the change)."""
    _slow_every_replica(num_replicas)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    stopping_at, ended_at = [], []

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            tasks = [asyncio.ensure_future(stream_request(client, server + "/v1/completions",
                                                          body)) for _ in range(num_streams)]
            for t in tasks:
                t.add_done_callback(lambda _: ended_at.append(time.monotonic()))
            handle = engine_handle()
            assert await asyncio.to_thread(  # every stream is running on an old replica
                wait_until, lambda: sum(s["num_running"] for s in pinned_stats(
                    handle, timeout_s=5).values()) == num_streams, DEADLINE_S)
            assert not any(t.done() for t in tasks)
            started = time.monotonic()
            change = threading.Thread(target=_redeploy, args=(new_args,), daemon=True)
            change.start()
            while not all(t.done() for t in tasks):
                states = await asyncio.to_thread(engine_states)
                if states.get("STOPPING", 0) > 0 and not stopping_at:
                    stopping_at.append(time.monotonic())
                await asyncio.sleep(0.2)
            await asyncio.to_thread(change.join, 300)
            return await asyncio.gather(*tasks), time.monotonic() - started

    results, change_s = asyncio.run(run())
    drained_s = min(ended_at) - stopping_at[0] if stopping_at else None
    return results, drained_s, change_s


def _assert_complete(results) -> None:
    for r in results:
        assert r.status == 200 and r.done and not r.error_events, r.events[-2:]
        assert r.finish_reason == "length"
        assert r.events[-2]["usage"]["completion_tokens"] == MAX_TOKENS


def test_redeploy_with_a_changed_arg_lets_streams_finish(server):
    results, drained_s, change_s = _streams_through_a_change(
        server, {**APP_ARGS, "channel_idle_close_s": 1.5}, num_replicas=2)
    _assert_complete(results)
    assert drained_s is not None, "the old replicas were never stopped while streams ran"
    assert drained_s > DRAINED_AT_LEAST_S, f"streams ended {drained_s:.1f} s into the drain"
    wait_healthy(server, DEADLINE_S)
    print(f"\nredeploy: {len(results)} streams finished through it ({change_s:.1f} s; "
          f"the first ended {drained_s:.1f} s after a replica went STOPPING)")


def test_scale_down_lets_streams_finish(server):
    results, drained_s, change_s = _streams_through_a_change(
        server, {**APP_ARGS, "channel_idle_close_s": 1.5, "num_engine_replicas": 1},
        num_replicas=2)
    _assert_complete(results)
    assert drained_s is not None, "no replica was stopped while streams ran"
    assert drained_s > DRAINED_AT_LEAST_S, f"streams ended {drained_s:.1f} s into the drain"
    assert wait_until_one_replica()
    print(f"\nscale-down 2 -> 1: {len(results)} streams finished through it ({change_s:.1f} s; "
          f"the first ended {drained_s:.1f} s after a replica went STOPPING)")


def wait_until_one_replica(timeout_s: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if engine_states() == {"RUNNING": 1}:
            return True
        time.sleep(0.5)
    return False
