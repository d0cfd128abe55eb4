"""Host work that waits for the GPU part-way: launch, wait, read back.

An engine step launches its forward (CUDA graph replays are asynchronous), then reads results back,
which waits for the device. Written as a generator that yields a `Ready` (a CUDA event recorded after
the launches; None where there is nothing to wait for) before each read back, one step's code stays in
one place while its caller chooses how to wait:

  run_to_end  - blocking: the read back after the yield waits (on a worker thread; or on the event loop
                when it serves one request and has nothing else to do meanwhile);
  run_polling - on an event loop serving several requests: the loop polls the event between its other
                callbacks (the messages of the other requests), so a forward's device time does not
                block them, and no thread hand-off is paid to run the batch elsewhere.

The code after a yield must itself wait for what it reads (e.g. `Ready.synchronize()`, a no-op once
the event has completed): `run_to_end` resumes it at once.

Work of several forwards may also yield an `Answered` between them: the results of jobs it has finished
(by their index), which the caller may hand out at once (`on_answered`) instead of with the rest at the
end; the work still returns every result.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Ready(Protocol):
    """What a step waits for (torch.cuda.Event has both)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class Answered:
    """Results of some of the work's jobs, final before the work ends: job index -> result."""

    results: dict[int, Any]


GpuWork = Generator["Ready | Answered | None", None, T]
OnAnswered = Callable[[dict[int, Any]], None]


def run_to_end(work: GpuWork[T] | T, on_answered: OnAnswered | None = None) -> T:
    """Runs `work` through, its read backs waiting for the device; a plain value is returned as is."""
    if not isinstance(work, Generator):
        return work
    try:
        while True:
            _hand_out(next(work), on_answered)
    except StopIteration as stop:
        return stop.value


async def run_polling(work: GpuWork[T] | T, context: Callable[[], AbstractContextManager],
                      on_answered: OnAnswered | None = None) -> T:
    """Runs `work`, each part inside `context()` (e.g. ModelRunner.on_calling_thread: other work on this
    thread may have switched the CUDA stream meanwhile), yielding to the event loop until each `Ready` it
    waits for has completed."""
    if not isinstance(work, Generator):
        return work
    try:
        while True:
            with context():
                ready = work.send(None)
            if _hand_out(ready, on_answered):
                continue
            while ready is not None and not ready.query():
                await asyncio.sleep(0)
    except StopIteration as stop:
        return stop.value


def _hand_out(step: Ready | Answered | None, on_answered: OnAnswered | None) -> bool:
    """Whether `step` was an Answered (given to `on_answered`, if any) rather than something to wait for."""
    if not isinstance(step, Answered):
        return False
    if on_answered is not None:
        on_answered(step.results)
    return True
