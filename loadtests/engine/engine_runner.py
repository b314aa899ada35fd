"""The one offline engine runner: requests streamed from the engine with no HTTP, timed
where a consumer sees them (TTFT at the first delta, ITL per delta received) and
summarised by `loadtests.serving.metrics`, as the serving benchmark summarises chunks.

A workload is a list of sessions; a session is requests sent one after another (a
chat's turns; most sessions hold one request), `concurrency` sessions at once. The
engine loop runs on a thread of this process (`AsyncEngine`, what replicas run) or in
a child process that sends each step's deltas as one message over a pipe (the
per-step channel's outbox and wire format). Imports the engine (`replicas`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import gc
import math
import multiprocessing as mp
import random
import threading
import time

from loadtests.serving.metrics import RequestTimeline, summarize
from replicas import EngineConfig, SamplingParams

Session = list[tuple[list[int], SamplingParams]]


def random_prompts(num: int, length: int, seed: int = 1, prefix_len: int = 0) -> list[list[int]]:
    """Token-id prompts: a shared prefix of `prefix_len` ids, then `length` ids each."""
    rng = random.Random(seed)
    prefix = [rng.randrange(5, 8192) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(5, 8192) for _ in range(length)] for _ in range(num)]


def engine_config(model: str, **overrides) -> EngineConfig:
    return EngineConfig(model=model, max_num_seqs=max(256, overrides.pop("max_num_seqs", 256)),
                        **overrides)


def sessions_of(prompts: list[list[int]], params: SamplingParams) -> list[Session]:
    return [[(p, params)] for p in prompts]


def greedy(output_len: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=kw.pop("temperature", 0.0), max_tokens=output_len,
                          ignore_eos=True, **kw)


async def stream_sessions(open_stream, sessions: list[Session], concurrency: int | None = None,
                          budget_s: float = math.inf, log=None, log_every_s: float = 10.0):
    """`open_stream(request_id, prompt, params)` -> async iterator of deltas. Returns
    (timelines per session, duration_s, number of sessions cut off at `budget_s`: their
    request in flight fails, the turns after it are never sent)."""
    limit = asyncio.Semaphore(concurrency or len(sessions))
    timelines: list[list[RequestTimeline]] = [[] for _ in sessions]

    async def one(i: int, session: Session) -> None:
        async with limit:
            for k, (prompt, params) in enumerate(session):
                t = RequestTimeline(time.perf_counter(), prompt_len=len(prompt), chunk_num_tokens=[])
                timelines[i].append(t)
                async for delta in open_stream(f"r{i}t{k}", prompt, params):
                    if delta.token_ids:
                        t.chunk_times.append(time.perf_counter())
                        t.num_output_tokens += len(delta.token_ids)
                        t.chunk_num_tokens.append(len(delta.token_ids))
                    if getattr(delta, "error", None):
                        t.success, t.error = False, delta.error

    start = time.perf_counter()
    tasks = [asyncio.create_task(one(i, s)) for i, s in enumerate(sessions)]
    pending = set(tasks)
    while pending and time.perf_counter() - start < budget_s:
        wait_s = min(log_every_s if log else math.inf, budget_s - (time.perf_counter() - start))
        _, pending = await asyncio.wait(pending, timeout=None if math.isinf(wait_s) else wait_s)
        if log is not None:
            tokens = sum(t.num_output_tokens for ts in timelines for t in ts)
            log(f"  {len(tasks) - len(pending)}/{len(tasks)} done, {tokens} tokens, "
                f"{time.perf_counter() - start:.0f} s")
    duration = time.perf_counter() - start
    for task in pending:  # past the budget: a stream's close aborts its request
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for task, ts in zip(tasks, timelines):
        if ts and (task.cancelled() or task.exception() is not None):
            ts[-1].success = False
            ts[-1].error = "cut off at the time budget" if task.cancelled() else repr(task.exception())
    return timelines, duration, len(pending)


def summary_row(timelines: list[list[RequestTimeline]], duration_s: float) -> dict:
    """The serving benchmark's summary keys (vLLM's names), plus median TTFT by turn
    when sessions have several."""
    flat = [t for ts in timelines for t in ts]
    row = summarize(flat, duration_s, percentiles=(50.0, 90.0, 99.0)).to_dict()
    if any(len(ts) > 1 for ts in timelines):
        for k, label in ((0, "turn1"), (1, "turn2"), (2, "turn3+")):
            turns = [ts[j] for ts in timelines for j in range(len(ts)) if min(j, 2) == k]
            row[f"median_ttft_{label}_ms"] = summarize(turns, 1.0).ttft.median_ms if turns else math.nan
    return row


def stats_dict(stats) -> dict:
    """The engine's stats as a dict (a frozen dataclass now, a dict in older revisions)."""
    return stats if isinstance(stats, dict) else dataclasses.asdict(stats)


