"""Runs an async iterator ahead of its consumer, so the next step is in flight while the last is used.

The speculative loop's next propose used to wait until the gateway had detokenized the last step's
tokens and written them to the client: that work sat between two model round trips on every step.
Read ahead, the loop sends its next command first and the gateway does that work while the model
services compute. A request that stops on a stop string or EOS wastes the steps computed ahead: at
most `max_ahead` + 1, in practice one (the gateway's work takes less than a step).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TypeVar

T = TypeVar("T")

_END = object()  # the source is exhausted


class _Failed:
    def __init__(self, error: Exception) -> None:
        self.error = error


async def read_ahead(source: AsyncIterator[T], max_ahead: int = 1) -> AsyncIterator[T]:
    """Yields what `source` yields, in order, iterating it in a task of its own (`max_ahead` items
    wait in a queue; the task computes the next one meanwhile). An exception of `source` is raised
    after the items before it; closing this iterator (or cancelling its consumer) cancels the task
    and closes `source` there."""
    queue: asyncio.Queue = asyncio.Queue(max_ahead)

    async def produce() -> None:
        try:
            async with aclosing(source):
                async for item in source:
                    await queue.put(item)
        except Exception as e:  # noqa: BLE001 - raised by the consumer; cancellation (ours) ends the task
            await queue.put(_Failed(e))
        else:
            await queue.put(_END)

    producer = asyncio.create_task(produce())
    try:
        while (item := await queue.get()) is not _END:
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
