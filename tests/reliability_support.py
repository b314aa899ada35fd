"""Helpers for the reliability tests: SSE clients that can hang up anywhere,
OpenAI error-shape checks, engine replica stats and actors.

Not a test module.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from loadtests.serving.openai_stream import StreamParser, event_text
from run_lanes import LANE_PIDS_FILE_ENV

ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass(slots=True)
class StreamResult:
    status: int
    headers: dict = field(default_factory=dict)
    events: list = field(default_factory=list)  # parsed JSON events, "[DONE]" as a str
    body: bytes = b""  # the whole body of a non-SSE answer
    disconnected: bool = False  # we hung up before the end
    event_times: list = field(default_factory=list)  # time.monotonic() each event came

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    @property
    def error_events(self) -> list[dict]:
        return [e for e in self.events if isinstance(e, dict) and "error" in e]

    @property
    def text(self) -> str:
        return "".join(event_text(e) for e in self.events if isinstance(e, dict))

    @property
    def finish_reason(self) -> str | None:
        for e in reversed(self.events):
            if isinstance(e, dict) and e.get("choices"):
                return e["choices"][0].get("finish_reason")
        return None

    def json(self):
        return json.loads(self.body)


def is_openai_error(body: dict) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and set(error) == ERROR_KEYS and bool(error["message"])


async def stream_request(client: httpx.AsyncClient, url: str, body: dict,
                         headers: dict | None = None,
                         hang_up_after_events: int | None = None,
                         first_event: asyncio.Event | None = None) -> StreamResult:
    """POST and read the SSE answer; hang up after `hang_up_after_events` data events
    (closing the response closes its connection mid-stream); `first_event` is set once
    the first data event arrived."""
    async with client.stream("POST", url, json=body, headers=headers) as r:
        result = StreamResult(r.status_code, dict(r.headers))
        if r.status_code != 200 or not r.headers.get("content-type", "").startswith(
                "text/event-stream"):
            result.body = await r.aread()
            return result
        parser = StreamParser(keep_events=True, events=result.events)
        async for line in r.aiter_lines():
            parser.feed(line, 0.0)
            now = time.monotonic()
            result.event_times.extend(now for _ in range(len(result.events)
                                                         - len(result.event_times)))
            if first_event is not None and result.events:
                first_event.set()
            if hang_up_after_events is not None and len(result.events) >= hang_up_after_events:
                result.disconnected = True
                return result
    if parser.error.startswith("bad JSON"):
        raise ValueError(parser.error)
    return result


def replica_actor_name(replica_unique_id: str, deployment: str = "EngineReplica",
                       app: str = "stepstream") -> str:
    """The Ray actor name of a Serve replica (namespace "serve")."""
    from ray.serve._private.common import DeploymentID, ReplicaID

    return ReplicaID(replica_unique_id, DeploymentID(deployment, app)).to_full_id_str()


def engine_replica_ids(app: str = "stepstream") -> list[str]:
    """The ids of the engine replicas alive now (from their Ray actor names)."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#EngineReplica#"
    return sorted(a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") == "serve" and a["name"].startswith(prefix))



def pinned_stats(handle, replica_ids=None, timeout_s: float = 30.0) -> dict[str, dict]:
    """The stats of each engine replica (every live one by default), each asked
    directly (pinned).

    NOTE: a replica's actor is named before Serve routes to it (its constructor is
    still loading the model), and a killed one (or one on a lost node) may still be
    listed for a moment: a pinned call to either waits. Such a call is cancelled
    after `timeout_s`, and the replica left out, so callers polling with wait_until
    simply ask again.
    """
    out = {}
    for rid in engine_replica_ids() if replica_ids is None else replica_ids:
        response = handle.stats.remote(pin_replica_id=rid)
        try:
            out[rid] = response.result(timeout_s=timeout_s)
        except TimeoutError:
            response.cancel()
    return out

def engine_stats(handle, num_replicas: int = 1, max_calls: int = 60) -> dict[str, dict]:
    """The latest stats of every engine replica (a call lands on a random one)."""
    seen: dict[str, dict] = {}
    for _ in range(max_calls):
        s = handle.stats.remote().result(timeout_s=30)
        seen[s["replica_id"]] = s
        if len(seen) >= num_replicas:
            break
    return seen


def is_idle(stats: dict) -> bool:
    return (stats["num_running"] == 0 and stats["num_waiting"] == 0
            and stats["num_free_blocks"] == stats["num_total_blocks"]
            and stats["num_active_streams"] == 0)


async def gather_bounded(coros, limit: int):
    """Run coroutines at most `limit` at a time; results in order."""
    semaphore = asyncio.Semaphore(limit)

    async def one(coro):
        async with semaphore:
            return await coro

    return await asyncio.gather(*(one(c) for c in coros))


def greedy_texts(model: str, engine_args: dict, prompts: list[str]):
    """`texts(max_tokens)`: the offline engine's greedy texts of `prompts` (ignore_eos),
    computed once per max_tokens: the reference every served stream must equal."""
    from deltas.tokenization.tokenizer import Tokenizer
    from replicas import Engine, EngineConfig, SamplingParams
    from replicas.checkpoints.presets import resolve_tokenizer_dir

    tokenizer = Tokenizer.from_dir(resolve_tokenizer_dir(model))
    cache: dict[int, list[str]] = {}

    def texts(max_tokens: int) -> list[str]:
        if max_tokens not in cache:
            with Engine(EngineConfig(model=model, **engine_args)) as engine:
                outs = engine.generate([tokenizer.encode(p) for p in prompts], SamplingParams(
                    temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            cache[max_tokens] = [tokenizer.decode(o.token_ids) for o in outs]
        return cache[max_tokens]
    return texts


_BUSY_LOOP = """\
import os, time
os.sched_setaffinity(0, {{{cpu}}})
others = {others!r}

def any_running():
    for pid in others:
        try:
            with open(f"/proc/{{pid}}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    return True
        except OSError:
            pass
    return False

while any_running():
    time.sleep(0.2)
while True:
    pass
"""


def _other_lane_pids() -> list[int]:
    """The pids of the suite's other lanes (none outside `make test`)."""
    path = os.environ.get(LANE_PIDS_FILE_ENV)
    try:
        pids = [int(p) for p in open(path).read().split()] if path else []
    except (OSError, ValueError):
        return []
    return [p for p in pids if p != os.getpid()]


@contextlib.contextmanager
def busy_core():
    """A busy loop pinned to one of this process's cores while the block runs: the
    machine at about half its speed for whatever shares that core.

    Beside the suite's other lanes the loop waits for them to end first: they keep
    the machine at least that busy already, and a loop burning a core beside them
    only stretches every lane."""
    cpu = min(os.sched_getaffinity(0))
    code = _BUSY_LOOP.format(cpu=cpu, others=_other_lane_pids())
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.2)
        assert proc.poll() is None, f"the busy loop exited ({proc.returncode})"
        yield proc
    finally:
        proc.kill()
        proc.wait()
