"""The full HTTP path through Ray Serve beside the offline engine, in one run:
`python -m loadtests.bench_http`.

Rows: the offline AsyncEngine (no HTTP); the app behind Serve's own HTTP proxy;
the app behind Serve's HAProxy front door (`--fast-front-door`); and both paths
at concurrency 1, for the TTFT the HTTP path adds. Workload: the `tiny` preset,
N prompts of 128 tokens, 128 output tokens, ignore_eos, all sent at once,
streaming.

`tok/event` is output tokens per SSE event; at least `2 - tok/event` of the
events carry exactly one token (every event carries one or more).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os

from loadtests.bench import BenchConfig, run_benchmark
from loadtests.bench_engine import _cfg, run_engine
from loadtests.local_server import LocalServer

KEYS = ("output_tokens_per_s", "median_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
        "median_itl_ms", "p99_itl_ms", "mean_tokens_per_chunk")


def _served(args: list[str], model: str, n: int, input_len: int, output_len: int,
            concurrency: int | None, log_path: str) -> dict:
    with LocalServer(["--model", model] + args, log_path=log_path) as srv:
        cfg = BenchConfig(base_url=srv.base_url, model=model, dataset_name="random",
                          num_prompts=n, random_input_len=input_len, random_output_len=output_len,
                          ignore_eos=True, disable_tqdm=True, max_concurrency=concurrency,
                          tokenizer="replicas/assets")
        r = asyncio.run(run_benchmark(cfg))
    return {"output_tokens_per_s": r["output_throughput"], **{k: r[k] for k in KEYS[1:] if k in r},
            "failed": r.get("failed", 0)}


def _offline(model: str, n: int, concurrency: int, input_len: int, output_len: int) -> dict:
    r = run_engine(_cfg(model), n, concurrency, input_len, output_len)
    r["mean_tokens_per_chunk"] = r.pop("mean_tokens_per_delta")
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--no-fast-front-door", action="store_true",
                    help="skip the rows behind Serve's HAProxy front door")
    ap.add_argument("--result-dir", default="results")
    ap.add_argument("--engine-threads", type=int, nargs="*", default=[],
                    help="also serve with the engine's torch thread count set to each of these "
                         "(`--num-threads`), Serve proxy path, one row each")
    args = ap.parse_args()
    os.makedirs(args.result_dir, exist_ok=True)
    log = os.path.join(args.result_dir, "bench_http_server.log")
    n, il, ol, m = args.num_prompts, args.input_len, args.output_len, args.model
    paths = {"http": []} if args.no_fast_front_door else {"http": [], "http fast": ["--fast-front-door"]}
    rows = {"offline": _offline(m, n, n, il, ol)}
    for name, flags in paths.items():
        rows[name] = _served(flags, m, n, il, ol, None, log)
    for threads in args.engine_threads:
        rows[f"http, engine threads {threads}"] = _served(["--num-threads", str(threads)], m, n, il, ol,
                                                          None, log)
    rows["offline c=1"] = _offline(m, 10, 1, il, ol)
    for name, flags in paths.items():
        rows[f"{name} c=1"] = _served(flags, m, 10, il, ol, 1, log)
    print(f"\n{m}, {n} prompts, {il} in / {ol} out, streaming")
    print("| row | " + " | ".join(KEYS) + " |\n|" + "---|" * (len(KEYS) + 1))
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(f"{r.get(k, float('nan')):.2f}" for k in KEYS) + " |")
    offline = rows["offline"]["output_tokens_per_s"]
    for threads in args.engine_threads:
        r = rows[f"http, engine threads {threads}"]
        print(f"http, engine threads {threads}: {r['output_tokens_per_s'] / offline:.2f}x offline tok/s")
    for name in paths:
        r, r1 = rows[name], rows[f"{name} c=1"]
        added = r1["median_ttft_ms"] - rows["offline c=1"]["median_ttft_ms"]
        per_event = r["mean_tokens_per_chunk"]
        print(f"{name}: {r['output_tokens_per_s'] / offline:.2f}x offline tok/s; "
              f"{per_event:.3f} tok/event (>= {max(0.0, 2 - per_event):.3f} of events carry one "
              f"token); +{added:.1f} ms median TTFT at concurrency 1; failed {r['failed']}")
    with open(os.path.join(args.result_dir, "bench_http.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
