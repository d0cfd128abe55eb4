"""KV admission: promises never exceed the pool; waiters are admitted in order; cancelled waiters leave."""
from __future__ import annotations

import asyncio

import pytest

from engine.kv_cache import KVAdmission
from specdec.errors import CapacityError


def test_request_larger_than_the_pool_is_refused():
    admission = KVAdmission(num_blocks=4, block_size=16)
    with pytest.raises(CapacityError, match="needs up to 65 tokens of KV cache \\(5 blocks\\)"):
        asyncio.run(admission.admit(65))


def test_waiters_are_admitted_in_arrival_order_as_blocks_return():
    async def main():
        admission = KVAdmission(num_blocks=4, block_size=16)
        first = await admission.admit(48)  # 3 blocks
        order = []

        async def wait(name: str, tokens: int):
            await admission.admit(tokens)
            order.append(name)

        big = asyncio.create_task(wait("big", 64))
        small = asyncio.create_task(wait("small", 16))
        await asyncio.sleep(0)
        assert admission.num_waiting == 2 and order == []  # small would fit, but big came first
        admission.retire(first)
        await big
        assert order == ["big"] and admission.num_waiting == 1 and admission.num_free == 0
        admission.retire(4)
        await small
        return order, admission.num_free

    assert asyncio.run(main()) == (["big", "small"], 3)


def test_cancelled_waiter_leaves_the_queue_without_leaking():
    async def main():
        admission = KVAdmission(num_blocks=2, block_size=16)
        held = await admission.admit(32)
        waiter = asyncio.create_task(admission.admit(32))
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        admission.retire(held)
        return admission.num_waiting, admission.num_free

    assert asyncio.run(main()) == (0, 2)
