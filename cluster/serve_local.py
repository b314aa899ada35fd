"""`python -m cluster.serve_local`: the whole app on a local Ray, one command.

Checks what it can before Ray starts (the model, the HTTP and metrics ports: a
mistake costs one line, not a traceback), starts a local Ray (logical CPUs fixed
by --num-cpus; Prometheus metrics on --metrics-port), Serve's front door on
--host/--port and the app of `cluster.app.build_app`; waits until /health
answers, prints where it serves, the model with the dtype and attention backend
its engine resolved, where the metrics and logs are and a curl line that streams
(cluster/launcher/console.py: also which of Ray's own lines are hidden, and why), and
serves until SIGINT/SIGTERM, then shuts Serve and Ray down, in that order, and
exits 0. A failure to start prints what went wrong and what to do, and exits 1
(2 for flags or a config that cannot work).

The API key comes from the env var STEPSTREAM_API_KEY (or --api-key, which the
process list shows) and reaches the app as its SHA-256 only. Without a key the
app serves on a loopback --host only, unless --allow-unauthenticated
(cluster/api/access.py). --engine-num-gpus gives each engine replica that many GPUs
(its device is then cuda).

Flags override `--config` (a Serve config YAML whose first application's `args`
and `http_options` are the base); without a config the defaults are those of
`AppArgs` (the `tiny` preset on CPU). The HTTP matrix (`python -m loadtests.bench compare`)
and the fake server (`loadtests/fake_server.py`, which parses these flags) use this CLI.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

from cluster.launcher import console, cpu_layout, preflight, process_reaper
from cluster.api.access import API_KEY_ENV, check_access, key_digest
from cluster.launcher.console import curl_line  # noqa: F401 - tests and tools import it from here
from cluster.engine_args import add_engine_flags, engine_flag_values
from cluster.transport.ray_internals import gcs_answers, haproxy_node_dirs
from cluster.launcher.config_file import (ConfigError, ServeConfig, port_number, positive_int,
                                          read_config)
from cluster.launcher.front_door import (FRONT_DOORS, HAPROXY_BINARY_ENV, HAPROXY_COMMAND,
                                         front_door_env, resolve_front_door)

APP_NAME = "stepstream"
RAY_START_TIMED_OUT = "timed out during startup"  # in Ray's exception (ray/_private/node.py)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cluster.serve_local",
                                description="Serve stepstream on a local Ray.")
    p.add_argument("--config", help="a Serve config YAML (e.g. configs/serve.yaml) as the base")
    p.add_argument("--served-model-name")
    p.add_argument("--host", help="default 127.0.0.1")
    p.add_argument("--port", type=port_number, help="default 8000")
    p.add_argument("--metrics-port", type=port_number, default=None,
                   help=f"Ray's Prometheus metrics on http://127.0.0.1:PORT/metrics (default "
                        f"{preflight.DEFAULT_METRICS_PORT}; when that one is taken, a free "
                        "port, printed)")
    # One flag per EngineConfig field (--model, --num-scheduler-steps,
    # --no-async-output, --enforce-eager, ...), so none is forgotten.
    add_engine_flags(p)
    p.add_argument("--release-per-window", dest="release_per_step", action="store_const",
                   const=False, help="= --no-release-per-step: release tokens at the end of "
                   "each multi-step window, not per step")
    p.add_argument("--num-engine-replicas", type=int)
    p.add_argument("--num-ingress-replicas", type=int)
    p.add_argument("--engine-num-cpus", type=float)
    p.add_argument("--engine-num-gpus", type=float,
                   help="GPUs per engine replica (default 0: CPU); > 0 runs the engine on cuda")
    p.add_argument("--api-key", help="require 'Authorization: Bearer <key>'; better the env "
                   "var STEPSTREAM_API_KEY (a flag shows in the process list)")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve without an API key on a non-loopback --host")
    p.add_argument("--num-cpus", type=positive_int, help="logical CPUs of the local Ray")
    p.add_argument("--front-door", choices=FRONT_DOORS, default=None,
                   help="haproxy (the default where Ray ships it: Ray Serve's HAProxy front "
                        "door, plain HTTP) or serve-proxy (Serve's Python HTTP proxy)")
    # NOTE: kept so that older command lines still run; HAProxy is the default now.
    p.add_argument("--fast-front-door", dest="front_door", action="store_const",
                   const="haproxy", help=argparse.SUPPRESS)
    p.add_argument("--verbose", action="store_true",
                   help="show Ray's own console lines and the replicas' logs here")
    return p.parse_args(argv)


def settings_problems(error: ValueError, most: int = 3) -> str:
    """What AppArgs refused, one clause a problem (the key, pydantic's words without
    its echo of every setting and its link)."""
    errors = getattr(error, "errors", None)
    if errors is None:
        return str(error)
    parts = []
    for err in errors(include_url=False)[:most]:
        key = ".".join(str(part) for part in err.get("loc", ()))
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        parts.append(f"{key}: {msg}" if key and key not in msg else msg)
    return "; ".join(parts)


def chosen_args(ns: argparse.Namespace, config: ServeConfig | None = None
                ) -> tuple[dict, dict]:
    """(AppArgs values, http_options) that the config file (`config`, else
    --config's) and the flags set."""
    if config is None and ns.config:
        config = read_config(ns.config)
    args, http = (dict(config.args), dict(config.http_options)) if config else ({}, {})
    flags = {"served_model_name": ns.served_model_name,
             "num_engine_replicas": ns.num_engine_replicas,
             "num_ingress_replicas": ns.num_ingress_replicas,
             "engine_num_cpus": ns.engine_num_cpus,
             "engine_num_gpus": ns.engine_num_gpus,
             "allow_unauthenticated": ns.allow_unauthenticated or None}
    args.update(engine_flag_values(ns))
    args.update({k: v for k, v in flags.items() if v is not None})
    return args, http


def app_args(ns: argparse.Namespace) -> tuple[dict, str, int]:
    """(AppArgs dict, host, port) from the config file and the flags; on a CPU machine
    where neither chooses the replicas, cpu_layout's split of the cores."""
    args, host, port, _ = _app_args_and_layout(ns)
    return args, host, port


def _app_args_and_layout(ns: argparse.Namespace, config: ServeConfig | None = None
                         ) -> tuple[dict, str, int, cpu_layout.CpuLayout | None]:
    """app_args' values and the CPU layout it applied (None: the user chose)."""
    args, http = chosen_args(ns, config)
    layout = cpu_layout.layout_for(args, ray_cpus=ns.num_cpus)
    if layout is not None:
        args.update(layout.app_args())
    _use_key(args, ns.api_key or os.environ.get(API_KEY_ENV))
    host = ns.host or http.get("host") or "127.0.0.1"
    port = ns.port or http.get("port") or 8000
    return args, host, port, layout


def _use_key(args: dict, key: str | None) -> None:
    """The key of --api-key or the environment goes on as its SHA-256 only, so no
    secret sits in the app's arguments; it replaces a key of the config file."""
    if not key:
        return
    args.pop("api_key", None)
    args["api_key_sha256"] = key_digest(key).hex()


def answers_health(base: str, timeout_s: float) -> bool:
    """Whether GET /health answers 200 now."""
    with contextlib.suppress(urllib.error.URLError, OSError):
        with urllib.request.urlopen(base + "/health", timeout=timeout_s) as r:
            return r.status == 200
    return False


def wait_healthy(base: str, timeout_s: float, stop: threading.Event | None = None,
                 failed=None) -> bool:
    """True once /health answers 200; False if `stop` is set first. `failed()`
    returns why the app can never get healthy (raised as RuntimeError), or None."""
    deadline = time.monotonic() + timeout_s
    next_check = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        if stop is not None and stop.is_set():
            return False
        if answers_health(base, timeout_s=5):
            return True
        if failed is not None and time.monotonic() >= next_check:
            why = failed()
            if why:
                raise RuntimeError(why)
            next_check = time.monotonic() + 2.0
        time.sleep(0.5)
    raise TimeoutError(f"{base}/health did not answer 200 within {timeout_s:.0f}s")


def _stop_on_signals(stop: threading.Event) -> None:
    """SIGINT/SIGTERM ask for a clean shutdown; a second one is not graceful."""
    def handler(signum, frame):
        if stop.is_set():
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            raise KeyboardInterrupt
        stop.signum = signum  # read by _drain_serve
        stop.set()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


# NOTE: a SIGTERM sent to the launcher's whole process group (`timeout`, systemd)
# reaches Ray's GCS too, which then stops answering without exiting; Serve's shutdown
# would wait out its 30 s for it. After a SIGTERM the launcher first asks the GCS
# something small, this long at most.
GCS_PROBE_TIMEOUT_S = 3.0


def _drain_serve(stop: threading.Event) -> bool:
    """Whether Serve's drain can run: always, unless the stop was a SIGTERM that left
    the GCS without answers."""
    if getattr(stop, "signum", None) != signal.SIGTERM:
        return True
    return gcs_answers(GCS_PROBE_TIMEOUT_S)


def _stopped_before_serving(stop: threading.Event) -> int:
    """The exit status of a start that a signal cut short: 128 + the signal, as a
    shell reports a process the signal ended, so a supervisor (systemd, a script)
    tells an aborted start from a clean stop after serving (0)."""
    signum = getattr(stop, "signum", signal.SIGINT)
    console.warn(f"stopped before serving ({signal.Signals(signum).name}): the app never "
                 "answered")
    return 128 + signum


def _remove_haproxy_files(node_id: str) -> None:
    """Serve leaves its HAProxy's config, sockets and state in a folder per Ray node
    (/tmp/haproxy-serve/<node id>); each start of the launcher is a new node, so
    without this every `make serve` would leave one more."""
    for path in haproxy_node_dirs(node_id):
        shutil.rmtree(path, ignore_errors=True)


def _last_line(text: str | None) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _deploy_failure() -> str | None:
    """Why the app failed to deploy (Serve gave up on it): each failed deployment's
    last line (a replica constructor's exception), or None."""
    from ray import serve

    def failed(status) -> bool:
        return str(getattr(status, "value", status)) in ("DEPLOY_FAILED", "UNHEALTHY")

    with contextlib.suppress(Exception):
        app = serve.status().applications.get(APP_NAME)
        if app is not None and failed(app.status):
            why = [f"{name}: {_last_line(d.message)}" for name, d in app.deployments.items()
                   if failed(d.status) and d.message]
            return "; ".join(why) or _last_line(app.message) or "the app failed to deploy"
    return None


def _engine_facts() -> dict:
    """What the engine resolved (dtype, device, attention backend) and its KV cache.

    NOTE: the handle's router runs in a loop of its own: with Serve's throughput-
    optimized mode (the HAProxy front door) it would default to the caller's event
    loop, which this thread does not have."""
    from ray import serve

    with contextlib.suppress(Exception):  # the console line then lacks the details
        handle = serve.get_deployment_handle("EngineReplica", app_name=APP_NAME)
        handle._init(_run_router_in_separate_loop=True)
        info = handle.model_info.remote().result(timeout_s=30)
        stats = handle.stats.remote().result(timeout_s=30)
        return {**info, "num_kv_blocks": stats.get("num_total_blocks")}
    return {}


def _logs_dir() -> str | None:
    import ray

    with contextlib.suppress(Exception):
        context = ray.get_runtime_context()
        return os.path.join(context.get_temp_dir(), context.get_session_name(), "logs", "serve")
    return None


def _preflight(app_cfg, host: str, port: int, requested_metrics_port: int | None
               ) -> tuple[int | None, int]:
    """(metrics port, 0), or (None, exit status) after saying what is wrong."""
    problem = preflight.model_problem(app_cfg.model)
    if problem:
        console.error(problem, "pass --model smollm2-135m or tiny, a .gguf file or a local "
                      "Hugging Face checkpoint directory")
        return None, 2
    problem = preflight.bind_problem(host, port)
    if problem:
        console.error(f"{problem}: another server, or a stepstream still running?",
                      f"pass another port: --port {port + 1} "
                      f"(make serve SERVE_FLAGS=\"--port {port + 1}\")")
        return None, 1
    mport, problem = preflight.metrics_port(requested_metrics_port)
    if mport is None:
        console.error(f"{problem}, so Ray cannot export its metrics there",
                      f"pass another port: --metrics-port {requested_metrics_port + 1}")
        return None, 1
    if problem:
        console.warn(problem)
    return mport, 0


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    if ns.api_key:
        console.warn(f"--api-key shows in the process list; prefer the env var {API_KEY_ENV}")
    try:
        config = read_config(ns.config) if ns.config else None
        args, host, port, layout = _app_args_and_layout(ns, config)
    except ConfigError as e:
        console.error(f"--config: {e}")
        return 2
    if config is not None and config.unused:
        console.warn(f"--config: the launcher serves applications[0].args on http_options' "
                     f"host and port; not applied: {', '.join(config.unused)} (serve run or "
                     "serve deploy apply the whole file)")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # NOTE: Ray starts its workers at nice 15, behind every process at nice 0 in the
    # same scheduling group (its container, or its session where the kernel groups by
    # autogroup). Beside busy work there the app's replicas and proxy starve: on 2
    # cores beside 2 busy processes the launcher never served (Serve killed its proxy
    # as not ready); at nice 0 it served in 21 s (docs/performance.md). A server's
    # replicas take their fair share; a RAY_worker_niceness of the user's own stays.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # NOTE: token auth is what Ray picks for a new local instance anyway; set, it is
    # picked without Ray's notice that suggests turning it off.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    front_door, why = resolve_front_door(ns.front_door)
    # NOTE: before Ray starts: Serve reads these once, in every process.
    door_env = front_door_env(front_door, local=True)
    os.environ.update(door_env)
    from cluster.app import AppArgs

    try:
        app_cfg = AppArgs.model_validate(args)  # fail fast, before Ray starts
    except ValueError as e:
        console.error(f"invalid settings: {settings_problems(e)}")
        return 2
    has_key = app_cfg.api_key_digest() is not None
    try:
        warning = check_access(host, has_key, app_cfg.allow_unauthenticated)
    except ValueError as e:
        console.error(str(e))
        return 2
    if warning:
        console.warn(warning)
    mport, status = _preflight(app_cfg, host, port, ns.metrics_port)
    if mport is None:
        return status
    console.say(f"Front door: {front_door} ({why})")
    if front_door == "haproxy" and HAPROXY_BINARY_ENV not in door_env:
        console.warn(f"{HAPROXY_COMMAND} is not installed (pip install the project): HAProxy "
                     "runs with splicing, and a non-streamed request whose client leaves "
                     "may run to its last token (RELIABILITY.md, promise 2)")
    if layout is not None:
        console.say(f"Replicas: {layout.describe()} (one engine replica per core up to "
                    f"{cpu_layout.ONE_PER_CORE_UP_TO}: docs/operations.md; "
                    "--num-engine-replicas and --engine-num-cpus choose others)")
    return _serve(ns, app_cfg, host, port, mport, has_key)


def _serve(ns, app_cfg, host: str, port: int, mport: int, has_key: bool) -> int:
    import ray
    from ray import serve

    num_engines = app_cfg.num_engine_replicas
    num_cpus = ns.num_cpus or max(os.cpu_count() or 2, int(
        num_engines * app_cfg.engine_num_cpus * app_cfg.tensor_parallel_size + 1))
    if not ns.verbose:
        console.quiet_ray()
    stop = threading.Event()
    _stop_on_signals(stop)
    # Ends Ray's processes (workers, agents, HAProxy) if this process dies uncleanly.
    reaper = process_reaper.start()
    mode = os.environ["RAY_AUTH_MODE"]
    auth = "token auth on" if mode == "token" else f"RAY_AUTH_MODE={mode}"
    console.say(f"Starting a local Ray ({num_cpus} CPUs, {auth}), Serve and the app")
    # NOTE: address="local": always a Ray of its own, even when `ray start` left one
    # running (connecting to it would refuse num_cpus).
    try:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 log_to_driver=ns.verbose, _metrics_export_port=mport,
                 logging_level=logging.INFO if ns.verbose else logging.WARNING)
    except Exception as e:
        # NOTE: Ray waits a fixed 30 s for its node to register; on a machine busy
        # with other work that can run out. What it started, the watchdog ends.
        if RAY_START_TIMED_OUT not in str(e):
            raise
        console.error("Ray's node did not register within Ray's fixed 30 s: this machine "
                      "is too busy to start it now", "start it again (exit status "
                      f"{console.EXIT_TRY_AGAIN}: a temporary failure)")
        return console.EXIT_TRY_AGAIN
    # NOTE: again: ray.init installs its own SIGTERM handler (sys.exit(15)).
    _stop_on_signals(stop)
    node_id = ray.get_runtime_context().get_node_id()
    if reaper is not None and reaper.poll() is not None:
        console.warn("the watchdog that ends Ray's processes if this launcher dies did not "
                     f"start (exit {reaper.returncode}); a SIGKILL may leave them running")
    status = 0
    try:
        status = _run_app(app_cfg, host, port, mport, has_key, stop)
        console.say("Shutting down")
    finally:
        # Serve first (it drains and stops its replicas), then Ray: unless the signal
        # went to the whole process group and Ray's own processes are gone with it
        if _drain_serve(stop):
            with contextlib.suppress(Exception):
                serve.shutdown()
        else:
            console.warn("Ray's GCS does not answer (the SIGTERM went to the whole process "
                         "group): stopping without draining Serve's replicas")
        ray.shutdown()
        _remove_haproxy_files(node_id)
    console.say("Stopped")
    return status


