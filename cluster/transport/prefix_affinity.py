"""Which engine replica should run a prompt, so that prompts sharing a prefix meet
the KV blocks their prefix left in that replica's prefix cache.

The key is the prompt's first `prefix_tokens` token ids (whole KV blocks only):
prompts with the same system prompt, few-shot examples or earlier chat turns
share it. Rendezvous hashing maps a key to a replica, so adding or losing a
replica moves only the keys that replica gains or held. The preference yields to
load: when the preferred replica's queue is `imbalance_threshold` requests longer
than the shortest queue known, the request goes to Serve's usual choice instead,
so no replica is flooded by one popular prefix nor starved.

Pure functions: the router (cluster/transport/routing.py) supplies replica ids and the
queue lengths it knows.
"""
from __future__ import annotations

import hashlib


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


def _score(key: bytes, replica_id: str) -> bytes:
    return hashlib.blake2b(key + replica_id.encode(), digest_size=8).digest()


def preferred_replica(key: bytes, replica_ids: list[str]) -> str | None:
    """Rendezvous hashing: the replica with the highest score for this key."""
    if not replica_ids:
        return None
    return max(replica_ids, key=lambda rid: _score(key, rid))


def choose(key: bytes | None, replica_ids: list[str], queue_lens: dict[str, int | None],
           imbalance_threshold: int) -> str | None:
    """The replica to prefer for `key`, or None (use the default policy): no key, or
    the preferred replica's queue longer than the shortest known by more than the
    threshold.

    NOTE: a queue length the router does not know (its cache entries expire after
    a few idle seconds) does not drop the preference: Serve probes a preferred
    replica it knows nothing of and passes over it when its queue is full, so the
    first request after a pause still meets its prefix's blocks."""
    if key is None:
        return None
    preferred = preferred_replica(key, replica_ids)
    if preferred is None:
        return None
    own = queue_lens.get(preferred)
    if own is None:
        return preferred
    shortest = min(n for rid in replica_ids if (n := queue_lens.get(rid)) is not None)
    return None if own - shortest > imbalance_threshold else preferred
