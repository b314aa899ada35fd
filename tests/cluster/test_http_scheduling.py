"""cluster/http_scheduling.py: every thread of the process under SCHED_BATCH, those
it starts later too; nothing where `STEPSTREAM_HTTP_SCHED_BATCH=0`. Each case runs in
a process of its own (the suite's own process keeps its policy). That the launcher's
HAProxy and ingress run under it: tests/cluster/test_serve_local_lifecycle.py."""
from __future__ import annotations

import json
import os
import sys

import pytest

from cluster.http_scheduling import SCHED_BATCH_ENV, wanted
from cluster_support import run_under_default_policy

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


def _probe(sched_batch: str | None) -> dict:
    out = run_under_default_policy([sys.executable, "-c", _PROBE], sched_batch, timeout=60)
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
