"""The suite's own Ray starts (tests/cluster_support.py init_local_ray) start again
once when Ray's node missed its fixed 30 s to register, and only then."""
from __future__ import annotations

import pytest

import cluster_support


class _Init:
    def __init__(self, *errors):
        self.errors, self.calls = list(errors), []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        if self.errors:
            raise self.errors.pop(0)


def test_a_start_that_timed_out_is_ended_and_started_again(monkeypatch):
    import psutil
    import ray

    class _Tree:  # none of this process's children is touched here
        def children(self, recursive):
            return []
    monkeypatch.setattr(psutil, "Process", _Tree)

    init = _Init(Exception("The current node timed out during startup. This could happen"))
    shutdowns = []
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: shutdowns.append(1))
    cluster_support.init_local_ray(num_cpus=1)
    assert init.calls == [{"address": "local", "num_cpus": 1}] * 2 and shutdowns == [1]


def test_any_other_failure_is_raised_at_once(monkeypatch):
    import ray

    init = _Init(RuntimeError("no such resource"))
    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(RuntimeError, match="no such resource"):
        cluster_support.init_local_ray(num_cpus=1)
    assert len(init.calls) == 1
