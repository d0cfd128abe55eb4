"""BlockAllocator / KVPool / SequenceKV: reserve, slots, commit, truncate, release."""
from __future__ import annotations

import pytest
import torch

from engine.kv_cache import BlockAllocator, KVCacheConfig, KVPool, SequenceKV
from specdec.errors import CapacityError

BLOCK_SIZE = 4


def make_pool(num_blocks: int = 8, block_size: int = BLOCK_SIZE) -> KVPool:
    return KVPool(KVCacheConfig(num_blocks=num_blocks, block_size=block_size), num_layers=2,
                  num_kv_heads=2, head_dim=3, dtype=torch.float32, device=torch.device("cpu"))


def test_pool_shapes():
    pool = make_pool(num_blocks=5)
    assert len(pool.k) == len(pool.v) == 2
    for t in pool.k + pool.v:
        assert t.shape == (6, BLOCK_SIZE, 2, 3)  # + the scratch block
    assert pool.allocator.num_free == 5
    assert pool.allocator.num_used == 0


@pytest.mark.parametrize("num_blocks, block_size", [(0, 16), (4, 0), (-1, 1)])
def test_invalid_config(num_blocks, block_size):
    with pytest.raises(ValueError):
        KVCacheConfig(num_blocks=num_blocks, block_size=block_size)


@pytest.mark.parametrize("num_new_tokens, expected_blocks", [
    (0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3), (16, 4),
])
def test_reserve_allocates_ceil_blocks(num_new_tokens, expected_blocks):
    pool = make_pool()
    seq = pool.new_sequence()
    seq.reserve(num_new_tokens)
    assert len(seq.block_table) == expected_blocks
    assert seq.capacity == expected_blocks * BLOCK_SIZE
    assert pool.allocator.num_used == expected_blocks
    assert seq.num_tokens == 0  # reserve does not commit


def test_reserve_counts_from_committed_tokens():
    pool = make_pool()
    seq = pool.new_sequence()
    seq.reserve(5)  # 2 blocks
    seq.commit(5)
    seq.reserve(3)  # 8 tokens fit in the 2 blocks already held
    assert len(seq.block_table) == 2
    seq.reserve(4)  # 9 tokens need a third block
    assert len(seq.block_table) == 3
    assert pool.allocator.num_used == 3


def test_repeated_reserve_without_commit_does_not_grow():
    pool = make_pool()
    seq = pool.new_sequence()
    seq.reserve(6)
    seq.reserve(6)
    assert len(seq.block_table) == 2
    assert pool.allocator.num_used == 2


def test_blocks_are_owned_by_one_sequence():
    pool = make_pool()
    a, b = pool.new_sequence(), pool.new_sequence()
    a.reserve(9)
    b.reserve(9)
    assert set(a.block_table).isdisjoint(b.block_table)
    assert len(set(a.block_table + b.block_table)) == 6


def test_slots_map_through_block_table():
    pool = make_pool()
    a, b = pool.new_sequence(), pool.new_sequence()
    a.reserve(4)  # block 1 (block 0 is the pool's scratch block)
    b.reserve(4)  # block 2
    a.commit(4)
    a.reserve(4)  # block 3: a's table is [1, 3], not contiguous
    assert a.block_table == [1, 3]
    assert a.slots(0, 4) == [4, 5, 6, 7]
    assert a.slots(2, 4) == [6, 7, 12, 13]  # positions 4, 5 live in block 3
    assert a.slots(7, 1) == [15]
    assert b.slots(1, 2) == [9, 10]
    assert a.slots(3, 0) == []


def test_slots_follow_a_shuffled_block_table():
    seq = SequenceKV(BlockAllocator(10), block_size=3)
    seq.block_table = [7, 2, 5]
    assert seq.slots(0, 9) == [21, 22, 23, 6, 7, 8, 15, 16, 17]


def test_slots_beyond_capacity_assert():
    pool = make_pool()
    seq = pool.new_sequence()
    seq.reserve(5)  # capacity 8
    assert len(seq.slots(0, 8)) == 8
    with pytest.raises(AssertionError):
        seq.slots(6, 3)


def test_commit_within_reservation():
    pool = make_pool()
    seq = pool.new_sequence()
    seq.reserve(6)
    seq.commit(6)
    assert seq.num_tokens == 6
    seq.commit(2)  # the rest of the second block was reserved too
    assert seq.num_tokens == 8


def test_commit_beyond_reservation_asserts():
    pool = make_pool()
    seq = pool.new_sequence()
    seq.reserve(5)  # capacity 8
    seq.commit(5)
    with pytest.raises(AssertionError, match="commit beyond reservation"):
        seq.commit(4)
    assert seq.num_tokens == 5


def test_commit_without_reserve_asserts():
    seq = make_pool().new_sequence()
    with pytest.raises(AssertionError):
        seq.commit(1)