def freeze_heap() -> None:
    """Collect, then move what is alive out of the collector's reach, as Ray Serve does
    at the end of each replica's start (RAY_SERVE_FREEZE_GC_ON_STARTUP): a served
    engine's loop never waits on a full collection walking the model's and torch's
    objects (~300k, over 100 ms each on a small core, a few times a minute under
    load), so neither does the offline yardstick it is compared with."""
    gc.collect()
    gc.freeze()


async def drain(stream) -> None:
    async for _ in stream:
        pass


def run_engine(config: EngineConfig, sessions: list[Session], concurrency: int | None = None) -> dict:
    """One AsyncEngine (loop on a thread), warmed up, then the workload: summary_row plus
    the output-processing CPU per token and the prefix-cache hit rate. The heap alive
    once the engine is built is frozen for the run (`freeze_heap`)."""
    from replicas.async_engine import AsyncEngine

    engine = AsyncEngine(config)
    freeze_heap()
    try:
        asyncio.run(drain(engine.generate("warmup", sessions[0][0][0][:8], SamplingParams(max_tokens=4))))
        out = engine.core.output
        cpu0, tokens0 = out.cpu_time_s, out.num_output_tokens
        timelines, duration, _ = asyncio.run(stream_sessions(engine.generate, sessions, concurrency))
        row = summary_row(timelines, duration)
        row["output_cpu_us_per_token"] = ((out.cpu_time_s - cpu0) * 1e6
                                          / max(out.num_output_tokens - tokens0, 1))
        row["prefix_cache_hit_rate"] = stats_dict(engine.stats()).get("prefix_cache_hit_rate")
    finally:
        engine.shutdown()
        gc.unfreeze()  # the next run's engine replaces this one's
        gc.collect()
    return row


# -- the engine loop in its own process ---------------------------------------------------
def _engine_process(requests_conn, steps_conn, config_kwargs: dict) -> None:
    from cluster.transport.outbox import OutboxSink, StepOutbox
    from cluster.transport.wire import encode_step
    from replicas.engine_core import EngineCore

    core = EngineCore(EngineConfig(**config_kwargs))
    freeze_heap()
    ready, holder = threading.Event(), {}

    def sender() -> None:
        async def main() -> None:
            outbox = holder["outbox"] = StepOutbox("bench")
            ready.set()
            while True:
                await outbox.wait()
                deltas = outbox.take_deltas()
                if deltas:
                    steps_conn.send_bytes(encode_step(deltas))
        asyncio.run(main())

    threading.Thread(target=sender, daemon=True).start()
    ready.wait()
    steps_conn.send_bytes(encode_step([]))  # greeting: ready
    while True:
        timeout = 0 if core.has_work else 0.05
        while requests_conn.poll(timeout):
            timeout = 0
            msg = requests_conn.recv()
            if msg is None:
                core.shutdown()
                return
            rid, ids, params = msg
            core.add_request(core.make_request(rid, ids, params, OutboxSink(holder["outbox"], rid)))
        if core.has_work:
            core.step()


def run_process_engine(config_kwargs: dict, sessions: list[Session],
                       concurrency: int | None = None) -> dict:
    """As run_engine, with the engine loop in a child process (spawned)."""
    from cluster.transport.wire import decode_step
    from deltas.collector import DeltaCollector

    ctx = mp.get_context("spawn")
    req_recv, req_send = ctx.Pipe(duplex=False)
    step_recv, step_send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_engine_process, args=(req_recv, step_send, config_kwargs), daemon=True)
    child.start()
    step_recv.recv_bytes()  # the engine is up

    async def main():
        loop = asyncio.get_running_loop()
        collectors: dict[str, DeltaCollector] = {}

        def on_message() -> None:
            while step_recv.poll():
                for delta in decode_step(step_recv.recv_bytes()):
                    if delta.request_id in collectors:
                        collectors[delta.request_id].put(delta)

        def open_stream(rid: str, prompt: list[int], params: SamplingParams):
            collectors[rid] = DeltaCollector(rid)
            req_send.send((rid, prompt, params))
            return collectors[rid]

        loop.add_reader(step_recv.fileno(), on_message)
        try:
            # NOTE: warmed up as run_engine warms the thread engine, outside the timing
            await drain(open_stream("warmup", sessions[0][0][0][:8], SamplingParams(max_tokens=4)))
            return await stream_sessions(open_stream, sessions, concurrency)
        finally:
            loop.remove_reader(step_recv.fileno())

    try:
        timelines, duration, _ = asyncio.run(main())
    finally:
        req_send.send(None)
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    return summary_row(timelines, duration)
