"""The ingress's bound on requests without a first token, without Ray: the gate
counts in and out and refuses past its bound with a 429 in the OpenAI shape, and
`AppArgs` derives the bound from what the engine replicas admit at once."""
from __future__ import annotations

import json

import pytest

from cluster.app import AppArgs
from cluster.errors import ApiError
from cluster.api.pending_gate import PendingGate


def test_the_gate_refuses_past_its_bound_until_one_leaves():
    gate = PendingGate(2)
    gate.enter()
    gate.enter()
    with pytest.raises(ApiError) as info:
        gate.enter()
    error = info.value
    assert error.status == 429 and error.headers() == {"Retry-After": "1"}
    body = json.loads(error.response().body)
    assert body["error"]["type"] == "rate_limit_error"
    assert "ingress_max_pending_requests" in body["error"]["message"]
    assert (gate.num_pending, gate.num_refused) == (2, 1)
    gate.leave()
    gate.enter()  # a slot freed: let in again
    assert gate.num_pending == 2


def test_an_unbounded_gate_never_refuses():
    gate = PendingGate(None)
    for _ in range(10_000):
        gate.enter()
    assert gate.num_pending == 10_000 and gate.num_refused == 0


@pytest.mark.parametrize("args, expected", [
    # what one engine admits at once: max_num_seqs + as many waiting (unbounded queue)
    ({"max_num_seqs": 8}, 16),
    ({"max_num_seqs": 8, "max_waiting_requests": 100}, 108),
    ({"max_num_seqs": 8, "num_engine_replicas": 3}, 48),
    ({"max_num_seqs": 8, "num_engine_replicas": 3, "num_ingress_replicas": 5}, 10),  # ceil(48/5)
    ({"max_num_seqs": 8, "autoscaling": {"min_replicas": 1, "max_replicas": 4}}, 64),
    ({"max_num_seqs": 8, "ingress_max_pending_requests": 5}, 5),
    ({"max_num_seqs": 8, "ingress_max_pending_requests": -1}, None),
])
def test_the_default_bound_is_what_the_engines_admit_over_the_ingresses(args, expected):
    assert AppArgs.model_validate({"model": "tiny", **args}).ingress_max_pending == expected


@pytest.mark.parametrize("args, expected", [
    ({"max_num_seqs": 8}, 16),
    ({"max_num_seqs": 8, "num_engine_replicas": 3, "num_ingress_replicas": 5}, 48),
    ({"max_num_seqs": 8, "autoscaling": {"min_replicas": 1, "max_replicas": 4}}, 64),
    ({"max_num_seqs": 8, "ingress_max_pending_requests": -1}, 16),  # the gate's, not this
])
def test_a_request_may_bring_as_many_choices_as_all_engines_admit_at_once(args, expected):
    # beyond it the ingress answers 400 (cluster/api/ingress.py, _check_engine_requests)
    assert AppArgs.model_validate({"model": "tiny", **args}).max_engine_requests_at_once == expected


def test_a_bound_of_zero_is_refused_with_the_values_allowed():
    with pytest.raises(ValueError, match="ingress_max_pending_requests must be >= 1"):
        AppArgs.model_validate({"model": "tiny", "ingress_max_pending_requests": 0})
