"""`python -m cluster.serve_local` (what `make serve` runs) stopped with SIGTERM
shuts Serve, then Ray, down and exits 0; killed with SIGKILL, its watchdog
(`cluster/launcher/process_reaper.py`) ends what it started. Either way no process it
started stays behind: not its group, and not Ray's workers, agents or HAProxy,
which run in sessions of their own. (Ray installs its own SIGTERM handler, which
exits 15 without a clean shutdown; the launcher takes the signal back after
`ray.init`.)"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from cluster.launcher.process_reaper import alive, descendants
from cluster_support import free_port

pytestmark = [pytest.mark.ray, pytest.mark.front_door, pytest.mark.timeout(300)]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _start(tmp_path, port: int) -> tuple[subprocess.Popen, object]:
    log = tmp_path / "serve_local.log"
    env = {k: v for k, v in os.environ.items()
           if k not in ("STEPSTREAM_API_KEY", "STEPSTREAM_HTTP_SCHED_BATCH")}
    # NOTE: `tiny`: what starts and stops is the same for any model; the trained
    # preset's load is the docs' `make serve` test's
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cluster.serve_local", "--model", "tiny", "--port", str(port),
             "--num-cpus", "2", "--max-num-seqs", "4", "--num-kv-blocks", "64",
             "--max-model-len", "256"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env=env)
    deadline = time.monotonic() + 240
    while b"Serving at" not in log.read_bytes():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    return proc, log


def _wait_gone(started: dict[int, int], timeout_s: float) -> dict[int, int]:
    deadline = time.monotonic() + timeout_s
    while alive(started) and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive(started)


def _named(pids) -> dict[int, str]:
    """pid -> command line of those still readable."""
    from cluster.launcher.process_table import cmdline

    return {pid: name[:80] for pid in pids if (name := cmdline(pid))}


def _names(pids) -> list[str]:
    return list(_named(pids).values())


def _haproxy_config_dir(pids) -> str:
    """The folder of the config file the running HAProxy reads (`-f PATH`)."""
    from cluster.launcher.process_table import cmdline

    for pid in pids:
        args = (cmdline(pid) or "").split()
        if "-f" in args and _is_haproxy(args):
            return os.path.dirname(args[args.index("-f") + 1])
    raise AssertionError(f"no HAProxy among {_names(pids)}")


def _is_haproxy(args: list[str]) -> bool:
    return bool(args) and args[0].endswith("haproxy")


def _policies(pids, is_it) -> set[int]:
    """The scheduling policies of every thread of the processes whose whole command
    line (split) `is_it` accepts."""
    from cluster.launcher.process_table import cmdline

    policies = set()
    for pid in pids:
        if not is_it((cmdline(pid) or "").split()):
            continue
        try:
            thread_ids = os.listdir(f"/proc/{pid}/task")
        except OSError:  # the process ended meanwhile (an HAProxy reload)
            continue
        for tid in thread_ids:
            try:
                policies.add(os.sched_getscheduler(int(tid)))
            except OSError:  # the thread ended meanwhile
                pass
    return policies


def _named_like(part: str):
    return lambda args: any(part in arg for arg in args)


def test_sigterm_shuts_serve_then_ray_down_and_exits_0(tmp_path):
    proc, log = _start(tmp_path, free_port())
    try:
        started = descendants(proc.pid)
        assert any("EngineReplica" in n for n in _names(started)), _names(started)
        haproxy_dir = _haproxy_config_dir(started)
        assert os.path.isdir(haproxy_dir), haproxy_dir
        # the HTTP side under SCHED_BATCH (cluster/http_scheduling.py), the engine not
        assert _policies(started, _is_haproxy) == {os.SCHED_BATCH}
        assert _policies(started, _named_like("ServeReplica:stepstream:Ingress")) == {
            os.SCHED_BATCH}
        engine_policies = _policies(started, _named_like("ServeReplica:stepstream:EngineReplica"))
        assert engine_policies and os.SCHED_BATCH not in engine_policies
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, log.read_text()[-3000:]
        # Serve leaves its HAProxy's folder (one per Ray node, so one per start)
        assert not os.path.exists(haproxy_dir), "the launcher left HAProxy's files"
        text = log.read_text()
        assert text.index("Shutting down") < text.index("Stopped")
        assert "No API key" in text  # no key: loopback only, with a warning
        assert "Front door: haproxy" in text  # the default on Linux
        left = _wait_gone(started, 30)
        assert not left, f"left after SIGTERM: {_names(left)}"
        assert not _group_alive(proc.pid), "Ray's processes outlived the launcher"
    finally:
        if proc.poll() is None or _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the watchdog reads /proc")
def test_sigkill_of_the_launcher_leaves_nothing_behind(tmp_path):
    port = free_port()
    proc, log = _start(tmp_path, port)
    started = descendants(proc.pid)
    try:
        assert any("haproxy" in n for n in _names(started)), _names(started)
        reaper = [p for p, n in _named(started).items() if "process_reaper" in n]
        proc.kill()  # SIGKILL: no clean-up of its own
        proc.wait(10)
        left = _wait_gone(started, 45)
        assert not left, f"left after SIGKILL: {_names(left)}"
        assert not _port_open(port), "the HTTP port is still taken"
        assert reaper and not alive({p: started[p] for p in reaper})  # the watchdog ended too
    finally:
        for pid in alive(started):
            os.kill(pid, signal.SIGKILL)
