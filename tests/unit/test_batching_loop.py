"""The batching loop keeps concurrent streams in one batch per step, however staggered their returns."""
from __future__ import annotations

import asyncio
import random
import time

from engine.batching_loop import BatchingLoop

NUM_STREAMS = 8
NUM_STEPS = 8
FORWARD_S = 0.02


def _run_streams(return_delays_s: list[float], max_linger_s: float = 0.1) -> list[int]:
    """Each stream submits NUM_STEPS jobs, waiting its own delay after each answer (its round trip
    through the gateway); returns the size of every batch run."""
    batch_sizes: list[int] = []

    def process(jobs: list[int]) -> list[int]:
        batch_sizes.append(len(jobs))
        time.sleep(FORWARD_S)
        return jobs

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


def test_a_stream_that_does_not_come_back_is_waited_for_once():
    """A finished stream (here: one that stops after its first step) delays the next batch by at
    most one batch's time, and later batches start without waiting for it."""
    batch_sizes: list[int] = []
    waits_s: list[float] = []

    def process(jobs: list[int]) -> list[int]:
        batch_sizes.append(len(jobs))
        time.sleep(FORWARD_S)
        return jobs

    async def stream(loop: BatchingLoop, num_steps: int) -> None:
        for step in range(num_steps):
            answered = time.perf_counter()
            await loop.submit(step)
            waits_s.append(time.perf_counter() - answered)

    async def main() -> None:
        loop: BatchingLoop[int, int] = BatchingLoop(process, max_batch_size=64, max_linger_s=1.0)
        loop.start()
        await asyncio.gather(stream(loop, 1), stream(loop, 4))
        await loop.stop()

    asyncio.run(main())
    assert batch_sizes == [2, 1, 1, 1]
    # the step after the short stream left waited for it (one batch's time), the rest did not
    assert all(wait < 3 * FORWARD_S for wait in waits_s)
    assert sum(wait > 1.5 * FORWARD_S for wait in waits_s) <= 1
