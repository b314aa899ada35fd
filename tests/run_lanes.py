"""`make test`: the whole suite as three pytest processes at once:

- "no Ray": every test that starts no Ray (torch work mostly), at a lower CPU
  priority (nice 10);
- "Ray": every test that runs Ray in the pytest process (one local Ray that
  consecutive modules share, or `ray.cluster_utils` nodes), one module after
  another;
- "front door": every test that starts Ray in a process of its own (the launcher,
  a docs shell running `ray start`): HAProxy binds fixed ports (its stats and
  metrics pages), so these run one after another too (marker `front_door`); and,
  to even the two Ray lanes out, the few tests that start a Ray of their own in
  the pytest process (marker `own_ray`).

Why: the Ray tests spend most of their time waiting (Serve's drains, delays, health
checks, first tokens) while the machine sits idle; two Ray lanes wait side by side
and the torch lane uses what they leave. The lane without Ray runs niced: CPU it
took from the Ray lanes would stretch their waits. The Ray lanes' Ray instances
share nothing: the in-process one picks free ports, the launchers and docs shells
their own (and a docs shell's `ray stop` sees only its own PID namespace).

Each lane's output is printed when it is done, then one closing line with the
counts of all. The exit status is non-zero if any lane failed or ran no test.
Extra arguments go to every lane (e.g. `-x`, `-k NAME`).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# name -> (pytest marker expression, niceness)
LANES = {"no Ray": ("not ray", 10), "Ray": ("ray and not front_door and not own_ray", 0),
         "front door": ("ray and (front_door or own_ray)", 0)}
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def _counts(log: str) -> dict[str, int]:
    """pytest's closing-line counts (the last line that has any)."""
    for line in reversed(log.splitlines()):
        found = _COUNT.findall(line)
        if found and " in " in line:  # "N passed, M skipped in 12.3s" (-q drops the ='s)
            counts: dict[str, int] = {}
            for number, kind in found:
                counts[kind.rstrip("s") if kind.startswith("error") else kind] = int(number)
            return counts
    return {}


# Ray's and Serve's variables a shell may hold (README's second way exports some):
# the in-process Ray lane must start a Ray of its own with Serve's Python proxy, not
# join another cluster or take HAProxy's fixed ports beside the front-door lane.
_SCRUBBED_ENV = ("RAY_ADDRESS", "RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_THROUGHPUT_OPTIMIZED")


def main(argv: list[str]) -> int:
    if any(a == "-m" or a.startswith("-m") and not a.startswith("--") for a in argv):
        print("tests/run_lanes.py picks each lane's tests by marker: run pytest -m ... "
              "yourself (make test-serial TEST_FLAGS=...) to choose by marker", file=sys.stderr)
        return 2
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="stepstream-lanes-") as tmp:
        runs = {}
        for name, (marks, niceness) in LANES.items():
            log_path = Path(tmp) / f"{name.replace(' ', '-')}.log"
            log = open(log_path, "w")
            proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-m", marks, *argv],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, preexec_fn=lambda n=niceness: os.nice(n))
            runs[name] = (proc, log, log_path)
        status = 0
        totals: dict[str, int] = {}
        for name, (proc, log, log_path) in runs.items():
            rc = proc.wait()
            log.close()
            text = log_path.read_text(errors="replace")
            print(f"\n===== lane: {name} (exit {rc}) =====\n{text}", flush=True)
            counts = _counts(text)
            for kind, number in counts.items():
                totals[kind] = totals.get(kind, 0) + number
            # 1: failures, 5: no test ran (only a failure without -k: a -k may match
            # nothing in one lane), others: pytest itself failed
            if rc != 0 and not (rc == 5 and any(a.startswith("-k") for a in argv)):
                status = status or (rc if rc != 5 else 1)
                print(f"lane {name!r} FAILED (pytest exit {rc})", flush=True)
    minutes, seconds = divmod(int(time.monotonic() - started), 60)
    print(f"\nsuite ({minutes}:{seconds:02d}, {len(LANES)} lanes):")
    print(f"{totals.get('passed', 0)} passed, {totals.get('failed', 0) + totals.get('error', 0)} "
          f"failed, {totals.get('skipped', 0)} skipped")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
