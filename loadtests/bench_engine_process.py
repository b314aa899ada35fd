"""Thread or process for the engine loop? `python -m loadtests.bench_engine_process`

The same workload and consumers as `bench_engine` (one asyncio task per request,
reading deltas), with the engine loop either
- **thread**: `AsyncEngine`, the engine loop on a thread of the consumers' process
  (what replicas run), sharing its GIL with the event loop; or
- **process**: the engine loop in a child process, which sends each step's deltas
  as one message over a pipe (the per-step channel's outbox and wire format); the
  parent's event loop decodes each message into the requests' collectors.

`--num-threads 1 2` adds a thread row per torch thread count (how many cores the
engine's matmuls take while the consumers and the output thread share them).
Configurations are interleaved round by round; medians are printed.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import pickle
import statistics
import threading
import time

from loadtests.bench_engine import _cfg, _pct, _prompts, run_engine


# -- the child: engine loop + outbox ---------------------------------------------------
def _engine_process(requests_conn, steps_conn, config_kwargs: dict) -> None:
    from cluster.outbox import OutboxSink, StepOutbox
    from replicas import EngineConfig, SamplingParams
    from replicas.engine_core import EngineCore

    core = EngineCore(EngineConfig(**config_kwargs))
    ready = threading.Event()
    holder: dict = {}

    def sender() -> None:
        async def main() -> None:
            outbox = holder["outbox"] = StepOutbox("bench")
            ready.set()
            while True:
                await outbox.wait()
                message = outbox.take_message()
                if message:
                    steps_conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        asyncio.run(main())

    threading.Thread(target=sender, daemon=True).start()
    ready.wait()
    outbox = holder["outbox"]
    steps_conn.send_bytes(pickle.dumps([]))  # greeting: ready
    while True:
        timeout = 0 if core.has_work else 0.05
        while requests_conn.poll(timeout):
            timeout = 0
            msg = requests_conn.recv()
            if msg is None:
                core.shutdown()
                return
            rid, ids, params = msg
            core.add_request(core.make_request(rid, ids, SamplingParams(**params),
                                               OutboxSink(outbox, rid)))
        if core.has_work:
            core.step()


# -- the parent: consumers ---------------------------------------------------------------
def run_process_engine(config_kwargs: dict, num_requests: int, input_len: int, output_len: int) -> dict:
    from cluster.wire import decode_delta
    from deltas.collector import DeltaCollector

    ctx = mp.get_context("spawn")
    req_recv, req_send = ctx.Pipe(duplex=False)
    step_recv, step_send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_engine_process, args=(req_recv, step_send, config_kwargs), daemon=True)
    child.start()
    step_recv.recv_bytes()  # the engine is up
    params = dict(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    prompts = _prompts(num_requests, input_len, seed=1)

    async def main() -> list[dict]:
        loop = asyncio.get_running_loop()
        collectors: dict[str, DeltaCollector] = {}

        def on_message() -> None:
            while step_recv.poll():
                for item in pickle.loads(step_recv.recv_bytes()):
                    delta = decode_delta(item)
                    c = collectors.get(delta.request_id)
                    if c is not None:
                        c.put(delta)

        loop.add_reader(step_recv.fileno(), on_message)

        async def stream(i: int, prompt: list[int], request_params: dict = params) -> dict:
            rid = f"r{i}"
            c = collectors[rid] = DeltaCollector(rid)
            start = time.perf_counter()
            req_send.send((rid, prompt, request_params))
            times, n = [], 0
            async for delta in c:
                if delta.token_ids:
                    times.append(time.perf_counter())
                    n += len(delta.token_ids)
            return {"start": start, "chunk_times": times, "num_tokens": n}

        try:
            # NOTE: warmed up as run_engine warms the thread engine, outside the timing
            await stream("warmup", prompts[0][:8], dict(max_tokens=4))
            t0 = time.perf_counter()
            records = await asyncio.gather(*[stream(i, p) for i, p in enumerate(prompts)])
            return records, time.perf_counter() - t0
        finally:
            loop.remove_reader(step_recv.fileno())

    try:
        records, duration = asyncio.run(main())
    finally:
        req_send.send(None)
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    return _summary(records, duration)


def _summary(records: list[dict], duration: float) -> dict:
    tpot, itl, total = [], [], 0
    for r in records:
        t = r["chunk_times"]
        total += r["num_tokens"]
        if len(t) > 1:
            tpot.append((t[-1] - t[0]) * 1e3 / (r["num_tokens"] - 1))
        itl += [(b - a) * 1e3 for a, b in zip(t, t[1:])]
    ttft = [(r["chunk_times"][0] - r["start"]) * 1e3 for r in records]
    return {"output_tokens_per_s": total / duration, "median_ttft_ms": _pct(ttft, 50),
            "median_tpot_ms": _pct(tpot, 50), "median_itl_ms": _pct(itl, 50), "p99_itl_ms": _pct(itl, 99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--num-threads", type=int, nargs="*", default=[])
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"thread": [], "process": []}
    runs.update({f"thread, {n} torch threads": [] for n in args.num_threads})
    for _ in range(args.repeats):
        runs["thread"].append(run_engine(_cfg(args.model), args.num_requests, args.num_requests,
                                         args.input_len, args.output_len))
        for n in args.num_threads:
            runs[f"thread, {n} torch threads"].append(run_engine(
                _cfg(args.model, num_threads=n), args.num_requests, args.num_requests,
                args.input_len, args.output_len))
        runs["process"].append(run_process_engine(dict(model=args.model, max_num_seqs=256),
                                                  args.num_requests, args.input_len, args.output_len))
    print(f"\n{args.model}, {args.num_requests} streams, {args.input_len} in / {args.output_len} out; "
          f"medians of {args.repeats} interleaved rounds")
    print(f"{'engine loop in':<26}{'tok/s':>8}{'TPOT p50':>10}{'ITL p50':>9}{'ITL p99':>9}{'TTFT p50':>10}")
    med = {}
    for name, rs in runs.items():
        m = med[name] = {k: statistics.median(r[k] for r in rs) for k in
                         ("output_tokens_per_s", "median_tpot_ms", "median_itl_ms", "p99_itl_ms",
                          "median_ttft_ms")}
        print(f"{name:<26}{m['output_tokens_per_s']:8.0f}{m['median_tpot_ms']:10.1f}"
              f"{m['median_itl_ms']:9.1f}{m['p99_itl_ms']:9.1f}{m['median_ttft_ms']:10.0f}")
    print(f"process vs thread: {med['process']['output_tokens_per_s'] / med['thread']['output_tokens_per_s']:.2f}x "
          f"throughput; rounds: thread {[round(r['output_tokens_per_s']) for r in runs['thread']]}, "
          f"process {[round(r['output_tokens_per_s']) for r in runs['process']]}")


if __name__ == "__main__":
    main()
