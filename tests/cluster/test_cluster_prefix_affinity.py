"""Prefix-aware routing's policy (cluster/transport/prefix_affinity.py), without Ray."""
from __future__ import annotations

from cluster.transport.prefix_affinity import choose, preferred_replica, prefix_key
from cluster.transport.wire import EngineRequest, encode_request, prompt_of
from replicas.config import SamplingParams

SYSTEM = list(range(100, 400))  # a 300-token shared prefix


def test_prompts_sharing_whole_blocks_share_a_key():
    a = prefix_key(SYSTEM + [1, 2, 3], prefix_tokens=256, block_size=16)
    b = prefix_key(SYSTEM + [9, 9], prefix_tokens=256, block_size=16)
    assert a is not None and a == b
    assert prefix_key([7] + SYSTEM, 256, 16) != a  # a different first block
    # Fewer tokens than one block (the last token never counts): no key.
    assert prefix_key(list(range(16)), 256, 16) is None
    assert prefix_key(list(range(17)), 256, 16) is not None
    # Only whole blocks count: 40 tokens -> the first 32 (2 blocks).
    assert prefix_key(SYSTEM[:40], 256, 16) == prefix_key(SYSTEM[:33] + [0, 0], 256, 16)


def test_rendezvous_moves_only_the_keys_of_a_lost_replica():
    keys = [prefix_key([k] * 40, 256, 16) for k in range(200)]
    three = ["r1", "r2", "r3"]
    before = {k: preferred_replica(k, three) for k in keys}
    after = {k: preferred_replica(k, ["r1", "r3"]) for k in keys}
    assert {before[k] for k in keys} == set(three)  # every replica gets keys
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "r2" for k in moved)


def test_the_preference_yields_to_load_but_not_to_unknown_queues():
    key = prefix_key(SYSTEM, 256, 16)
    ids = ["r1", "r2"]
    preferred = preferred_replica(key, ids)
    other = next(r for r in ids if r != preferred)
    assert choose(key, ids, {preferred: 10, other: 2}, imbalance_threshold=8) == preferred
    assert choose(key, ids, {preferred: 11, other: 2}, imbalance_threshold=8) is None
    # NOTE: a length the router does not know keeps the preference (Serve probes it)
    assert choose(key, ids, {preferred: 0, other: None}, imbalance_threshold=8) == preferred
    assert choose(key, ids, {preferred: None, other: 2}, imbalance_threshold=8) == preferred
    assert choose(key, ids, {preferred: None, other: None}, imbalance_threshold=8) == preferred
    assert choose(key, ids, {preferred: 11, other: None}, imbalance_threshold=8) == preferred
    assert choose(None, ids, {preferred: 0, other: 0}, imbalance_threshold=8) is None


def test_the_router_reads_the_prompt_of_an_admission_call():
    wire = encode_request(EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=4), "ing"))
    assert prompt_of(wire) == [1, 2, 3]
    assert prompt_of("ing-1") is None and prompt_of(None) is None
    assert prompt_of(b"not a request") is None
