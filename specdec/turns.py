"""Turns: at most a fixed number of holders at once, the others waiting in arrival order (asyncio.Semaphore's
waiters), with a count of those waiting. The gateway's request slots and the target's prefill turns are turns."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class Turns:
    def __init__(self, limit: int) -> None:
        self._semaphore = asyncio.Semaphore(limit)
        self.num_waiting = 0

    def are_all_taken(self) -> bool:
        return self._semaphore.locked()

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Holds a turn for the body, once one is free; waiting counts in num_waiting."""
        self.num_waiting += 1
        try:
            await self._semaphore.acquire()
        finally:
            self.num_waiting -= 1
        try:
            yield
        finally:
            self._semaphore.release()
