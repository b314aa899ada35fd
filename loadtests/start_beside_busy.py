"""Does the local launcher start, and how soon, on a machine busy with other work?

Runs N busy loops at nice 0 (plain Python `while True: pass`, each in its own process)
and starts `python -m cluster.serve_local` beside them, in the same session, once per
variant (a set of environment variables for the launcher), alternating; prints the
seconds to "Serving at", or how the start failed. Every loop and server is stopped
at the end.

The same session matters: where the kernel schedules by autogroup (common on Linux
distributions, and this machine's; /proc/sys/kernel/sched_autogroup_enabled), each
session outside a container shares the CPU as one group, and niceness counts only
within it. A container's processes (one cgroup) and one
terminal's jobs compete this way; a launcher in a terminal of its own does not.

    python -m loadtests.bench start-beside-busy --busy 2 --variant default= \\
        --variant "ray nice 15=RAY_worker_niceness=15 RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S=5"

Why: Ray runs its workers at nice 15, and Serve kills a proxy that is not ready in
5 s (three checks): beside busy work the app never served (docs/performance.md).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadtests import serving_matrix
from loadtests.local_server import LocalServer

BUSY_LOOP = "while True: pass"


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """'NAME=K=V K2=V2' -> (NAME, {K: V, K2: V2}); 'NAME=' is the launcher as it is.
    The HTTP matrix's variants, environment only: the launcher starts with its
    defaults, from this checkout."""
    server = serving_matrix.parse_variant(text)
    extra = ([f"@{server.tree}"] if server.tree else []) + list(server.flags)
    if extra:
        raise argparse.ArgumentTypeError(f"{extra[0]!r} is not KEY=VALUE")
    return server.name, dict(server.env)


def start_seconds(model: str, env: dict[str, str], timeout_s: float, log: Path,
                  module: str = "cluster.serve_local") -> str:
    """Seconds to a healthy app, or why it did not get there."""
    started = time.monotonic()
    server = LocalServer([], module=module, model=model, env=env, log_path=log,
                         startup_timeout_s=timeout_s, own_session=False)
    try:
        server.start()
    except (RuntimeError, TimeoutError) as e:
        errors = [line for line in log.read_text(errors="replace").splitlines()
                  if line.startswith("error:")]
        why = errors[-1] if errors else str(e).split(" (")[0]
        return f"failed after {time.monotonic() - started:.0f} s: {why}"
    took = time.monotonic() - started
    server.stop()
    return f"{took:.0f} s"


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench start-beside-busy",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--busy", type=int, default=2, help="busy loops at nice 0 beside the launcher")
    p.add_argument("--model", default="tiny")
    p.add_argument("--variant", action="append", type=parse_variant, default=[],
                   help="NAME=KEY=VALUE ...: environment of the launcher (repeatable)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=150.0, help="per start")
    p.add_argument("--module", default="cluster.serve_local", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = make_parser().parse_args(argv)
    variants = ns.variant or [("default", {})]
    logs = Path(tempfile.mkdtemp(prefix="start_beside_busy-"))
    loops = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(ns.busy)]
    try:
        for round_ in range(ns.rounds):
            for name, env in variants:
                log = logs / f"{name.replace(' ', '_')}-{round_}.log"
                print(f"{ns.busy} busy loops, {name}: "
                      f"{start_seconds(ns.model, env, ns.timeout_s, log, ns.module)}", flush=True)
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    print(f"launcher logs: {logs}")
    return 0
