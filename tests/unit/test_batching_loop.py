"""The batching loop keeps concurrent streams in one batch per step, however staggered their returns."""
from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import pytest

from engine.batching_loop import BatchingLoop, ReturningCallers
from engine.gpu_work import Answered
from specdec.errors import ServiceUnavailableError

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


class _ThreadRecorder:
    """A batch's process and an `inline` context: which thread ran each batch, and inside what."""

    def __init__(self) -> None:
        self.threads: list[str] = []  # per batch: "loop" (inside the inline context) or "worker"
        self.loop_thread = threading.get_ident()
        self._inside_inline = False

    @contextmanager
    def inline(self) -> Iterator[None]:
        self._inside_inline = True
        try:
            yield
        finally:
            self._inside_inline = False

    def process(self, jobs: list[int]) -> list[int]:
        on_loop = threading.get_ident() == self.loop_thread
        assert on_loop == self._inside_inline, "a batch on the loop thread runs inside inline()"
        self.threads.append("loop" if on_loop else "worker")
        return jobs


def _run_inline_scenario(scenario) -> list[str]:
    async def main() -> list[str]:
        recorder = _ThreadRecorder()
        loop: BatchingLoop[int, int] = BatchingLoop(recorder.process, max_batch_size=64, inline=recorder.inline)
        loop.start()
        await scenario(loop)
        await loop.stop()
        return recorder.threads

    return asyncio.run(main())


def test_a_request_alone_runs_its_batches_on_the_event_loop_thread():
    async def alone(loop: BatchingLoop) -> None:
        for step in range(3):
            assert await loop.submit(step) == step

    assert _run_inline_scenario(alone) == ["loop"] * 3


def test_a_request_alone_runs_its_job_in_its_own_task_and_an_unfinished_or_failed_one_still_resolves():
    """Alone, a caller's jobs after its first run inside submit, in its own task: not handed to the
    loop's task and back (a first job goes there, so jobs submitted with it share its batch). A job
    left unfinished there (a prefill chunk) goes on in the loop's next batches; a job's error and a bug
    in process reach the caller, and the loop keeps serving."""
    calls: list[asyncio.Task | None] = []  # the task each job ran in
    chunks_left = {"prefill": 2}

    def process(jobs: list[str]) -> list[str | Exception | None]:
        (job,) = jobs
        calls.append(asyncio.current_task())
        if job == "prefill" and chunks_left["prefill"]:
            chunks_left["prefill"] -= 1
            return [None]
        if job == "bad":
            return [ValueError("bad job")]
        if job == "bug":
            raise RuntimeError("bug in process")
        return [job.upper()]

    async def main() -> None:
        loop: BatchingLoop[str, str] = BatchingLoop(process, max_batch_size=8, inline=nullcontext)
        loop.start()
        me = asyncio.current_task()
        assert await loop.submit("decode") == "DECODE"  # the first: in the loop's task
        assert await loop.submit("decode") == "DECODE"
        assert await loop.submit("prefill") == "PREFILL"  # chunk 1 here, chunks 2 and 3 in the loop's task
        assert [task is me for task in calls] == [False, True, True, False, False]
        for job, error in (("bad", "bad job"), ("bug", "bug in process")):
            try:
                await loop.submit(job)
            except (ValueError, RuntimeError) as e:
                assert str(e) == error
            else:
                raise AssertionError(f"{job} did not raise")
        assert await loop.submit("decode") == "DECODE"
        await loop.stop()

    asyncio.run(main())


class _Ready:
    """A stand-in for a CUDA event (engine/gpu_work.Ready): done once `set`; counts its queries."""

    def __init__(self) -> None:
        self.done = False
        self.num_queries = 0

    def query(self) -> bool:
        self.num_queries += 1
        return self.done

    def synchronize(self) -> None:
        assert self.done, "a blocking wait on work that never ends"


