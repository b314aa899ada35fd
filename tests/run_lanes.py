"""`make test-lanes`: the whole suite as two pytest processes at once, one lane with every
test that starts Ray (`-m ray`) and one with every other test.

Why: the Ray tests spend most of their time waiting (Serve's drains, delays and
health checks) on one core, while the other tests keep a core busy with torch; side
by side on two cores the suite takes about as long as the Ray lane alone. Ray tests
still run one after another, as they must (one local Ray, the shared ports).

The lane without Ray runs at a lower CPU priority (nice 10): the Ray tests wait on
timers (drains, health checks, first tokens), and CPU the other lane took from them
stretched those waits (the Ray lane took 11 minutes so, 10 alone). The other lane
uses what the Ray lane leaves idle.

Each lane's output is printed when it is done, then one closing line with the
counts of both. The exit status is non-zero if either lane failed or ran no test.
Extra arguments go to both lanes (e.g. `-x`, `-k NAME`).
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
LANES = {"no Ray": ("not ray", 10), "Ray": ("ray", 0)}
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


def main(argv: list[str]) -> int:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="stepstream-lanes-") as tmp:
        runs = {}
        for name, (marks, niceness) in LANES.items():
            log_path = Path(tmp) / f"{name.replace(' ', '-')}.log"
            log = open(log_path, "w")
            proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-m", marks, *argv],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    preexec_fn=lambda n=niceness: os.nice(n))
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
            if rc != 0:  # 1: failures, 5: no test ran, others: pytest itself failed
                status = status or (rc if rc != 5 else 1)
                print(f"lane {name!r} FAILED (pytest exit {rc})", flush=True)
    minutes, seconds = divmod(int(time.monotonic() - started), 60)
    print(f"\nsuite ({minutes}:{seconds:02d}, both lanes):")
    print(f"{totals.get('passed', 0)} passed, {totals.get('failed', 0) + totals.get('error', 0)} "
          f"failed, {totals.get('skipped', 0)} skipped")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
