"""`python -m cluster.serve_local`: the whole app on a local Ray, one command.

Starts a local Ray (logical CPUs fixed by --num-cpus), Serve's HTTP proxy on
--host/--port, and the app of `cluster.app.build_app`; waits until /health
answers, prints the URL and a curl line that streams a completion, and serves
until SIGINT/SIGTERM, then shuts Serve and Ray down.

Flags override `--config` (a Serve config YAML whose first application's `args`
and `http_options` are the base); without a config the defaults are those of
`AppArgs` (the `tiny` preset on CPU). `loadtests/compare.py` spawns this CLI.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

APP_NAME = "stepstream"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cluster.serve_local",
                                description="Serve stepstream on a local Ray.")
    p.add_argument("--config", help="a Serve config YAML (e.g. configs/serve.yaml) as the base")
    p.add_argument("--model", help="preset name (tiny, small) or a local HF directory")
    p.add_argument("--served-model-name")
    p.add_argument("--host", help="default 127.0.0.1")
    p.add_argument("--port", type=int, help="default 8000")
    p.add_argument("--num-scheduler-steps", type=int)
    p.add_argument("--release-per-window", action="store_true",
                   help="release tokens at the end of each multi-step window, not per step")
    p.add_argument("--no-stream-merge", action="store_true",
                   help="one chunk per token between replica and ingress (baseline)")
    p.add_argument("--no-async-output", action="store_true")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--num-kv-blocks", type=int)
    p.add_argument("--min-chunk-interval-ms", type=float)
    p.add_argument("--max-chunks-per-s", type=float,
                   help="chunk budget per engine replica, shared by its streams (0: none)")
    p.add_argument("--num-engine-replicas", type=int)
    p.add_argument("--engine-num-cpus", type=float)
    p.add_argument("--num-threads", type=int, help="torch threads per engine replica")
    p.add_argument("--api-key", help="require 'Authorization: Bearer <key>' "
                   "(default: env STEPSTREAM_API_KEY)")
    p.add_argument("--num-cpus", type=int, help="logical CPUs of the local Ray")
    p.add_argument("--verbose", action="store_true", help="show Ray workers' logs here")
    return p.parse_args(argv)


def _read_config(path: str) -> tuple[dict, dict]:
    import yaml

    with open(path) as f:
        config = yaml.safe_load(f) or {}
    apps = config.get("applications") or [{}]
    return dict(apps[0].get("args") or {}), dict(config.get("http_options") or {})


def app_args(ns: argparse.Namespace) -> tuple[dict, str, int]:
    """(AppArgs dict, host, port) from the config file and the flags."""
    args, http = _read_config(ns.config) if ns.config else ({}, {})
    flags = {"model": ns.model, "served_model_name": ns.served_model_name,
             "num_scheduler_steps": ns.num_scheduler_steps, "max_num_seqs": ns.max_num_seqs,
             "max_model_len": ns.max_model_len, "num_kv_blocks": ns.num_kv_blocks,
             "min_chunk_interval_ms": ns.min_chunk_interval_ms,
             "max_chunks_per_s": ns.max_chunks_per_s,
             "num_engine_replicas": ns.num_engine_replicas,
             "engine_num_cpus": ns.engine_num_cpus, "num_threads": ns.num_threads,
             "api_key": ns.api_key}
    args.update({k: v for k, v in flags.items() if v is not None})
    if ns.release_per_window:
        args["release_per_step"] = False
    if ns.no_stream_merge:
        args["stream_merge"] = False
    if ns.no_async_output:
        args["async_output"] = False
    host = ns.host or http.get("host") or "127.0.0.1"
    port = ns.port or int(http.get("port") or 8000)
    return args, host, port


def wait_healthy(base: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(urllib.error.URLError, OSError):
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        time.sleep(0.5)
    raise TimeoutError(f"{base}/health did not answer 200 within {timeout_s:.0f}s")


def curl_line(base: str, model: str, has_key: bool) -> str:
    body = json.dumps({"model": model, "prompt": "Once upon a time", "max_tokens": 32,
                       "stream": True})
    auth = ' -H "Authorization: Bearer $STEPSTREAM_API_KEY"' if has_key else ""
    return (f"curl -N {base}/v1/completions -H 'Content-Type: application/json'{auth} "
            f"-d '{body}'")


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    args, host, port = app_args(ns)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from cluster.app import AppArgs, make_app

    app_cfg = AppArgs.model_validate(args)  # fail fast, before Ray starts
    num_engines = app_cfg.num_engine_replicas
    num_cpus = ns.num_cpus or max(os.cpu_count() or 2,
                                  int(num_engines * app_cfg.engine_num_cpus + 1))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=ns.verbose)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(make_app(app_cfg), name=APP_NAME, route_prefix="/", blocking=False)
        base = f"http://{host}:{port}"
        wait_healthy(base, timeout_s=600)
        has_key = bool(app_cfg.api_key or os.environ.get("STEPSTREAM_API_KEY"))
        print(f"Serving at {base}/v1", flush=True)
        print(curl_line(base, app_cfg.name_served, has_key), flush=True)
        while not stop.wait(1.0):
            pass
        print("Shutting down", flush=True)
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
