"""A locust plugin for `loadtests/soak.py`: per-minute TTFT, ITL and error counts.

Loaded next to the locust file (`-f loadtests/locustfile.py,loadtests/soak_recorder.py`);
it defines no users. It listens to the samples the locust file fires (the request
itself, as POST, failed or not; TTFT and ITL as their own request types), keeps
them by minute of the run, and at the end writes exact percentiles (not locust's
rounded ones) to the JSON file named by `--soak-out`.
"""
from __future__ import annotations

import json
import time
from collections import defaultdict

import numpy as np
from locust import events

_started_at = [0.0]
_samples: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
_counts: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    parser.add_argument("--soak-out", default="", help="JSON file for per-minute figures")


@events.test_start.add_listener
def _start(environment, **_kwargs) -> None:
    _started_at[0] = time.monotonic()


@events.request.add_listener
def _record(request_type, name, response_time, exception=None, **_kwargs) -> None:
    if not _started_at[0]:
        return
    minute = int((time.monotonic() - _started_at[0]) // 60)
    if request_type in ("TTFT", "ITL"):
        _samples[minute][request_type].append(float(response_time))
    elif request_type not in ("TPOT",):
        _counts[minute]["requests"] += 1
        if exception is not None:
            _counts[minute]["failures"] += 1


def _summary(values: list[float]) -> dict:
    if not values:
        return {"count": 0}
    arr = np.asarray(values)
    return {"count": int(arr.size), "p50_ms": float(np.percentile(arr, 50)),
            "p99_ms": float(np.percentile(arr, 99)), "max_ms": float(arr.max())}


def summarize() -> dict:
    minutes = sorted(set(_samples) | set(_counts))
    per_minute = [{"minute": m, "requests": _counts[m]["requests"],
                   "failures": _counts[m]["failures"],
                   "ttft": _summary(_samples[m]["TTFT"]), "itl": _summary(_samples[m]["ITL"])}
                  for m in minutes]
    every = {kind: [v for m in minutes for v in _samples[m][kind]] for kind in ("TTFT", "ITL")}
    return {"per_minute": per_minute,
            "requests": sum(_counts[m]["requests"] for m in minutes),
            "failures": sum(_counts[m]["failures"] for m in minutes),
            "ttft": _summary(every["TTFT"]), "itl": _summary(every["ITL"])}


@events.quitting.add_listener
def _write(environment, **_kwargs) -> None:
    path = environment.parsed_options.soak_out if environment.parsed_options else ""
    if path:
        with open(path, "w") as f:
            json.dump(summarize(), f, indent=1)
