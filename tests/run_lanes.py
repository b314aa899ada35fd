"""`make test`: the whole suite as four pytest processes at once:

- "engine" and "no Ray": every test that starts no Ray (torch work mostly), at a
  lower CPU priority (nice 10), in two lanes: the engine's tests (marker `engine`,
  tests/replicas and tests/gpu but their two longest modules: tests/conftest.py) and
  the rest. A pytest process uses one core, and the
  Ray lanes leave about one of two idle on average: one lane of these took about 9.5
  minutes beside them, twice its time alone;
- "Ray": every test that runs Ray in the pytest process (one local Ray that
  consecutive modules share, or `ray.cluster_utils` nodes), one module after
  another, then the few that start a Ray of their own in the pytest process (marker
  `own_ray`), which this lane has the time for;
- "front door": every test that starts Ray in a process of its own (the launcher,
  a docs shell running `ray start`): HAProxy binds fixed ports (its stats and
  metrics pages), so these run one after another too (marker `front_door`).

Why: the Ray tests spend most of their time waiting (Serve's drains, delays, health
checks, first tokens) while the machine sits idle; two Ray lanes wait side by side
and the two torch lanes use what they leave. The lanes without Ray run niced: CPU
they took from the Ray lanes would stretch their waits (and Ray's workers run at their
lane's priority, not the 15 nicer Ray starts them at). The Ray lanes' Ray instances
share nothing: the in-process one picks free ports, the launchers and docs shells
their own (and a docs shell's `ray stop` sees only its own PID namespace).

Each lane sees every lane's pid in the file STEPSTREAM_LANE_PIDS_FILE names: a
test that slows the machine on purpose (a busy loop) waits for the other lanes to
end instead, as they keep the machine busier than the loop would. Such a test
(marker `slows_the_machine`) runs last in its lane, when the others are ending.

Each lane's output is printed when it is done, then one closing line with the
counts of all. The exit status is non-zero if any lane failed or ran no test.
Extra arguments go to every lane (e.g. `-x`, `-k NAME`).

A test that fails beside the other lanes runs once more, alone, after all of them
(at most MAX_RUN_ALONE tests; more failures than that, or a lane that broke in
another way, fail the suite at once). Many tests bound a wait (a first token, a
stream's largest gap, a replica's start) for the load they make themselves; on a
slow machine two other lanes beside them can stretch that wait past its bound. A
test that also fails alone fails the suite; one that passes alone is named in the
closing lines, so a test that only holds on a quiet machine stays in sight.
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
LANES = {"engine": ("not ray and engine", 10), "no Ray": ("not ray and not engine", 10),
         "Ray": ("ray and not front_door", 0), "front door": ("ray and front_door", 0)}
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")
# pytest's short summary: "FAILED tests/x.py::test_y[a b] - AssertionError: ..."
_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S.*?)(?: - .*)?$")
MAX_RUN_ALONE = 8
LANE_PIDS_FILE_ENV = "STEPSTREAM_LANE_PIDS_FILE"  # read by tests/reliability_support.py
RAY_WORKER_NICENESS_ENV = "RAY_worker_niceness"  # added to the niceness of Ray's starter


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


def _failed_tests(log: str) -> list[str]:
    """The node ids of pytest's FAILED and ERROR summary lines, in order, once each."""
    found = (_FAILED.match(line) for line in log.splitlines())
    return list(dict.fromkeys(m.group(1) for m in found if m))


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
    # NOTE: Ray starts its workers 15 nicer than the process that starts it: the Ray
    # lane's replicas would run behind the niced lane's torch work, the reverse of the
    # order above. With 0 each lane's Ray workers run at that lane's own priority.
    env[RAY_WORKER_NICENESS_ENV] = "0"
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="stepstream-lanes-") as tmp:
        runs = {}
        env[LANE_PIDS_FILE_ENV] = str(Path(tmp) / "lane.pids")
        for name, (marks, niceness) in LANES.items():
            log_path = Path(tmp) / f"{name.replace(' ', '-')}.log"
            log = open(log_path, "w")
            proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-m", marks, *argv],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, preexec_fn=lambda n=niceness: os.nice(n))
            runs[name] = (proc, log, log_path)
        # NOTE: for tests that load the machine on purpose, to see whether the other
        # lanes load it already (tests/reliability_support.py busy_core)
        Path(env[LANE_PIDS_FILE_ENV]).write_text(" ".join(str(p.pid) for p, _, _ in runs.values()))
        status = 0
        totals: dict[str, int] = {}
        failed_tests: list[str] = []
        for name, (proc, log, log_path) in runs.items():
            rc = proc.wait()
            log.close()
            text = log_path.read_text(errors="replace")
            print(f"\n===== lane: {name} (exit {rc}) =====\n{text}", flush=True)
            counts = _counts(text)
            for kind, number in counts.items():
                totals[kind] = totals.get(kind, 0) + number
            lane_failed_tests = _failed_tests(text)
            failed_tests += lane_failed_tests
            # 1: failures, 5: no test ran (only a failure without -k: a -k may match
            # nothing in one lane), others: pytest itself failed
            if rc != 0 and not (rc == 5 and any(a.startswith("-k") for a in argv)):
                # NOTE: 1 = test failures, named in the summary (they may run alone);
                # 2 = anything else (no test ran, pytest broke): fails at once
                status = max(status, 1 if rc == 1 and lane_failed_tests else 2)
                print(f"lane {name!r} FAILED (pytest exit {rc})", flush=True)
        # a test run alone loads the machine itself again where it would
        Path(env[LANE_PIDS_FILE_ENV]).unlink(missing_ok=True)
        passed_alone: list[str] = []
        if status == 1 and len(failed_tests) <= MAX_RUN_ALONE:
            status, totals, passed_alone = _run_alone(failed_tests, argv, env, tmp, totals)
    minutes, seconds = divmod(int(time.monotonic() - started), 60)
    if passed_alone:
        print(f"\n{len(passed_alone)} failed beside the other lanes and passed alone:")
        for node_id in passed_alone:
            print(f"  {node_id}")
    print(f"\nsuite ({minutes}:{seconds:02d}, {len(LANES)} lanes):")
    print(f"{totals.get('passed', 0)} passed, {totals.get('failed', 0) + totals.get('error', 0)} "
          f"failed, {totals.get('skipped', 0)} skipped")
    return status