async def _stays_open(loop: BatchingLoop) -> None:
    """A second stream: answered once, then open (so another stream's batches are polled)."""
    await loop.submit(5)
    await asyncio.sleep(60)


async def _job_polled_beside_another_stream(process) -> tuple[BatchingLoop, asyncio.Task, asyncio.Future]:
    """A started loop (`inline`), a second stream open, and job 0 submitted: its batch is in flight, polled."""
    loop: BatchingLoop[int, int] = BatchingLoop(process, max_batch_size=8, inline=nullcontext)
    loop.start()
    other = asyncio.create_task(_stays_open(loop))
    await asyncio.sleep(0.01)
    submitted = asyncio.ensure_future(loop.submit(0))
    await asyncio.sleep(0.01)
    return loop, other, submitted


def test_with_several_streams_open_a_batch_runs_on_the_loop_which_serves_others_while_its_gpu_work_runs():
    """A batch that waits for its GPU work (a generator process, engine/gpu_work.py) with two streams
    open: launched and read back on the loop's thread, inside inline(); while it waits the loop runs the
    other stream's task, which submits its next job (run in the next batch, once the first has ended)."""
    recorder = _ThreadRecorder()
    events: list[str] = []
    ready = _Ready()

    def process(jobs: list[int]):
        recorder.process(jobs)  # the launch: on the loop thread, inside inline()
        events.append(f"launch {jobs}")
        if jobs == [0]:
            yield ready
        recorder.process(jobs)  # the read back, again inside inline()
        events.append(f"read {jobs}")
        return jobs

    async def main() -> None:
        loop: BatchingLoop[int, int] = BatchingLoop(process, max_batch_size=8, inline=recorder.inline)
        loop.start()
        other_open = asyncio.Event()

        async def waits() -> None:
            await other_open.wait()
            assert await loop.submit(0) == 0

        async def other() -> None:
            assert await loop.submit(5) == 5  # a stream of its own, open from here on
            other_open.set()
            while events[-1] != "launch [0]":
                await asyncio.sleep(0)
            events.append("other runs")
            submitted = asyncio.ensure_future(loop.submit(1))
            await asyncio.sleep(0.01)
            assert not submitted.done()  # waits for the batch in flight
            ready.done = True
            assert await submitted == 1

        await asyncio.gather(waits(), other())
        await loop.stop()

    asyncio.run(main())
    assert events == ["launch [5]", "read [5]", "launch [0]", "other runs", "read [0]", "launch [1]", "read [1]"]
    assert recorder.threads == ["loop"] * 6 and ready.num_queries > 1


@pytest.mark.parametrize("inline", [None, nullcontext], ids=["worker_thread", "polled_on_the_loop"])
def test_jobs_a_batch_answers_early_are_answered_while_its_other_forwards_run(inline):
    """A process of two forwards (a target iteration: the verifies, then a prefill chunk) that answers job 0
    after the first (gpu_work.Answered): its caller has the answer and submits again before the second
    forward ends; its next job runs in the next batch, and the batch's own result for job 0 is not given twice."""
    first_answered = threading.Event()
    ready = _Ready()
    events: list[str] = []

    def process(jobs: list[int]):
        if jobs != [0, 1]:
            return jobs
        events.append("forward 1")
        yield Answered({0: 0})
        events.append("forward 2")
        if inline is None:  # the worker thread: the loop's thread answers job 0 meanwhile
            assert first_answered.wait(10)
        else:
            yield ready  # polled: the loop runs the other callers' tasks while the GPU works
        events.append("batch ends")
        return jobs

    async def main() -> None:
        loop: BatchingLoop[int, int] = BatchingLoop(process, max_batch_size=8, inline=inline)
        loop.start()

        async def early() -> None:
            assert await loop.submit(0) == 0
            events.append("0 answered")
            first_answered.set()
            ready.done = True
            assert await loop.submit(2) == 2  # the next step, in the next batch
            events.append("2 answered")

        async def late() -> None:
            assert await loop.submit(1) == 1
            events.append("1 answered")

        await asyncio.gather(early(), late())  # two callers: their batches are not run inline as a lone one's
        await loop.stop()

    asyncio.run(asyncio.wait_for(main(), 20))  # answered only at the batch's end, the batch would never end
    assert events.index("0 answered") < events.index("batch ends") < events.index("1 answered")
    assert events.index("1 answered") < events.index("2 answered") and events.count("0 answered") == 1


