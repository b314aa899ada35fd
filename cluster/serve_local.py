"""`python -m cluster.serve_local`: the whole app on a local Ray, one command.

Starts a local Ray (logical CPUs fixed by --num-cpus), Serve's HTTP proxy on
--host/--port, and the app of `cluster.app.build_app`; waits until /health
answers, prints the URL and a curl line that streams a completion, and serves
until SIGINT/SIGTERM, then shuts Serve and Ray down, in that order, and exits 0.

The API key comes from the env var STEPSTREAM_API_KEY (or --api-key, which the
process list shows) and reaches the app as its SHA-256 only. Without a key the
app serves on a loopback --host only, unless --allow-unauthenticated
(cluster/access.py).

Flags override `--config` (a Serve config YAML whose first application's `args`
and `http_options` are the base); without a config the defaults are those of
`AppArgs` (the `tiny` preset on CPU). The HTTP matrix (`python -m loadtests.bench compare`)
and the fake server (`loadtests/fake_server.py`, which parses these flags) use this CLI.
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

from cluster import process_reaper
from cluster.access import API_KEY_ENV, check_access, key_digest
from cluster.engine_args import add_engine_flags, engine_flag_values
from cluster.front_door import FRONT_DOORS, front_door_env, resolve_front_door

APP_NAME = "stepstream"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cluster.serve_local",
                                description="Serve stepstream on a local Ray.")
    p.add_argument("--config", help="a Serve config YAML (e.g. configs/serve.yaml) as the base")
    p.add_argument("--served-model-name")
    p.add_argument("--host", help="default 127.0.0.1")
    p.add_argument("--port", type=int, help="default 8000")
    # One flag per EngineConfig field (--model, --num-scheduler-steps,
    # --no-async-output, --enforce-eager, ...), so none is forgotten.
    add_engine_flags(p)
    p.add_argument("--release-per-window", dest="release_per_step", action="store_const",
                   const=False, help="= --no-release-per-step: release tokens at the end of "
                   "each multi-step window, not per step")
    p.add_argument("--num-engine-replicas", type=int)
    p.add_argument("--num-ingress-replicas", type=int)
    p.add_argument("--engine-num-cpus", type=float)
    p.add_argument("--api-key", help="require 'Authorization: Bearer <key>'; better the env "
                   "var STEPSTREAM_API_KEY (a flag shows in the process list)")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve without an API key on a non-loopback --host")
    p.add_argument("--num-cpus", type=int, help="logical CPUs of the local Ray")
    p.add_argument("--front-door", choices=FRONT_DOORS, default=None,
                   help="haproxy (the default where Ray ships it: Ray Serve's HAProxy front "
                        "door, plain HTTP) or serve-proxy (Serve's Python HTTP proxy)")
    # NOTE: kept so that older command lines still run; HAProxy is the default now.
    p.add_argument("--fast-front-door", dest="front_door", action="store_const",
                   const="haproxy", help=argparse.SUPPRESS)
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
    flags = {"served_model_name": ns.served_model_name,
             "num_engine_replicas": ns.num_engine_replicas,
             "num_ingress_replicas": ns.num_ingress_replicas,
             "engine_num_cpus": ns.engine_num_cpus,
             "allow_unauthenticated": ns.allow_unauthenticated or None}
    args.update(engine_flag_values(ns))
    args.update({k: v for k, v in flags.items() if v is not None})
    _use_key(args, ns.api_key or os.environ.get(API_KEY_ENV))
    host = ns.host or http.get("host") or "127.0.0.1"
    port = ns.port or int(http.get("port") or 8000)
    return args, host, port


def _use_key(args: dict, key: str | None) -> None:
    """The key of --api-key or the environment goes on as its SHA-256 only, so no
    secret sits in the app's arguments; it replaces a key of the config file."""
    if not key:
        return
    args.pop("api_key", None)
    args["api_key_sha256"] = key_digest(key).hex()


def wait_healthy(base: str, timeout_s: float, stop: threading.Event | None = None) -> bool:
    """True once /health answers 200; False if `stop` is set first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stop is not None and stop.is_set():
            return False
        with contextlib.suppress(urllib.error.URLError, OSError):
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return True
        time.sleep(0.5)
    raise TimeoutError(f"{base}/health did not answer 200 within {timeout_s:.0f}s")


def _stop_on_signals(stop: threading.Event) -> None:
    """SIGINT/SIGTERM ask for a clean shutdown; a second one is not graceful."""
    def handler(signum, frame):
        if stop.is_set():
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            raise KeyboardInterrupt
        stop.set()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def curl_line(base: str, model: str, has_key: bool) -> str:
    body = json.dumps({"model": model, "prompt": "Once upon a time", "max_tokens": 32,
                       "stream": True})
    auth = ' -H "Authorization: Bearer $STEPSTREAM_API_KEY"' if has_key else ""
    return (f"curl -N {base}/v1/completions -H 'Content-Type: application/json'{auth} "
            f"-d '{body}'")


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    if ns.api_key:
        print(f"warning: --api-key shows in the process list; prefer the env var {API_KEY_ENV}",
              file=sys.stderr, flush=True)
    args, host, port = app_args(ns)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    front_door, why = resolve_front_door(ns.front_door)
    # NOTE: before Ray starts: Serve reads these once, in every process.
    os.environ.update(front_door_env(front_door, local=True))
    import ray
    from ray import serve

    from cluster.app import AppArgs, make_app

    app_cfg = AppArgs.model_validate(args)  # fail fast, before Ray starts
    has_key = app_cfg.api_key_digest() is not None
    try:
        warning = check_access(host, has_key, app_cfg.allow_unauthenticated)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    num_engines = app_cfg.num_engine_replicas
    num_cpus = ns.num_cpus or max(os.cpu_count() or 2,
                                  int(num_engines * app_cfg.engine_num_cpus + 1))
    stop = threading.Event()
    _stop_on_signals(stop)
    # Ends Ray's processes (workers, agents, HAProxy) if this process dies uncleanly.
    reaper = process_reaper.start()
    # NOTE: address="local": always a Ray of its own, even when `ray start` left one
    # running (connecting to it would refuse num_cpus).
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
             log_to_driver=ns.verbose)
    # NOTE: again: ray.init installs its own SIGTERM handler (sys.exit(15)).
    _stop_on_signals(stop)
    if reaper is not None and reaper.poll() is not None:
        print("warning: the watchdog that ends Ray's processes if this launcher dies did "
              f"not start (exit {reaper.returncode}); a SIGKILL may leave them running",
              file=sys.stderr, flush=True)
    try:
        base = f"http://{host}:{port}"
        print(f"Front door: {front_door} ({why})", flush=True)
        if not stop.is_set():
            serve.start(http_options={"host": host, "port": port})
            serve.run(make_app(app_cfg), name=APP_NAME, route_prefix="/", blocking=False)
        if not stop.is_set() and wait_healthy(base, timeout_s=600, stop=stop):
            print(f"Serving at {base}/v1", flush=True)
            print(curl_line(base, app_cfg.name_served, has_key), flush=True)
            while not stop.wait(1.0):
                pass
        print("Shutting down", flush=True)
    finally:
        # Serve first (it drains and stops its replicas), then Ray.
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
    print("Stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
