"""Block-table invariants under any sequence of reserve / commit / truncate / release (hypothesis)."""
from __future__ import annotations

import math

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv_cache import BlockAllocator, SequenceKV
from specdec.errors import CapacityError

NUM_BLOCKS, BLOCK_SIZE = 12, 4


class BlockTables(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.allocator = BlockAllocator(NUM_BLOCKS)
        self.seqs: list[SequenceKV] = []

    @rule()
    def new_sequence(self) -> None:
        self.seqs.append(SequenceKV(self.allocator, BLOCK_SIZE))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), num_new=st.integers(0, 20))
    def reserve(self, data, num_new: int) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        used_before = self.allocator.num_used
        if seq.can_reserve(num_new):
            seq.reserve(num_new)
            assert seq.capacity >= seq.num_tokens + num_new
        else:
            try:
                seq.reserve(num_new)
                raise AssertionError("reserve beyond the pool did not raise")
            except CapacityError:
                assert self.allocator.num_used == used_before  # nothing half-allocated

    @precondition(lambda self: any(s.capacity > s.num_tokens for s in self.seqs))
    @rule(data=st.data())
    def commit(self, data) -> None:
        seq = data.draw(st.sampled_from([s for s in self.seqs if s.capacity > s.num_tokens]))
        seq.commit(data.draw(st.integers(1, seq.capacity - seq.num_tokens)))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def truncate(self, data) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        keep_table = list(seq.block_table)
        num_tokens = data.draw(st.integers(0, seq.num_tokens))
        seq.truncate(num_tokens)
        assert seq.block_table == keep_table[: math.ceil(num_tokens / BLOCK_SIZE)]  # only the tail goes

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def release(self, data) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        seq.release()
        self.seqs.remove(seq)

    @invariant()
    def blocks_are_owned_once_and_accounted(self) -> None:
        owned = [b for s in self.seqs for b in s.block_table]
        assert len(owned) == len(set(owned)) == self.allocator.num_used
        assert self.allocator.num_used + self.allocator.num_free == NUM_BLOCKS
        assert all(s.num_tokens <= s.capacity for s in self.seqs)

    def teardown(self) -> None:
        for seq in self.seqs:
            seq.release()
        assert self.allocator.num_free == NUM_BLOCKS  # no leak, whatever happened


TestBlockTables = BlockTables.TestCase
TestBlockTables.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
