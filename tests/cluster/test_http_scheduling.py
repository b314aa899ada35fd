"""cluster/http_scheduling.py: every thread of the process under SCHED_BATCH, those
it starts later too; nothing where `STEPSTREAM_HTTP_SCHED_BATCH=0`. Each case runs in
a process of its own (the suite's own process keeps its policy). That the launcher's
HAProxy and ingress run under it: tests/cluster/test_serve_local_lifecycle.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cluster.http_scheduling import SCHED_BATCH_ENV, wanted

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux's policy")

_PROBE = """
import json, os, threading
from cluster.http_scheduling import batch_this_process
stop = threading.Event()
before = threading.Thread(target=stop.wait); before.start()
changed = batch_this_process()
after = threading.Thread(target=stop.wait); after.start()
policies = sorted(os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task"))
stop.set(); before.join(); after.join()
print(json.dumps({"changed": changed, "policies": policies}))
"""


def _default_policy() -> None:
    """The child starts under SCHED_OTHER whatever runs the suite."""
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


def _probe(env_value: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != SCHED_BATCH_ENV}
    if env_value is not None:
        env[SCHED_BATCH_ENV] = env_value
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         env=env, timeout=60, preexec_fn=_default_policy)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_every_thread_and_those_started_later_run_under_sched_batch():
    probed = _probe(None)
    assert probed["changed"] == 2  # the main thread and the one started before
    assert probed["policies"] == [os.SCHED_BATCH] * 3


def test_zero_leaves_the_default_policy():
    probed = _probe("0")
    assert probed["changed"] == 0
    assert probed["policies"] == [os.SCHED_OTHER] * 3


def test_only_zero_turns_it_off():
    assert wanted({}) and wanted({SCHED_BATCH_ENV: "1"}) and wanted({SCHED_BATCH_ENV: "yes"})
    assert not wanted({SCHED_BATCH_ENV: "0"}) and not wanted({SCHED_BATCH_ENV: " 0 "})
