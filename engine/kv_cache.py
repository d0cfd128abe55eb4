"""Paged KV cache: a preallocated block pool, its allocator, and per-sequence block tables."""
from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass

import torch

from specdec.errors import CapacityError


@dataclass(frozen=True)
class KVCacheConfig:
    num_blocks: int
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError(f"KV cache needs >= 1 block of >= 1 token, got {self}")


class BlockAllocator:
    """Hands out block ids from a fixed pool; blocks are owned by exactly one sequence."""

    def __init__(self, num_blocks: int, first_block_id: int = 0) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(first_block_id, first_block_id + num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if not self.can_allocate(num_blocks):
            raise CapacityError(
                f"KV cache is full: {num_blocks} more blocks needed, {self.num_free} of "
                f"{self.num_blocks} free; retry later or shorten the request"
            )
        return [self._free.popleft() for _ in range(num_blocks)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)


SCRATCH_BLOCK = 0  # never allocated: padding tokens of a padded (graph) batch write here


class KVPool:
    """Per-layer K and V block tensors plus the allocator that partitions them.

    Shapes: k[layer], v[layer]: [num_blocks + 1, block_size, num_kv_heads, head_dim]; block 0 is
    the scratch block, sequences get blocks 1..num_blocks.
    """

    def __init__(
        self,
        config: KVCacheConfig,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config = config
        self.block_size = config.block_size
        shape = (config.num_blocks + 1, config.block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.allocator = BlockAllocator(config.num_blocks, first_block_id=SCRATCH_BLOCK + 1)

    def new_sequence(self) -> SequenceKV:
        return SequenceKV(self.allocator, self.block_size)


class SequenceKV:
    """One sequence's view of the pool: a block table and how many positions hold K/V.

    `reserve` makes room before a forward (so a later rollback never allocates), `commit`
    records what the forward wrote, `truncate` rolls back and frees only trailing blocks.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self._allocator = allocator
        self.block_size = block_size
        self.block_table: list[int] = []
        self.num_tokens = 0
        self.is_released = False

    @property
    def capacity(self) -> int:
        return len(self.block_table) * self.block_size

    def blocks_needed(self, num_new_tokens: int) -> int:
        total = math.ceil((self.num_tokens + num_new_tokens) / self.block_size)
        return max(0, total - len(self.block_table))

    def can_reserve(self, num_new_tokens: int) -> bool:
        return self._allocator.can_allocate(self.blocks_needed(num_new_tokens))

    def reserve(self, num_new_tokens: int) -> None:
        """Ensures slots exist for `num_new_tokens` positions after `num_tokens`."""
        assert not self.is_released, "sequence already released"
        self.block_table += self._allocator.allocate(self.blocks_needed(num_new_tokens))

    def slots(self, start: int, count: int) -> list[int]:
        """Flat slot ids (block * block_size + offset) of positions [start, start + count)."""
        assert start + count <= self.capacity, "positions beyond the reserved capacity"
        bs = self.block_size
        return [self.block_table[p // bs] * bs + p % bs for p in range(start, start + count)]

    def commit(self, num_new_tokens: int) -> None:
        """Records that K/V for `num_new_tokens` more positions were written."""
        assert self.num_tokens + num_new_tokens <= self.capacity, "commit beyond reservation"
        self.num_tokens += num_new_tokens

    def truncate(self, num_tokens: int) -> None:
        """Rolls back to the first `num_tokens` positions, freeing blocks no longer needed."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot truncate {self.num_tokens} cached tokens to {num_tokens}")
        self.num_tokens = num_tokens
        keep = math.ceil(num_tokens / self.block_size)
        self._allocator.free(self.block_table[keep:])
        del self.block_table[keep:]

    def release(self) -> None:
        """Returns every block to the pool; idempotent."""
        if not self.is_released:
            self._allocator.free(self.block_table)
            self.block_table = []
            self.num_tokens = 0
            self.is_released = True


class KVAdmission:
    """Admits a sequence only while the worst case of every admitted sequence fits the pool.

    An admitted sequence can therefore never run out of blocks mid-generation, so a request that
    does not fit now waits (FIFO) for others to finish instead of failing; only a request whose
    worst case exceeds the whole pool is refused. Single-threaded: use from the event loop.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_free = num_blocks
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def blocks_for(self, max_tokens: int) -> int:
        return math.ceil(max_tokens / self.block_size)

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    async def admit(self, max_tokens: int) -> int:
        """Waits until `max_tokens` of KV can be promised; returns the blocks promised."""
        num_blocks = self.blocks_for(max_tokens)
        if num_blocks > self.num_blocks:
            raise CapacityError(
                f"the request needs up to {max_tokens} tokens of KV cache ({num_blocks} blocks) but the pool "
                f"holds {self.num_blocks} blocks; send a shorter prompt or a smaller max_new_tokens"
            )
        if not self._waiters and num_blocks <= self.num_free:
            self.num_free -= num_blocks
            return num_blocks
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((num_blocks, future))
        try:
            await future
        except BaseException:
            if future.done() and not future.cancelled():  # admitted just as we were cancelled
                self.retire(num_blocks)
            else:
                self._waiters.remove((num_blocks, future))
            raise
        return num_blocks

    def retire(self, num_blocks: int) -> None:
        """Returns a finished sequence's promise and admits waiters in arrival order."""
        self.num_free += num_blocks
        while self._waiters and self._waiters[0][0] <= self.num_free:
            blocks, future = self._waiters.popleft()
            self.num_free -= blocks
            future.set_result(None)