def test_truncate_frees_only_trailing_blocks():
    pool = make_pool()
    seq = pool.new_sequence()
    seq.reserve(10)  # 3 blocks
    seq.commit(10)
    first_two, last = seq.block_table[:2], seq.block_table[2]
    seq.truncate(5)  # positions 0..4 need 2 blocks
    assert seq.num_tokens == 5
    assert seq.block_table == first_two
    assert pool.allocator.num_used == 2
    assert last in pool.allocator._free
    assert not set(first_two) & set(pool.allocator._free)
    # the kept positions map to the same slots as before
    assert seq.slots(0, 5) == [first_two[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(5)]


def test_truncate_on_block_boundary():
    pool = make_pool()
    seq = pool.new_sequence()
    seq.reserve(12)
    seq.commit(12)
    first = seq.block_table[0]
    seq.truncate(4)
    assert seq.block_table == [first]
    assert pool.allocator.num_used == 1
    seq.truncate(0)
    assert seq.block_table == []
    assert seq.num_tokens == 0
    assert pool.allocator.num_free == pool.allocator.num_blocks


def test_truncate_within_last_block_keeps_all_blocks():
    pool = make_pool()
    seq = pool.new_sequence()
    seq.reserve(7)
    seq.commit(7)
    table = list(seq.block_table)
    seq.truncate(6)
    assert seq.block_table == table
    assert seq.num_tokens == 6
    assert pool.allocator.num_used == 2


def test_truncate_then_reserve_reuses_capacity():
    pool = make_pool()
    seq = pool.new_sequence()
    seq.reserve(8)
    seq.commit(8)
    seq.truncate(6)
    seq.reserve(2)  # fits in the second block again
    assert len(seq.block_table) == 2
    seq.commit(2)
    assert seq.num_tokens == 8


@pytest.mark.parametrize("target", [6, 100, -1])
def test_truncate_out_of_range_raises(target):
    pool = make_pool()
    seq = pool.new_sequence()
    seq.reserve(8)
    seq.commit(5)
    table = list(seq.block_table)
    with pytest.raises(ValueError, match="cannot truncate"):
        seq.truncate(target)
    assert seq.num_tokens == 5
    assert seq.block_table == table
    assert pool.allocator.num_used == 2


def test_release_returns_all_blocks():
    pool = make_pool()
    seq = pool.new_sequence()
    seq.reserve(13)  # 4 blocks
    seq.commit(13)
    seq.release()
    assert seq.is_released
    assert seq.block_table == []
    assert seq.num_tokens == 0
    assert pool.allocator.num_free == pool.allocator.num_blocks


def test_release_is_idempotent():
    pool = make_pool()
    seq = pool.new_sequence()
    seq.reserve(9)
    seq.release()
    seq.release()
    assert pool.allocator.num_free == pool.allocator.num_blocks
    assert sorted(pool.allocator._free) == list(range(1, pool.allocator.num_blocks + 1))  # no block freed twice


def test_reserve_after_release_asserts():
    seq = make_pool().new_sequence()
    seq.release()
    with pytest.raises(AssertionError, match="released"):
        seq.reserve(1)


def test_released_blocks_are_reused():
    pool = make_pool(num_blocks=2)
    a = pool.new_sequence()
    a.reserve(8)
    a.release()
    b = pool.new_sequence()
    b.reserve(8)
    assert sorted(b.block_table) == [1, 2]  # block 0 is the scratch block, never handed out


def test_allocate_beyond_pool_raises_capacity_error():
    allocator = BlockAllocator(4)
    allocator.allocate(2)
    with pytest.raises(CapacityError) as info:
        allocator.allocate(3)
    message = str(info.value)
    assert "KV cache is full" in message
    assert "3 more blocks needed" in message
    assert "2 of 4 free" in message
    assert "retry" in message
    assert allocator.num_free == 2  # a failed allocation takes nothing


def test_allocate_exactly_the_pool():
    allocator = BlockAllocator(3)
    assert sorted(allocator.allocate(3)) == [0, 1, 2]
    assert allocator.num_free == 0
    assert allocator.allocate(0) == []
    with pytest.raises(CapacityError):
        allocator.allocate(1)


def test_reserve_beyond_pool_leaves_sequence_unchanged():
    pool = make_pool(num_blocks=3)
    other = pool.new_sequence()
    other.reserve(4)  # 1 block, 2 left
    seq = pool.new_sequence()
    seq.reserve(4)
    seq.commit(4)
    with pytest.raises(CapacityError):
        seq.reserve(9)  # needs 13 tokens -> 4 blocks, holds 1, only 1 free
    assert len(seq.block_table) == 1
    assert seq.num_tokens == 4
    assert pool.allocator.num_free == 1


@pytest.mark.parametrize("committed", [0, 3, 4])
@pytest.mark.parametrize("num_new_tokens", [0, 1, 4, 5, 8, 9, 12, 13, 20])
def test_can_reserve_predicts_reserve(committed, num_new_tokens):
    pool = make_pool(num_blocks=4)
    hog = pool.new_sequence()
    hog.reserve(4)  # 3 blocks left
    seq = pool.new_sequence()
    if committed:
        seq.reserve(committed)
        seq.commit(committed)
    predicted = seq.can_reserve(num_new_tokens)
    try:
        seq.reserve(num_new_tokens)
        succeeded = True
    except CapacityError:
        succeeded = False
    assert predicted == succeeded
    assert predicted == (committed + num_new_tokens <= 3 * BLOCK_SIZE)


def test_kv_tokens_for_memory_fraction():
    from engine.model_runner import kv_tokens_for_memory

    # Llama-3.1-8B in bf16: 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes = 128 KiB per token
    assert kv_tokens_for_memory(100 * 2**30, 0.5, 2 * 32 * 8 * 128 * 2) == 409600
