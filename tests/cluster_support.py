"""Helpers for the cluster tests: a local Ray + Serve app fixture, replica stats,
polling.

Not a test module. Each test module builds ONE app (module-scoped fixture) and
always shuts Serve down. The local Ray under it is shared by consecutive modules
marked `shared_ray` (a start costs seconds on 2 cores): tests/conftest.py shuts it
down before the first test that is not, so no other test sees it.
"""
from __future__ import annotations

import contextlib
import os
import socket
import time

import httpx

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SHARED_RAY_CPUS = 4
_shared_ray_config: dict | None = None  # the system config of the running shared Ray


def shared_ray(system_config: dict | None = None) -> None:
    """Start the shared local Ray, unless it runs with this `system_config` (Ray's
    `_system_config`) already; one with another is shut down first."""
    global _shared_ray_config
    import ray

    wanted = dict(system_config or {})
    if _shared_ray_config == wanted and ray.is_initialized():
        return
    shut_down_shared_ray()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # NOTE: address "local": a Ray of its own, never a cluster `ray start` left running.
    ray.init(address="local", num_cpus=SHARED_RAY_CPUS, include_dashboard=False,
             log_to_driver=False,
             configure_logging=False, _system_config=wanted)
    _shared_ray_config = wanted


def shut_down_shared_ray() -> None:
    global _shared_ray_config
    if _shared_ray_config is None:
        return
    import ray

    _shared_ray_config = None
    ray.shutdown()


@contextlib.contextmanager
def serve_app(app_args: dict, system_config: dict | None = None):
    """Start Serve on a free port of the shared local Ray with one app; yield the
    base URL. Serve shuts down afterwards; Ray stays for the next module."""
    from ray import serve

    from cluster.app import AppArgs, make_app

    shared_ray(system_config)
    try:
        # NOTE: the port is picked after Ray started, whose processes take ports too.
        port = _start_serve_on_a_free_port(free_port())
        serve.run(make_app(AppArgs.model_validate(app_args)),
                  name="stepstream", route_prefix="/", blocking=False)
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base)
        yield base
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()


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