def _run_alone(node_ids: list[str], argv: list[str], env: dict, tmp: str,
               totals: dict[str, int]) -> tuple[int, dict[str, int], list[str]]:
    """Run the lanes' failed tests once more in one process, one after another:
    (exit status, the suite's counts with these tests' second results in place of
    their first, the tests that passed alone)."""
    print(f"\n===== alone: the {len(node_ids)} tests that failed beside the other lanes "
          f"=====", flush=True)
    log_path = Path(tmp) / "alone.log"
    # NOTE: paths and node ids the caller named would select more than the failed tests
    options = [a for a in argv if not os.path.exists(a.split("::")[0])]
    with open(log_path, "w") as log:
        rc = subprocess.run([sys.executable, "-m", "pytest", "-q", *options, *node_ids],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env).returncode
    text = log_path.read_text(errors="replace")
    print(text, flush=True)
    counts = _counts(text)
    still_failing = set(_failed_tests(text))
    totals = dict(totals)
    totals["passed"] = totals.get("passed", 0) + counts.get("passed", 0)
    totals["failed"], totals["error"] = counts.get("failed", 0), counts.get("error", 0)
    if rc != 0:
        print(f"alone: FAILED (pytest exit {rc})", flush=True)
        return 1, totals, []
    return 0, totals, [n for n in node_ids if n not in still_failing]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
