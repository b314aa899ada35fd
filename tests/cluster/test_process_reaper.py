"""The launcher's watchdog (cluster/launcher/process_reaper.py) ends what the
launcher's processes start after its last look too: a process that appears below a
recorded one once the launcher is gone (as the raylet starts its dashboard agent
while a launcher gives up on Ray's start) is ended with it. No Ray."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from cluster.launcher.process_reaper import watch
from cluster.launcher.process_table import read_process

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="Linux only")

# The launcher: starts a child that starts a grandchild 1.5 s later, then exits at once.
LAUNCHER = textwrap.dedent("""
    import subprocess, sys, time
    late = "import subprocess, sys, time; time.sleep(1.5); " \\
           "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \\
           "open(sys.argv[1], 'w').write(str(p.pid)); time.sleep(60)"
    subprocess.Popen([sys.executable, "-c", late, sys.argv[1]], start_new_session=True)
    time.sleep(0.5)
""")


def test_a_process_started_below_a_recorded_one_after_the_launcher_died_is_ended(tmp_path):
    pid_file = tmp_path / "late.pid"
    read_fd, write_fd = os.pipe()
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(pid_file)],
                                pass_fds=(write_fd,))
    os.close(write_fd)  # the launcher holds the only write end
    # NOTE: the grace outlasts the grandchild's start (1.5 s after its parent's) on a
    # machine several times slower than this one
    left = watch(launcher.pid, read_fd, poll_interval_s=0.1, grace_s=8.0, kill_after_s=2.0)
    launcher.wait(10)
    late = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while read_process(late) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert read_process(late) is None, left
