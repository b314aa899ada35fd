"""Content hashes of full KV blocks, chained from the start of a sequence.

The hash of block i covers the hash of block i-1 and block i's token ids, so
equal hashes mean equal token prefixes (at equal positions), and hence equal
K/V. The chain starts from a root hash of a namespace that names everything
else the K/V depends on (the model and its dtype), so caches of different
models never mix.

Pure Python (hashlib, struct): stable across processes and machines, so a
router can compute the same hashes from a prompt's token ids as the engine.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Callable, Sequence

BlockHash = bytes  # a 32-byte SHA-256 digest

_VERSION = b"stepstream-kv-block-v1\0"


def root_block_hash(namespace: str) -> BlockHash:
    """The parent hash of every sequence's first block."""
    return hashlib.sha256(_VERSION + namespace.encode()).digest()


def kv_namespace(model: str, dtype: str) -> str:
    """What, besides the tokens, decides a block's K/V inside one deployment."""
    return f"model={model};dtype={dtype}"


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    # NOTE: little-endian uint32 ids: the same bytes on every machine.
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}I", *token_ids)).digest()


def extend_block_hashes(block_hashes: list[BlockHash], root: BlockHash, block_size: int,
                        num_tokens: int, token_ids_slice: Callable[[int, int], Sequence[int]]) -> None:
    """Append the hashes of the full blocks among the first `num_tokens` tokens
    that `block_hashes` does not hold yet; each block is hashed once."""
    for i in range(len(block_hashes), num_tokens // block_size):
        parent = block_hashes[-1] if block_hashes else root
        block_hashes.append(hash_block(parent, token_ids_slice(i * block_size, (i + 1) * block_size)))


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, root: BlockHash,
                        max_blocks: int | None = None) -> list[BlockHash]:
    """The chained hashes of a prompt's full blocks (the first `max_blocks` at most)."""
    num_tokens = len(token_ids)
    if max_blocks is not None:
        num_tokens = min(num_tokens, max_blocks * block_size)
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, root, block_size, num_tokens, lambda a, b: token_ids[a:b])
    return hashes
