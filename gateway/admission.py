"""The gateway's request admission: a bounded number of requests generate at once, a bounded
number wait for a slot in arrival order, and the rest are refused with RESOURCE_EXHAUSTED."""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from specdec.errors import CapacityError
from specdec.turns import Turns


class RequestAdmission:
    def __init__(self, max_running: int, max_waiting: int) -> None:
        self._slots = Turns(max_running)
        self._max_running = max_running
        self._max_waiting = max_waiting

    def can_admit(self) -> bool:
        return not self._slots.are_all_taken() or self._slots.num_waiting < self._max_waiting

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Holds one of the running slots for the body; raises CapacityError when the queue is full."""
        if not self.can_admit():
            raise CapacityError(
                f"the gateway is at capacity ({self._max_running} requests generating, {self._slots.num_waiting} "
                "waiting); retry with backoff, or add gateway replicas")
        async with self._slots.turn():
            yield
