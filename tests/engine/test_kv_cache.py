"""CPU tests of the paged KV-cache bookkeeping: free queue, pool, manager."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dpserve.block_hash import hash_block
from dpserve.engine.kv_cache import (
    BlockPool,
    FreeBlockQueue,
    KVCacheBlock,
    KVCacheManager,
)
from dpserve.engine.request import Request
from dpserve.sampling_params import SamplingParams

BS = 4  # block size used throughout


def make_request(req_id: str, prompt: list[int], num_computed: int = 0) -> Request:
    request = Request(req_id, prompt, SamplingParams(max_tokens=8))
    request.num_computed_tokens = num_computed
    return request


def prefill(kv: KVCacheManager, request: Request) -> list[int]:
    """Admit `request` the way the scheduler does: prefix lookup, then allocate the rest."""
    blocks, num_hit = kv.get_computed_blocks(request)
    block_ids = kv.allocate_slots(request, request.num_tokens - num_hit, blocks)
    assert block_ids is not None
    request.num_computed_tokens = request.num_tokens
    return block_ids


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


# ---- free queue --------------------------------------------------------------

def test_free_queue_order_and_remove_from_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert len(queue) == 5 and [b.block_id for b in queue] == [0, 1, 2, 3, 4]
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    queue.appendleft(blocks[0])
    assert [b.block_id for b in queue] == [0, 1, 3, 4, 2] and len(queue) == 5
    with pytest.raises(AssertionError):
        queue.append(blocks[1])  # already in the queue
    for _ in range(5):
        queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()
    with pytest.raises(AssertionError):
        queue.remove(blocks[3])  # not in the queue


# ---- hashing -------------------------------------------------------------------

def test_block_hash_covers_parent():
    first = hash_block(None, [1, 2, 3, 4])
    assert hash_block(first, [5, 6, 7, 8]) != hash_block(hash_block(None, [9, 9, 9, 9]),
                                                         [5, 6, 7, 8])
    assert hash_block(None, [5, 6, 7, 8]) != hash_block(first, [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4]) == first


def test_block_hash_is_sha256_of_parent_and_every_token():
    """Changing the parent or any one token changes the digest; so does moving a
    token across the block boundary (the parent digest has a fixed length)."""
    root = hash_block(None, [1, 2, 3, 4])
    assert isinstance(root, bytes) and len(root) == 32
    assert hash_block(None, [1, 2, 3, 4]) == root
    for i in range(BS):
        changed = [1, 2, 3, 4]
        changed[i] += 1
        assert hash_block(None, changed) != root
        changed[i] = [1, 2, 3, 4][i] + (1 << 32)  # beyond int32: not truncated
        assert hash_block(None, changed) != root
    parent_a, parent_b = hash_block(None, [7, 7, 7, 7]), hash_block(None, [7, 7, 7, 8])
    assert hash_block(parent_a, [1, 2, 3, 4]) != hash_block(parent_b, [1, 2, 3, 4])
    assert hash_block(parent_a, [1, 2, 3, 4]) != root
    flipped = bytes([parent_a[0] ^ 1]) + parent_a[1:]  # one bit of the parent
    assert hash_block(flipped, [1, 2, 3, 4]) != hash_block(parent_a, [1, 2, 3, 4])


def test_block_hash_resists_the_collisions_builtin_hash_has():
    """Token sequences whose builtin-hash chains collide by construction (ints
    equal modulo 2**61 - 1, and hash(-1) == hash(-2)), with a forged parent
    too: their sha256 digests differ. The builtin side is asserted first, so
    the pairs are real collisions of the old scheme."""
    modulus = (1 << 61) - 1  # CPython hashes an int modulo this Mersenne prime
    pairs = [
        ((0x5D1F_0B1A, 1, 2, 3, 4), (0x5D1F_0B1A, 1, 2, 3, 4 + modulus)),
        ((0x5D1F_0B1A, 1, 2, 3, -1), (0x5D1F_0B1A, 1, 2, 3, -2)),
        ((12345, 5, 6, 7, 8), (12345 + modulus, 5, 6, 7, 8)),  # same "parent"
    ]
    for old_a, old_b in pairs:
        assert old_a != old_b and hash(old_a) == hash(old_b)
    assert hash_block(None, [1, 2, 3, 4]) != hash_block(None, [1, 2, 3, 4 + modulus])
    parent = hash_block(None, [9, 9, 9, 9])
    assert hash_block(parent, [5, 6, 7, 8]) != hash_block(parent, [5, 6, 7, 8 + modulus])




@pytest.mark.procs
def test_block_hash_is_the_same_in_another_process():
    """Not randomized per process: other hash seeds give the same digests."""
    code = ("from dpserve.block_hash import hash_block as h;"
            "print(h(h(None, [1, 2, 3, 4]), [5, 6, 7, 8]).hex())")
    expected = hash_block(hash_block(None, [1, 2, 3, 4]), [5, 6, 7, 8]).hex()
    for seed in ("123", "random"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, env={"PYTHONHASHSEED": seed},
                             cwd=Path(__file__).resolve().parents[2])  # the repository
        assert out.stdout.strip() == expected


def test_block_hashes_follow_new_tokens():
    kv = KVCacheManager(8, BS)
    request = make_request("a", [1, 2, 3, 4, 5, 6, 7])
    kv.update_block_hashes(request)
    assert request.block_hashes == [hash_block(None, [1, 2, 3, 4])]
    request.append_output_token(8)
    kv.update_block_hashes(request)
    assert request.block_hashes[1] == hash_block(request.block_hashes[0], [5, 6, 7, 8])


# ---- allocation ----------------------------------------------------------------

def test_allocate_grows_table_and_refuses_without_change():
    kv = KVCacheManager(4, BS)
    request = make_request("a", list(range(10)))
    assert kv.allocate_slots(request, 6) == [0, 1]  # 6 tokens -> 2 blocks
    request.num_computed_tokens = 6
    assert kv.allocate_slots(request, 4) == [0, 1, 2]
    request.num_computed_tokens = 10
    assert kv.num_free_blocks == 1 and kv.usage == pytest.approx(0.75)

    other = make_request("b", list(range(100, 109)))
    assert kv.allocate_slots(other, 9) is None  # needs 3 blocks, 1 free
    assert kv.num_free_blocks == 1 and kv.get_block_ids("b") == []
    assert kv.get_block_ids("a") == [0, 1, 2]

    kv.free(request)
    kv.free(request)  # a second free is a no-op, not a double free
    assert kv.num_free_blocks == 4 and kv.usage == 0.0
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_double_free_in_the_pool_is_caught():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError):
        pool.free_blocks([block])


# ---- prefix cache --------------------------------------------------------------

def test_prefix_hit_is_block_aligned_and_shared():
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(10)))  # blocks [0-3] [4-7] [8, 9]
    ids_a = prefill(kv, a)
    b = make_request("b", list(range(9)) + [99])  # same first two blocks
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8 and [blk.block_id for blk in blocks] == ids_a[:2]
    ids_b = kv.allocate_slots(b, 2, blocks)
    assert ids_b[:2] == ids_a[:2] and ids_b[2] not in ids_a
    assert [kv.pool.blocks[i].ref_cnt for i in ids_a] == [2, 2, 1]
    assert kv.prefix_cache_queries == 20 and kv.prefix_cache_hits == 8

    kv.free(a)
    assert kv.pool.blocks[ids_a[0]].ref_cnt == 1  # still held by b
    kv.free(b)
    assert kv.num_free_blocks == 8


def test_last_token_is_recomputed_when_whole_prompt_is_cached():
    kv = KVCacheManager(8, BS)
    prefill(kv, make_request("a", list(range(8))))
    blocks, num_hit = kv.get_computed_blocks(make_request("b", list(range(8))))
    assert num_hit == 4 and len(blocks) == 1  # the last block is dropped
    blocks, num_hit = kv.get_computed_blocks(make_request("c", list(range(9))))
    assert num_hit == 8 and len(blocks) == 2


def test_cached_blocks_survive_free_and_are_hit_again():
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(9)))
    ids = prefill(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4
    b = make_request("b", list(range(9)))
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8 and [blk.block_id for blk in blocks] == ids[:2]
    assert kv.allocate_slots(b, 1, blocks)[:2] == ids[:2]
    assert kv.num_free_blocks == 1


def test_free_hit_blocks_do_not_count_as_free_space():
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(8)))
    prefill(kv, a)
    kv.free(a)  # 4 free blocks, 2 of them cached
    b = make_request("b", list(range(8)) + list(range(50, 59)))  # 17 tokens: 2 hit + 3 new
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    assert kv.allocate_slots(b, 9, blocks) is None
    assert kv.num_free_blocks == 4 and all(blk.ref_cnt == 0 for blk in blocks)
    assert kv.get_computed_blocks(b)[1] == 8  # nothing was evicted


def test_lru_eviction_takes_the_oldest_tail_first():
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(8)) + [0])
    b = make_request("b", list(range(100, 108)) + [0])
    prefill(kv, a)
    kv.free(a)  # a's blocks: [a0 a1 x] freed as x, a1, a0
    prefill(kv, b)  # takes x and the free block, then a1 (LRU head)
    kv.free(b)
    # a's tail block was evicted before its head; b is fully cached.
    assert kv.get_computed_blocks(make_request("a2", list(range(8)) + [0]))[1] == 4
    assert kv.get_computed_blocks(make_request("b2", list(range(100, 108)) + [0]))[1] == 8
    # Free order: uncached blocks at the head, then oldest cached tail first.
    hashed = [blk.block_hash is not None for blk in kv.pool.free_queue]
    assert hashed == [False, True, True, True]


def test_same_prefix_computed_twice_keeps_one_cached_copy():
    kv = KVCacheManager(8, BS)
    a, b = make_request("a", list(range(5))), make_request("b", list(range(5)))
    ids_a = kv.allocate_slots(a, 5)
    ids_b = kv.allocate_slots(b, 5)  # no lookup: as if both were admitted before either ran
    assert kv.get_computed_blocks(b)[1] == 4  # cached now
    assert ids_a[0] != ids_b[0]
    assert kv.pool.blocks[ids_a[0]].block_hash is not None
    assert kv.pool.blocks[ids_b[0]].block_hash is None
    kv.free(a)
    kv.free(b)
    assert len(kv.pool.cached) == 1 and kv.num_free_blocks == 8


def test_reset_prefix_cache_is_refused_while_blocks_are_held():
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(9)))
    prefill(kv, a)
    assert kv.reset_prefix_cache() is False
    assert len(kv.pool.cached) == 2
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.pool.cached == {} and all(b.block_hash is None for b in kv.pool.blocks)
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)


def test_prefix_caching_off():
    kv = KVCacheManager(4, BS, enable_prefix_caching=False)
    a = make_request("a", list(range(9)))
    prefill(kv, a)
    kv.free(a)
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert a.block_hashes == [] and kv.pool.cached == {}
    assert kv.prefix_cache_queries == 0