def _run_app(app_cfg, host: str, port: int, mport: int, has_key: bool,
             stop: threading.Event) -> int:
    """Start Serve and the app, say where it serves, wait for a signal; the exit status."""
    import ray
    from ray import serve

    from cluster.app import make_app

    # NOTE: a tensor-parallel replica's ranks each take a bundle of engine_num_gpus
    problem = preflight.gpu_problem(app_cfg.engine_num_gpus * app_cfg.num_engine_replicas
                                    * app_cfg.tensor_parallel_size,
                                    ray.cluster_resources().get("GPU", 0.0))
    if problem:
        console.error(problem)
        return 1
    logs = _logs_dir()
    see_logs = f"the replicas' logs: {logs}" if logs else "--verbose shows Ray's own lines"
    base = f"http://{host}:{port}"
    try:
        if stop.is_set():
            return _stopped_before_serving(stop)
        serve.start(http_options={"host": host, "port": port})
        serve.run(make_app(app_cfg), name=APP_NAME, route_prefix="/", blocking=False)
        if not wait_healthy(base, timeout_s=600, stop=stop, failed=_deploy_failure):
            # NOTE: the app may have answered others before this loop saw it (its
            # check of Serve's status can take seconds on a busy machine): a stop
            # then ends a server that served, as after "Serving at"
            if answers_health(base, timeout_s=2):
                return 0
            return _stopped_before_serving(stop)
    except Exception as e:  # noqa: BLE001 - said in a line; --verbose shows Ray's output
        why = _deploy_failure() or _last_line(str(e)) or type(e).__name__
        console.error(f"the app did not start: {why}", see_logs)
        return 1
    facts = _engine_facts()
    if facts.get("num_kv_blocks"):
        facts["num_kv_tokens"] = facts["num_kv_blocks"] * app_cfg.block_size
    console.say(console.model_line(facts or {"model": app_cfg.model}, app_cfg.num_engine_replicas,
                                   app_cfg.num_ingress_replicas, app_cfg.engine_num_gpus))
    console.say(f"Serving at {base}/v1")
    console.say(f"Metrics at http://127.0.0.1:{mport}/metrics (Prometheus; names "
                "ray_stepstream_*: docs/operations.md)")
    if logs:
        console.say(f"Logs in {logs}")
    console.say(curl_line(base, app_cfg.name_served, has_key))
    console.say("Ctrl-C stops Serve and Ray")
    while not stop.wait(1.0):
        pass
    return 0


def run(argv: list[str] | None = None) -> int:
    """main(), where a second Ctrl-C (or SIGTERM) during the shutdown ends it at once:
    a line and exit status 130, not a traceback; the watchdog ends what is left."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        console.warn("stopped before a clean shutdown (a second Ctrl-C or SIGTERM): the "
                     "watchdog ends Ray's processes within seconds")
        return 130


if __name__ == "__main__":
    sys.exit(run())