def test_a_request_alone_waits_for_its_gpu_work_in_place():
    """One stream open: its batch's read back waits without polling (the loop has no one else to serve)."""
    ready = _Ready()
    ready.done = True

    def process(jobs: list[int]):
        yield ready
        return jobs

    async def main() -> None:
        loop: BatchingLoop[int, int] = BatchingLoop(process, max_batch_size=8, inline=nullcontext)
        loop.start()
        for step in range(3):
            assert await loop.submit(step) == step
        await loop.stop()

    asyncio.run(main())
    assert ready.num_queries == 0


def test_a_release_during_a_batch_in_flight_runs_on_the_loop_after_the_batch():
    """The model is touched by one caller at a time: work handed over while a batch waits for the GPU
    (a released sequence's KV) runs after the batch's read back, on the loop's thread; with no batch in
    flight, at once."""
    events: list[str] = []
    ready = _Ready()
    loop_thread = threading.get_ident()

    def release(name: str) -> None:
        assert threading.get_ident() == loop_thread
        events.append(name)

    def process(jobs: list[int]):
        if jobs == [0]:
            yield ready
            events.append("read")
        return jobs

    async def main() -> None:
        loop, other, submitted = await _job_polled_beside_another_stream(process)
        loop.run_serialized(lambda: release("release during"))
        events.append("released")
        ready.done = True
        await submitted
        loop.run_serialized(lambda: release("release after"))
        other.cancel()
        await loop.stop()

    asyncio.run(main())
    assert events == ["released", "read", "release during", "release after"]


def test_a_stop_while_a_batch_waits_for_its_gpu_work_ends_the_loop_and_fails_the_batch_at_once():
    """A shutdown during a polled batch whose GPU work never ends (a hung device) does not hang, and the
    batch's caller gets UNAVAILABLE's error instead of waiting forever."""
    ready = _Ready()

    def process(jobs: list[int]):
        if jobs == [0]:
            yield ready
        return jobs

    async def main() -> None:
        loop, other, submitted = await _job_polled_beside_another_stream(process)
        assert ready.num_queries > 0 and not submitted.done()
        await asyncio.wait_for(loop.stop(), 1)
        with pytest.raises(ServiceUnavailableError, match="this engine has stopped"):
            await asyncio.wait_for(submitted, 1)
        other.cancel()
        await asyncio.gather(other, return_exceptions=True)

    asyncio.run(main())


def test_a_job_submitted_after_stop_fails_at_once_not_waits_forever():
    async def main() -> None:
        loop: BatchingLoop[int, int] = BatchingLoop(lambda jobs: jobs, max_batch_size=4)
        loop.start()
        assert await loop.submit(1) == 1
        await loop.stop()
        with pytest.raises(ServiceUnavailableError, match="retry"):
            await asyncio.wait_for(loop.submit(2), 1)

    asyncio.run(main())


def test_work_handed_over_after_stop_is_dropped_not_raised():
    """A shutdown stops the loop, then cancels the open streams, whose cleanup frees their state:
    that must not raise from a finished worker ("cannot schedule new futures after shutdown")."""
    ran = []

    async def main() -> None:
        loop: BatchingLoop[int, int] = BatchingLoop(lambda jobs: jobs, max_batch_size=4)
        loop.start()
        await loop.stop()
        loop.run_serialized(lambda: ran.append(True))

    asyncio.run(main())
    assert ran == []
