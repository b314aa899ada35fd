"""AdmissionLoads: what a router counts per replica, without Ray."""
from __future__ import annotations

from cluster.transport.admission_loads import AdmissionLoads


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_request_counts_from_its_choice_until_its_call_ends():
    loads = AdmissionLoads()
    loads.reserve("r1", "a")
    assert loads.of(["a", "b"]) == {"a": 1, "b": 0}
    loads.routed("r1", "a")
    assert loads.of(["a", "b"]) == {"a": 1, "b": 0}  # counted once, not twice
    loads.completed("r1", "a")
    assert loads.of(["a", "b"]) == {"a": 0, "b": 0} and loads.num_tracked == 0


def test_a_retry_counts_where_it_went_last():
    loads = AdmissionLoads()
    loads.reserve("r1", "a")
    loads.reserve("r1", "b")  # refused by a (its queue was full): chosen again
    loads.completed("r1", "a")  # the refused call's end comes after: b's choice stays
    assert loads.of(["a", "b"]) == {"a": 0, "b": 1}
    loads.routed("r1", "b")
    loads.completed("r1", "b")
    loads.completed("r1", "b")  # a second end changes nothing
    assert loads.of(["a", "b"]) == {"a": 0, "b": 0}


def test_a_choice_never_sent_lapses():
    clock = _Clock()
    loads = AdmissionLoads(reservation_s=30.0, clock=clock)
    loads.reserve("cancelled", "a")
    loads.reserve("routed", "a")
    loads.routed("routed", "a")
    clock.now = 31.0
    assert loads.of(["a"]) == {"a": 1} and loads.num_tracked == 1


def test_loads_of_unknown_or_other_replicas():
    loads = AdmissionLoads()
    loads.reserve("r1", "gone")
    assert loads.of(["a"]) == {"a": 0}
    loads.routed("channel-call", "a")  # never reserved: not an admission
    assert loads.of(["a"]) == {"a": 0} and loads.num_tracked == 1


def test_a_choice_made_again_lapses_from_its_own_time():
    clock = _Clock()
    loads = AdmissionLoads(reservation_s=30.0, clock=clock)
    for i in range(1000):
        loads.reserve(f"r{i}", "ab"[i % 2])
    clock.now = 20.0
    loads.reserve("r0", "b")  # chosen again, later: its first reservation is gone
    assert loads.of(["a", "b"]) == {"a": 499, "b": 501}
    clock.now = 31.0  # the first thousand lapse, not r0's second choice
    assert loads.of(["a", "b"]) == {"a": 0, "b": 1} and loads.num_tracked == 1
