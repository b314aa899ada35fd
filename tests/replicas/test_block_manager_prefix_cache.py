"""Block manager prefix cache, without a model: hits, reference counts, LRU
eviction only when plain free blocks run out, no stale hit after eviction."""
import pytest

from replicas.kv_cache.block_hash import (hash_block, kv_namespace, prompt_block_hashes,
                                          root_block_hash)
from replicas.kv_cache.block_manager import BlockManager

BS = 4
ROOT = root_block_hash(kv_namespace("tiny", "float32"))


def _run_request(bm, tokens):
    """Allocate a table for `tokens`, as if computed, and enter its full blocks."""
    hashes = prompt_block_hashes(tokens, BS, ROOT)
    table = []
    cached = bm.find_cached_blocks(hashes, (len(tokens) - 1) // BS)
    assert bm.can_allocate(len(tokens), cached)
    bm.take_cached_blocks(table, cached)
    bm.allocate(table, len(tokens))
    bm.cache_blocks(table, hashes, len(cached), len(tokens) // BS)
    bm.check_consistent()
    return table, hashes, len(cached)


def test_hashes_chain_and_are_stable():
    a = prompt_block_hashes(list(range(12)), BS, ROOT)
    assert len(a) == 3 and len(set(a)) == 3
    assert a[1] == hash_block(a[0], [4, 5, 6, 7])
    # same block tokens after a different prefix: a different hash
    b = prompt_block_hashes([99, 1, 2, 3] + list(range(4, 12)), BS, ROOT)
    assert b[1:] != a[1:]
    # another model or dtype: another chain
    assert prompt_block_hashes(list(range(4)), BS, root_block_hash(kv_namespace("tiny", "bfloat16"))) != a[:1]
    assert prompt_block_hashes(list(range(12)), BS, ROOT, max_blocks=2) == a[:2]
    # pinned: routers on other machines compute the same bytes
    assert a[0].hex().startswith("21f954bbedfc57ce")


def test_shared_prefix_is_reference_counted_and_kept_after_free():
    bm = BlockManager(16, BS, enable_caching=True)
    t1, _, hit1 = _run_request(bm, list(range(10)))  # 2 full blocks + 1 partial
    assert hit1 == 0 and bm.num_cached_blocks == 2
    t2, _, hit2 = _run_request(bm, list(range(8)) + [50, 51, 52])
    assert hit2 == 2 and t2[:2] == t1[:2] and t2[2] != t1[2]
    assert [bm.ref_count(b) for b in t1[:2]] == [2, 2]
    bm.free(t1)
    assert bm.num_free_blocks == 16 - 3  # t2's 3 blocks in use
    bm.free(t2)
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks == 2 and bm.num_evictable_blocks == 2
    assert bm.usage == 0.0
    bm.check_consistent()
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.free([0])


def test_a_prompt_always_computes_its_last_token():
    bm = BlockManager(16, BS, enable_caching=True)
    tokens = list(range(8))  # exactly two blocks
    t1, _, _ = _run_request(bm, tokens)
    t2, _, hit = _run_request(bm, tokens)
    assert hit == 1  # the last block is recomputed into a private copy
    assert t2[0] == t1[0] and t2[1] != t1[1]
    assert bm.num_cached_blocks == 2  # the copy stays private
    bm.free(t1)
    bm.free(t2)
    bm.check_consistent()


def test_eviction_is_lru_and_only_when_plain_free_blocks_run_out():
    bm = BlockManager(6, BS, enable_caching=True)
    old, old_hashes, _ = _run_request(bm, list(range(8)))  # 2 cached blocks
    new, new_hashes, _ = _run_request(bm, list(range(100, 108)))
    bm.free(old)
    bm.free(new)
    assert bm.num_evictable_blocks == 4
    table = []
    bm.allocate(table, 2 * BS)  # the 2 plain free blocks go first
    assert bm.num_evicted_blocks == 0 and bm.num_cached_blocks == 4
    bm.allocate(table, 3 * BS)  # then the least recently used: old's tail
    assert bm.num_evicted_blocks == 1
    assert len(bm.find_cached_blocks(old_hashes, 2)) == 1
    assert len(bm.find_cached_blocks(new_hashes, 2)) == 2
    bm.allocate(table, 4 * BS)  # old's head
    assert bm.find_cached_blocks(old_hashes, 2) == []  # no stale hit after eviction
    bm.check_consistent()
    bm.free(table)
    bm.check_consistent()


def test_taking_a_hit_refreshes_it_and_protects_it_from_eviction():
    bm = BlockManager(4, BS, enable_caching=True)
    a, a_hashes, _ = _run_request(bm, list(range(5)))  # 1 cached + 1 partial
    b, b_hashes, _ = _run_request(bm, list(range(200, 205)))
    a_first = a[0]
    bm.free(a)
    bm.free(b)
    # a's block is the older; taking it again makes b's the one to go
    c, _, hit = _run_request(bm, list(range(4)) + [7, 8])
    assert hit == 1 and c[0] == a_first
    other = []
    bm.allocate(other, 2 * BS)  # 1 plain free block, then evicts b's (not c's)
    assert bm.find_cached_blocks(b_hashes, 1) == []
    assert bm.find_cached_blocks(a_hashes, 1) == [c[0]]
    assert not bm.can_append(other, 3 * BS)  # c's held block is never taken
    bm.free(other)
    bm.free(c)
    bm.check_consistent()
    assert bm.num_free_blocks == 4


def test_can_allocate_counts_evictable_hits_as_used():
    bm = BlockManager(3, BS, enable_caching=True)
    t, hashes, _ = _run_request(bm, list(range(8)))
    bm.free(t)
    cached = bm.find_cached_blocks(hashes, 2)
    assert len(cached) == 2
    assert bm.can_allocate(3 * BS, cached)  # 2 hits + 1 free block
    assert not bm.can_allocate(4 * BS, cached)


def test_without_caching_nothing_is_kept():
    bm = BlockManager(8, BS)
    table = []
    bm.allocate(table, 8)
    bm.free(table)
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 8
    bm.check_consistent()
