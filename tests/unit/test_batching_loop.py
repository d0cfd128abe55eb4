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


def _step_waits(num_steps_by_stream: list[int], return_delays_s: list[float]) -> tuple[list[int], list[list[float]]]:
    """Streams of the given lengths and return delays; the batch sizes and each stream's time from
    submitting a job to its answer, step by step."""
    batch_sizes: list[int] = []
    waits_s: list[list[float]] = [[] for _ in num_steps_by_stream]

    def process(jobs: list[int]) -> list[int]:
        batch_sizes.append(len(jobs))
        time.sleep(FORWARD_S)
        return jobs

    async def stream(loop: BatchingLoop, index: int) -> None:
        for step in range(num_steps_by_stream[index]):
            submitted = time.perf_counter()
            await loop.submit(step)
            waits_s[index].append(time.perf_counter() - submitted)
            await asyncio.sleep(return_delays_s[index])

    async def main() -> None:
        loop: BatchingLoop[int, int] = BatchingLoop(process, max_batch_size=64, max_linger_s=1.0)
        loop.start()
        await asyncio.gather(*(stream(loop, i) for i in range(len(num_steps_by_stream))))
        await loop.stop()

    asyncio.run(main())
    return batch_sizes, waits_s


def test_a_finished_stream_is_not_waited_for():
    """A stream that ended (its task is done) delays nobody: the other's steps each take one batch."""
    batch_sizes, waits_s = _step_waits([1, 4], [0.0, 0.0])
    assert batch_sizes == [2, 1, 1, 1]
    assert all(wait < 1.5 * FORWARD_S for wait in waits_s[1])


def test_a_stream_that_comes_back_late_is_not_waited_for():
    """A stream away for three batches' time each step (a request at the draft) is not waited for
    by one that comes straight back (a target-only request): after the first answer tells when it
    returns, the quick stream's steps take one batch each. Waiting for every answered caller made
    the quick stream wait a batch's time on every step that followed the slow one's."""
    _, waits_s = _step_waits([12, 4], [0.0, 3 * FORWARD_S])
    slow_steps = sum(wait > 1.5 * FORWARD_S for wait in waits_s[0])
    assert slow_steps <= 2, waits_s[0]
