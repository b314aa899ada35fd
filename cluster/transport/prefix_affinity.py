"""Which engine replica should run a prompt: where its prefix's KV blocks are, if
they are anywhere, else the least loaded one.

The key is the prompt's first `prefix_tokens` token ids (whole KV blocks only):
prompts with the same system prompt, few-shot examples or earlier chat turns
share it. A key's home is the replica its first prompt went to (the router
remembers the last `MAX_HOMES` keys): its blocks are in that replica's prefix
cache. A prompt whose key has no home (a new prefix, a prompt of its own) goes to
the least loaded replica and makes it the key's home; one whose home is more than
`imbalance_threshold` requests busier than the least loaded goes there instead, so
no replica is flooded by one popular prefix nor starved. Prompts that share
nothing are thus spread evenly: a hash of their first tokens only breaks ties.

Ties among the least loaded go by rendezvous hashing of the key: each router (one
per ingress replica) keeps its own homes, and where loads tie (an idle cluster,
requests one at a time) every router sends a new prefix to the same replica.

Pure functions and data: the router (cluster/transport/routing.py) supplies replica
ids and loads (cluster/transport/admission_loads.py).
"""
from __future__ import annotations

import hashlib
import random
from collections import OrderedDict

MAX_HOMES = 65_536


def prefix_key(prompt_token_ids: list[int], prefix_tokens: int, block_size: int) -> bytes | None:
    """The routing key of a prompt, or None when it holds no whole block to share.

    NOTE: the last prompt token is always recomputed by the engine, so only the
    blocks before it can be reused."""
    usable = min(prefix_tokens, len(prompt_token_ids) - 1) // block_size * block_size
    if usable <= 0:
        return None
    head = prompt_token_ids[:usable]
    return hashlib.blake2b(len(head).to_bytes(4, "little") + b"".join(
        t.to_bytes(4, "little", signed=False) for t in head), digest_size=16).digest()


class PrefixHomes:
    """key -> the replica its prefix was first sent to, the last `max_keys` keys."""

    def __init__(self, max_keys: int = MAX_HOMES) -> None:
        self._max_keys = max_keys
        self._homes: OrderedDict[bytes, str] = OrderedDict()

    def get(self, key: bytes) -> str | None:
        home = self._homes.get(key)
        if home is not None:
            self._homes.move_to_end(key)
        return home

    def set(self, key: bytes, replica_id: str) -> None:
        self._homes[key] = replica_id
        self._homes.move_to_end(key)
        if len(self._homes) > self._max_keys:
            self._homes.popitem(last=False)

    def __len__(self) -> int:
        return len(self._homes)


def _score(key: bytes, replica_id: str) -> bytes:
    return hashlib.blake2b(key + replica_id.encode(), digest_size=8).digest()


def least_loaded(replica_ids: list[str], loads: dict[str, int], key: bytes | None = None) -> str:
    """The replica with the fewest requests. Ties go by the key's rendezvous hash
    (the replica with the highest score for it), so routers that know nothing of a
    prefix yet (other ingress replicas, an idle cluster) agree on where it goes;
    without a key, at random."""
    fewest = min(loads.get(rid, 0) for rid in replica_ids)
    tied = [rid for rid in replica_ids if loads.get(rid, 0) == fewest]
    if key is None:
        return random.choice(tied)
    return max(tied, key=lambda rid: _score(key, rid))


def choose(key: bytes | None, homes: PrefixHomes, home_ids: list[str], near_ids: list[str],
           loads: dict[str, int], imbalance_threshold: int) -> str:
    """The replica for a prompt with `key` (None: no whole block to share).

    `home_ids`: the replicas a home may be (every one the router may use);
    `near_ids`: those to balance over otherwise (the nearest, as Serve ranks them);
    `loads`: requests per replica, for both."""
    home = homes.get(key) if key is not None else None
    if home is not None and home in home_ids:
        fewest = min(loads.get(rid, 0) for rid in home_ids)
        if loads.get(home, 0) - fewest <= imbalance_threshold:
            return home
        return least_loaded(near_ids, loads, key)
    chosen = least_loaded(near_ids, loads, key)
    if key is not None:
        homes.set(key, chosen)  # a new key, or its home is gone
    return chosen
