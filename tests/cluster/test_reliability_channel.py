"""The per-step channel under failures, on a real local Ray with two engine replicas:

- an engine replica killed: exactly its streams end with an SSE error event (no
  truncation, no `[DONE]`); streams on the other replica finish with `[DONE]`;
- the ingress replica killed: the engines abort every request it owned and free
  their KV blocks within a bounded time, and a restarted ingress serves again;
- requests spread over both replicas, each stream's tokens on its replica's channel.

One app for the module; Serve and Ray always shut down."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from cluster_support import engine_handle, serve_app, wait_until
from reliability_support import (engine_replica_ids, pinned_stats, is_idle, is_openai_error,
                                 replica_actor_name, stream_request)

pytestmark = [pytest.mark.ray, pytest.mark.shared_ray, pytest.mark.timeout(600)]

MODEL = "tiny"
APP_ARGS = {"model": MODEL, "engine_num_cpus": 0.5, "ingress_num_cpus": 0.5, "num_threads": 1,
            "num_engine_replicas": 2, "max_num_seqs": 16, "num_kv_blocks": 512,
            "num_scheduler_steps": 4, "max_model_len": 512, "enable_fault_injection": True,
            "health_check_period_s": 1.0, "health_check_timeout_s": 5.0,
            "graceful_shutdown_timeout_s": 10.0}


@pytest.fixture(scope="module")
def server():
    with serve_app(APP_ARGS) as base:
        yield base


def _body(max_tokens: int = 400) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}


def _fault_both(handle, kind: str, step_delay_s: float = 0.05) -> None:
    """The same fault on both engine replicas ("slow": streams stay in flight)."""
    for rid in engine_replica_ids():
        handle.inject_fault.remote(kind, step_delay_s, pin_replica_id=rid).result(timeout_s=30)


def _running(handle) -> dict[str, int]:
    return {rid: s["num_running"] for rid, s in pinned_stats(handle).items()}


def test_a_killed_engine_replica_fails_only_its_own_streams(server):
    import ray

    handle = engine_handle()
    # 75 windows of at least 0.1 s: every stream still runs when all 8 are admitted
    # and the victim is killed, on a slower machine too.
    _fault_both(handle, "slow", 0.1)
    num_streams = 8

    async def run():
        url = server + "/v1/completions"
        async with httpx.AsyncClient(timeout=120) as client:
            streams = [asyncio.ensure_future(stream_request(client, url, _body(300)))
                       for _ in range(num_streams)]
            assert await asyncio.to_thread(
                wait_until, lambda: sum(_running(handle).values()) == num_streams, 60)
            running = await asyncio.to_thread(_running, handle)
            victim = max(running, key=running.get)
            assert all(running.values()), f"both replicas should hold streams: {running}"
            actor = ray.get_actor(replica_actor_name(victim), namespace="serve")
            await asyncio.to_thread(ray.kill, actor, no_restart=True)
            results = await asyncio.wait_for(asyncio.gather(*streams), 120)
        return running[victim], results

    num_on_victim, results = asyncio.run(run())
    failed = [r for r in results if not r.done]
    for r in failed:
        assert r.status == 200 and r.events, r
        errors = r.error_events
        assert len(errors) == 1 and r.events[-1] is errors[0] and is_openai_error(errors[0])
    for r in results:
        if r.done:
            assert r.finish_reason == "length" and not r.error_events
    assert len(failed) == num_on_victim, (len(failed), num_on_victim)
    # Serve replaces the killed replica: wait for two healthy engines again.
    assert wait_until(lambda: len(engine_replica_ids()) == 2 and len(pinned_stats(handle, timeout_s=5)) == 2, 120)
    print(f"\nengine replica killed: {len(failed)} of {num_streams} streams (exactly those it "
          "held) ended with an error event; the others finished")


def _crash_the_ingress() -> None:
    """SIGKILL the ingress replica's process, as a crash would (no Ray-side cleanup)."""
    import psutil

    # NOTE: among this process's descendants (the local Ray it started) only: another
    # lane of the suite may run an app of the same name meanwhile.
    procs = [p for p in psutil.Process().children(recursive=True)
             if "ServeReplica:stepstream:Ingress" in " ".join(_cmdline(p))]
    assert len(procs) == 1, procs
    procs[0].kill()


def _cmdline(proc) -> list[str]:
    import psutil

    try:
        return proc.cmdline()
    except psutil.Error:  # gone meanwhile
        return []


def _counts(handle, keys) -> dict[str, int]:
    stats = pinned_stats(handle).values()
    return {k: sum(s[k] for s in stats) for k in keys}


ENDINGS = ("num_requests_cancelled", "num_requests_orphaned", "num_requests_finished")
# NOTE: "slow" sleeps once per 4-step window: 400 tokens then take 100 x 0.6 = 60 s,
# far past the 15 s the test allows for the abort.
SLOW_WINDOW_S = 0.6


def test_a_killed_ingress_leaves_no_request_running(server):
    handle = engine_handle()
    before = _counts(handle, ENDINGS)
    _fault_both(handle, "slow", SLOW_WINDOW_S)
    num_streams = 6

    async def run():
        url = server + "/v1/completions"
        async with httpx.AsyncClient(timeout=60) as client:
            streams = [asyncio.ensure_future(stream_request(client, url, _body()))
                       for _ in range(num_streams)]
            assert await asyncio.to_thread(
                wait_until, lambda: sum(_running(handle).values()) == num_streams, 60)
            killed_at = time.monotonic()
            await asyncio.to_thread(_crash_the_ingress)
            await asyncio.gather(*streams, return_exceptions=True)  # cut by the proxy
        return killed_at

    try:
        killed_at = asyncio.run(run())
        # They would run for 60 s more: idle within 15 s means aborted.
        assert wait_until(lambda: all(is_idle(s) for s in pinned_stats(handle).values()), 15)
        aborted_s = time.monotonic() - killed_at
        after = _counts(handle, ENDINGS)
    finally:
        _fault_both(handle, "clear")
    ended = {k: after[k] - before[k] for k in ENDINGS}
    # Ended by the engines: cancelled (Serve cancelled the dead caller's calls) or
    # orphaned (the replica noticed its ingress was gone), never finished.
    assert ended["num_requests_finished"] == 0, ended
    assert ended["num_requests_cancelled"] + ended["num_requests_orphaned"] == num_streams, ended
    with httpx.Client(timeout=30) as c:  # Serve restarts the ingress
        deadline = time.monotonic() + 90
        while True:
            try:
                r = c.post(server + "/v1/completions", json={**_body(4), "stream": False})
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the ingress did not come back"
            time.sleep(0.5)
    print(f"\ningress killed: its {num_streams} requests aborted and every block free "
          f"{aborted_s:.1f} s later ({ended})")
