"""Prefix-aware routing's policy (cluster/transport/prefix_affinity.py), without Ray."""
from __future__ import annotations

from cluster.transport.prefix_affinity import PrefixHomes, choose, prefix_key
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


def test_a_new_key_goes_to_the_least_loaded_replica_and_makes_it_its_home():
    homes = PrefixHomes()
    key = prefix_key(SYSTEM, 256, 16)
    ids = ["r1", "r2", "r3"]
    assert choose(key, homes, ids, ids, {"r1": 3, "r2": 1, "r3": 2}, 8) == "r2"
    # the same prefix again: its home, however the loads moved within the threshold
    assert choose(key, homes, ids, ids, {"r1": 0, "r2": 8, "r3": 0}, 8) == "r2"
    # past the threshold: the least loaded, and the home stays
    assert choose(key, homes, ids, ids, {"r1": 0, "r2": 9, "r3": 1}, 8) == "r1"
    assert homes.get(key) == "r2"


def test_prompts_without_a_shared_prefix_are_spread_evenly():
    """Unique prompts (a key each) and prompts without a whole block (no key) fill
    the replicas in turn: no hash decides, so a burst splits evenly."""
    homes = PrefixHomes()
    loads = {"r1": 0, "r2": 0}
    for i in range(64):
        key = prefix_key([i] * 40, 256, 16) if i % 2 else None
        loads[choose(key, homes, ["r1", "r2"], ["r1", "r2"], loads, 8)] += 1
    assert loads == {"r1": 32, "r2": 32}


def test_a_home_that_is_gone_is_replaced_and_homes_are_bounded():
    homes = PrefixHomes(max_keys=2)
    key = prefix_key(SYSTEM, 256, 16)
    homes.set(key, "lost")
    assert choose(key, homes, ["r1"], ["r1"], {"r1": 5}, 8) == "r1" and homes.get(key) == "r1"
    for k in range(3):
        homes.set(bytes([k]), "r1")
    assert len(homes) == 2 and homes.get(key) is None  # the oldest key left


def test_routers_that_know_nothing_of_a_prefix_agree_where_loads_tie():
    """Two ingress replicas (a router each), requests one at a time: every prompt of
    a prefix meets on one replica, and different prefixes spread over replicas."""
    ids = ["r1", "r2", "r3"]
    idle = dict.fromkeys(ids, 0)
    homes_of = {}
    for p in range(30):
        key = prefix_key([p] * 40, 256, 16)
        picks = {choose(key, PrefixHomes(), ids, ids, idle, 8) for _ in range(2)}
        assert len(picks) == 1
        homes_of[p] = picks.pop()
    assert set(homes_of.values()) == set(ids)
    # under load the least loaded wins over the hash
    key = prefix_key([0] * 40, 256, 16)
    busy = {**idle, homes_of[0]: 1}
    assert choose(key, PrefixHomes(), ids, ids, busy, 8) != homes_of[0]


def test_balancing_is_over_the_nearest_but_a_home_may_be_anywhere():
    homes = PrefixHomes()
    key = prefix_key(SYSTEM, 256, 16)
    homes.set(key, "far")
    loads = {"far": 1, "n1": 0, "n2": 1}
    assert choose(key, homes, ["far", "n1", "n2"], ["n1", "n2"], loads, 8) == "far"
    assert choose(None, homes, ["far", "n1", "n2"], ["n1", "n2"], loads, 8) == "n1"


def test_the_router_reads_the_prompt_of_an_admission_call():
    wire = encode_request(EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=4), "ing"))
    assert prompt_of(wire) == [1, 2, 3]
    assert prompt_of("ing-1") is None and prompt_of(None) is None
    assert prompt_of(b"not a request") is None
