"""Helpers for the cluster tests: a local Ray + Serve app fixture, replica stats,
polling.

Not a test module. Each test module builds ONE app (module-scoped fixture) and
always deletes it. The local Ray under it is shared by consecutive modules
marked `shared_ray` (a start costs seconds on 2 cores), and so is Serve on it (each
module deploys its app and deletes it afterwards): tests/conftest.py runs those
modules first and shuts Ray down before the first test that is not, so no other
test sees it.
"""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time

import httpx


def run_under_default_policy(args: list[str], sched_batch: str | None,
                             env: dict[str, str] | None = None,
                             **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(args)` in a child started under SCHED_OTHER whatever runs the
    suite, with STEPSTREAM_HTTP_SCHED_BATCH set to `sched_batch`, or unset for None
    (cluster/http_scheduling.py)."""
    from cluster.http_scheduling import SCHED_BATCH_ENV

    env = {k: v for k, v in (os.environ if env is None else env).items() if k != SCHED_BATCH_ENV}
    if sched_batch is not None:
        env[SCHED_BATCH_ENV] = sched_batch
    return subprocess.run(args, env=env, preexec_fn=_default_policy, capture_output=True,
                          text=True, **kwargs)


def _default_policy() -> None:
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SHARED_RAY_CPUS = 4
# NOTE: a replica being stopped (a module's app deleted, a redeploy, a scale-down)
# waits for its open per-step channels, which close after this long without
# requests (5 s by default); a module that tests the idle close sets its own.
TEST_CHANNEL_IDLE_CLOSE_S = 1.0
# NOTE: and Serve looks for its running requests every 2 s by default, after a first
# wait as long: every module's app deletion waited for it.
TEST_SHUTDOWN_WAIT_LOOP_S = 0.25
# NOTE: one system config for every module that shares the Ray, so none restarts it:
# Ray exports what workers recorded every second (the metrics tests wait for it).
SHARED_RAY_SYSTEM_CONFIG = {"metrics_report_interval_ms": 1000}
_shared_ray_config: dict | None = None  # the system config of the running shared Ray
_shared_serve_port: int | None = None  # Serve's HTTP port on the shared Ray, once started
shared_ray_starts = 0  # how many times this process started the shared Ray


def init_local_ray(**kwargs) -> None:
    """`ray.init(address="local", **kwargs)`, once more if Ray's node missed its fixed
    30 s to register (beside the suite's other lanes the machine can be that busy; the
    launcher tells a user to start it again then): the Ray processes the failed start
    left in this process's tree are ended first."""
    import psutil
    import ray

    from cluster.serve_local import RAY_START_TIMED_OUT

    try:
        ray.init(address="local", **kwargs)
        return
    except Exception as e:
        if RAY_START_TIMED_OUT not in str(e):
            raise
    ray.shutdown()
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.name() in ("gcs_server", "raylet") or "/ray/" in " ".join(child.cmdline()):
                child.kill()
    ray.init(address="local", **kwargs)


def shared_ray(system_config: dict | None = None) -> None:
    """Start the shared local Ray, unless it runs with this `system_config` (Ray's
    `_system_config`; default SHARED_RAY_SYSTEM_CONFIG) already; one with another is
    shut down first."""
    global _shared_ray_config, shared_ray_starts
    import ray

    wanted = dict(SHARED_RAY_SYSTEM_CONFIG if system_config is None else system_config)
    if _shared_ray_config == wanted and ray.is_initialized():
        return
    shut_down_shared_ray()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # NOTE: address "local": a Ray of its own, never a cluster `ray start` left running.
    init_local_ray(num_cpus=SHARED_RAY_CPUS, include_dashboard=False, log_to_driver=False,
                   configure_logging=False, _system_config=dict(wanted))
    # NOTE: a copy above: ray.init adds its own keys to the dict it is given (object
    # spilling), and the one kept here must compare equal to the next module's ask.
    _shared_ray_config = wanted
    shared_ray_starts += 1


def shut_down_shared_ray() -> None:
    global _shared_ray_config, _shared_serve_port
    if _shared_ray_config is None:
        return
    import ray
    from ray import serve

    if _shared_serve_port is not None:
        with contextlib.suppress(Exception):
            serve.shutdown()
    _shared_ray_config = _shared_serve_port = None
    ray.shutdown()


def _shared_serve() -> int:
    """Serve on the shared Ray (started once, on a free port): its HTTP port.

    Why shared: a Serve start (controller, proxy) costs seconds on a busy machine, and
    shutting one down just before the next starts once raced with the old controller,
    which killed the new proxy."""
    global _shared_serve_port
    if _shared_serve_port is None:
        # NOTE: the port is picked after Ray started, whose processes take ports too.
        _shared_serve_port = _start_serve_on_a_free_port(free_port())
    return _shared_serve_port


def with_test_defaults(app_args: dict) -> dict:
    """`app_args` over the test apps' defaults (TEST_CHANNEL_IDLE_CLOSE_S,
    TEST_SHUTDOWN_WAIT_LOOP_S)."""
    return {"channel_idle_close_s": TEST_CHANNEL_IDLE_CLOSE_S,
            "graceful_shutdown_wait_loop_s": TEST_SHUTDOWN_WAIT_LOOP_S, **app_args}


@contextlib.contextmanager
def serve_app(app_args: dict, system_config: dict | None = None):
    """Deploy one app on Serve on the shared local Ray; yield the base URL. The app is
    deleted afterwards (its replicas stopped); Serve and Ray stay for the next module."""
    from ray import serve

    from cluster.app import AppArgs, make_app

    shared_ray(system_config)
    try:
        port = _shared_serve()
        serve.run(make_app(AppArgs.model_validate(with_test_defaults(app_args))),
                  name="stepstream", route_prefix="/", blocking=False)
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base)
        yield base
    finally:
        with contextlib.suppress(Exception):
            serve.delete("stepstream")


def _start_serve_on_a_free_port(port: int, num_tries: int = 3, **start_options) -> int:
    """serve.start on `port` (and `start_options`); if another process took the port
    since it was picked (a free port is only free when asked), again on a new one;
    if its HTTP proxy was killed while starting, again.

    NOTE: the proxy case: on a busy machine the previous module's Serve controller,
    restarted to finish its graceful shutdown, once killed the proxy that this
    start had just created under the same per-node name (ActorDiedError: "killed
    by `ray.kill`")."""
    from ray import serve

    for attempt in range(num_tries):
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port}, **start_options)
            return port
        except Exception as e:  # noqa: BLE001 - Ray wraps the proxy's bind error
            proxy_killed = "ProxyActor" in str(e) and "ray.kill" in str(e)
            if not ("Failed to bind" in str(e) or proxy_killed) or attempt == num_tries - 1:
                raise
            with contextlib.suppress(Exception):
                serve.shutdown()
            if proxy_killed:
                time.sleep(2.0)  # the old controller's shutdown runs out
            port = free_port()
    return port


def wait_healthy(base: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{base}/health did not turn 200 within {timeout_s}s")


def engine_handle():
    from ray import serve

    return serve.get_deployment_handle("EngineReplica", app_name="stepstream")


def replica_stats(handle, num_calls: int = 1) -> list[dict]:
    return [handle.stats.remote().result(timeout_s=30) for _ in range(num_calls)]


def engine_states(app: str = "stepstream") -> dict[str, int]:
    """{state: number of engine replicas}, as `serve status` shows them."""
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None or "EngineReplica" not in status.deployments:
        return {}
    return {str(k): v for k, v in status.deployments["EngineReplica"].replica_states.items()
            if v}


def wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)
