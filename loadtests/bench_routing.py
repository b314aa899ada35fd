"""Prefix-aware routing against Serve's power of two choices, two engine replicas, in
one run: `python -m loadtests.bench_routing`.

For each policy: a local Ray with the app (`tiny`, two engine replicas, prefix
caching on), the `prefix` workload of `loadtests.bench` (a few shared prefixes,
each with unique suffixes, streamed at a bounded concurrency), then every engine
replica's prefix-cache counters, read from the replica itself. Prints median TTFT,
throughput and the cache hit rate (prompt tokens served from the cache).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import time

from loadtests.bench import BenchConfig, run_benchmark

APP_NAME = "stepstream"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replica_stats(handle) -> list[dict]:
    import ray

    prefix = f"SERVE_REPLICA::{APP_NAME}#EngineReplica#"
    ids = [a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
           if a.get("namespace") == "serve" and a["name"].startswith(prefix)]
    return [handle.stats.remote(pin_replica_id=rid).result(timeout_s=60) for rid in ids]


def run_policy(prefix_routing_tokens: int, args) -> dict:
    import httpx
    import ray
    from ray import serve

    from cluster.app import AppArgs, make_app

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    port = _free_port()
    app_args = {"model": args.model, "num_engine_replicas": 2, "engine_num_cpus": 0.5,
                "ingress_num_cpus": 0.5, "num_threads": 1, "max_model_len": 2048,
                "prefix_routing_tokens": prefix_routing_tokens}
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(make_app(AppArgs.model_validate(app_args)), name=APP_NAME, route_prefix="/",
                  blocking=False)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.5)
        cfg = BenchConfig(base_url=base, model=args.model, dataset_name="prefix",
                          num_prompts=args.num_prompts, prefix_len=args.prefix_len,
                          suffix_len=args.suffix_len, num_prefixes=args.num_prefixes,
                          random_output_len=args.output_len, ignore_eos=True,
                          max_concurrency=args.max_concurrency, disable_tqdm=True,
                          tokenizer="replicas/assets")
        result = asyncio.run(run_benchmark(cfg))
        stats = _replica_stats(serve.get_deployment_handle("EngineReplica", app_name=APP_NAME))
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
    hit = sum(s["num_prefix_cache_hit_tokens"] for s in stats)
    query = sum(s["num_prefix_cache_query_tokens"] for s in stats)
    return {"median_ttft_ms": result["median_ttft_ms"], "p99_ttft_ms": result["p99_ttft_ms"],
            "output_tokens_per_s": result["output_throughput"],
            "cache_hit_rate": hit / query if query else 0.0,
            "requests_per_replica": sorted(s["num_requests_admitted"] for s in stats),
            "failed": result.get("failed", 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--num-prefixes", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--result-dir", default="results")
    args = ap.parse_args()
    rows = {"power of two choices": run_policy(0, args),
            "prefix-aware": run_policy(256, args)}
    print(f"\n{args.model}, 2 engine replicas, {args.num_prompts} prompts: {args.num_prefixes} "
          f"shared prefixes of {args.prefix_len} tokens + {args.suffix_len}-token suffixes, "
          f"{args.output_len} out, concurrency {args.max_concurrency}")
    print("| routing | TTFT p50 / p99 ms | tok/s | cache hit rate | requests per replica |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['median_ttft_ms']:.1f} / {r['p99_ttft_ms']:.1f} | "
              f"{r['output_tokens_per_s']:.0f} | {r['cache_hit_rate']:.3f} | "
              f"{r['requests_per_replica']} |")
    os.makedirs(args.result_dir, exist_ok=True)
    with open(os.path.join(args.result_dir, "bench_routing.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
