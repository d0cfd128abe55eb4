"""The batching loop keeps concurrent streams in one batch per step, however staggered their returns."""
from __future__ import annotations

import asyncio
import random
import time

from engine.batching_loop import BatchingLoop, ReturningCallers

NUM_STREAMS = 8
NUM_STEPS = 8
FORWARD_S = 0.02


def _forward_recording(batch_sizes: list[int]):
    """A batch's process: takes FORWARD_S (on the worker thread, as a forward does), records its size."""

    def process(jobs: list[int]) -> list[int]:
        batch_sizes.append(len(jobs))
        time.sleep(FORWARD_S)
        return jobs

    return process


def _run_streams(return_delays_s: list[float], max_linger_s: float = 0.1) -> list[int]:
    """Each stream submits NUM_STEPS jobs, waiting its own delay after each answer (its round trip
    through the gateway); returns the size of every batch run."""
    batch_sizes: list[int] = []
    process = _forward_recording(batch_sizes)

    async def stream(loop: BatchingLoop, delay_s: float) -> None:
        for step in range(NUM_STEPS):
            assert await loop.submit(step) == step
            await asyncio.sleep(delay_s)

    async def main() -> None:
        loop: BatchingLoop[int, int] = BatchingLoop(process, max_batch_size=64, max_linger_s=max_linger_s)
        loop.start()
        await asyncio.gather(*(stream(loop, delay) for delay in return_delays_s))
        await loop.stop()

    asyncio.run(main())
    return batch_sizes


def test_staggered_returns_rejoin_one_batch():
    """Streams answered together come back up to 5 ms apart (under the 20 ms a batch takes): every
    step is one batch of all of them. Waiting only for as many jobs as the last batch held (at most
    2 ms) split them into two alternating groups for good."""
    delays = [0.005 * i / (NUM_STREAMS - 1) for i in range(NUM_STREAMS)]
    random.Random(0).shuffle(delays)
    assert _run_streams(delays) == [NUM_STREAMS] * NUM_STEPS


async def _tasks(n: int) -> list[asyncio.Task]:
    """Stand-ins for RPC streams: ReturningCallers keys callers by their asyncio task."""
    return [asyncio.create_task(asyncio.sleep(60)) for _ in range(n)]


def test_a_caller_that_comes_back_later_than_the_wait_is_not_due():
    """A stream away for three batches' time each step (a request at the draft) is not waited for by
    one that comes straight back (a target-only request): once an answer has told each caller's
    return time, only the quick one is due within a 20 ms wait. (Waiting for every answered caller
    made the quick stream wait a batch's time on every step that followed the slow one's.)"""

    async def main() -> tuple[bool, bool, bool]:
        quick, slow = await _tasks(2)
        callers = ReturningCallers()
        for caller in (quick, slow):
            callers.submitted(caller, now=0.0)
            callers.answered(caller, now=1.0)
        callers.submitted(quick, now=1.0)  # back at once
        callers.submitted(slow, now=1.06)  # back after 60 ms
        callers.answered(slow, now=2.0)
        slow_due = callers.is_any_due(1.98, 2.02)
        callers.answered(quick, now=2.0)
        quick_due = callers.is_any_due(1.98, 2.02)
        slow_due_later = callers.is_any_due(2.04, 2.08)
        for task in (quick, slow):
            task.cancel()
        return slow_due, quick_due, slow_due_later

    assert asyncio.run(main()) == (False, True, True)


def test_a_finished_caller_is_never_due():
    """A stream that ended (its task is done) delays nobody, whenever it was expected back."""

    async def main() -> tuple[bool, bool]:
        [caller] = await _tasks(1)
        callers = ReturningCallers()
        callers.submitted(caller, now=0.0)
        callers.answered(caller, now=0.0)
        due_while_open = callers.is_any_due(-0.01, 0.01)
        caller.cancel()
        await asyncio.gather(caller, return_exceptions=True)
        return due_while_open, callers.is_any_due(-0.01, 0.01)

    assert asyncio.run(main()) == (True, False)


def test_a_finished_stream_leaves_the_other_in_batches_of_its_own():
    """One stream ends after its first step; the other's next steps run alone, one batch each."""
    batch_sizes: list[int] = []
    process = _forward_recording(batch_sizes)

    async def stream(loop: BatchingLoop, num_steps: int) -> None:
        for step in range(num_steps):
            await loop.submit(step)

    async def main() -> None:
        loop: BatchingLoop[int, int] = BatchingLoop(process, max_batch_size=64, max_linger_s=1.0)
        loop.start()
        await asyncio.gather(stream(loop, 1), stream(loop, 4))
        await loop.stop()

    asyncio.run(main())
    assert batch_sizes == [2, 1, 1, 1]
