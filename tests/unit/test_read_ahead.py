"""read_ahead: the next step is computed while the consumer uses the last, and nothing is lost or leaked."""
from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from gateway.read_ahead import read_ahead

TIMEOUT_S = 2.0


class Source:
    """An async iterator of 0..n-1 that records what it produced and whether it was closed."""

    def __init__(self, n: int, fail_after: int | None = None) -> None:
        self.n = n
        self.fail_after = fail_after
        self.produced: list[int] = []
        self.closed = False
        self.changed = asyncio.Event()

    async def items(self):
        try:
            for i in range(self.n):
                if i == self.fail_after:
                    raise ValueError(f"source failed after {i} items")
                await asyncio.sleep(0)  # a model round trip
                self.produced.append(i)
                self.changed.set()
                yield i
        finally:
            self.closed = True
            self.changed.set()

    async def wait_until_produced(self, count: int) -> None:
        while len(self.produced) < count:
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), TIMEOUT_S)


def test_the_source_computes_the_next_item_while_the_consumer_uses_the_last() -> None:
    async def main() -> list[int]:
        source = Source(5)
        received = []
        async with aclosing(read_ahead(source.items())) as items:
            async for item in items:
                if item == 0:  # the consumer is busy with item 0 until the source has produced item 1
                    await source.wait_until_produced(2)
                received.append(item)
        return received

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]


def test_items_before_a_source_error_arrive_then_the_error() -> None:
    async def main() -> list[int]:
        source = Source(5, fail_after=3)
        received = []
        with pytest.raises(ValueError, match="after 3 items"):
            async for item in read_ahead(source.items()):
                received.append(item)
        assert source.closed
        return received

    assert asyncio.run(main()) == [0, 1, 2]


def test_stopping_early_closes_the_source_in_its_task() -> None:
    async def main() -> Source:
        source = Source(100)
        async with aclosing(read_ahead(source.items())) as items:
            async for item in items:
                if item == 2:
                    break
        return source

    source = asyncio.run(main())
    assert source.closed
    assert len(source.produced) < 100


def test_a_cancelled_consumer_cancels_the_source() -> None:
    async def main() -> Source:
        source = Source(100)
        started = asyncio.Event()

        async def consume() -> None:
            async with aclosing(read_ahead(source.items())) as items:
                async for _ in items:
                    started.set()
                    await asyncio.sleep(3600)  # a client that never reads

        consumer = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), TIMEOUT_S)
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer
        return source

    assert asyncio.run(main()).closed


@pytest.mark.parametrize("max_ahead", [1, 3])
def test_a_stalled_consumer_holds_the_source_at_most_max_ahead_plus_one_items_ahead(max_ahead: int) -> None:
    async def main() -> Source:
        source = Source(100)
        async with aclosing(read_ahead(source.items(), max_ahead)) as items:
            assert await anext(items) == 0
            for _ in range(50):  # let the source run as far as it can
                await asyncio.sleep(0)
        return source

    # item 0 is consumed; max_ahead items wait in the queue; one more was produced and waits to be queued
    assert asyncio.run(main()).produced == list(range(max_ahead + 2))
