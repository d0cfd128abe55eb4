"""Collects jobs from concurrent requests and runs them in batches, one batch at a time.

Jobs that arrive while a batch is running form the next batch, so requests join and leave
between iterations (continuous batching at the granularity of one engine step).
"""
from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from engine.gpu_work import GpuWork, OnAnswered, run_polling, run_to_end
from specdec.errors import ServiceUnavailableError

J = TypeVar("J")
R = TypeVar("R")

# process(jobs) returns one result per job: an Exception fails only that job, None means the
# job is unfinished (e.g. a prefill chunk) and runs again in the next iteration. It may be a generator
# (engine/gpu_work.py) that yields what its read backs wait for and returns the results, and may yield
# the results of jobs it has finished before its other forwards (gpu_work.Answered): those are answered at once.
ProcessFn = Callable[[list[J]], "list[R | Exception | None] | GpuWork[list[R | Exception | None]]"]
MIXED_PHASE = "mixed"  # a batch whose jobs are of different phases (e.g. verifies and a prefill chunk)


class ForwardObserver(Protocol):
    """Told about every batch run (e.g. specdec.metrics.ForwardMetrics)."""

    def observe_forward(self, phase: str, batch_size: int, duration_s: float) -> None: ...


def torch_thread() -> ThreadPoolExecutor:
    """The one thread a process should do all its torch work on, model loading included.

    PyTorch's CPU thread pool (OpenMP) is per calling thread: loading on the main thread and
    running forwards on a worker leaves two pools, and on a 2-core host every forward then ran
    ~40% slower (35 vs 57 ms per SmolLM2 decode step, measured).
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")


@dataclass
class _Caller:
    answered_at: float | None = None  # loop time its last job was answered; None while it has one pending
    return_s: float = 0.0  # how long after its previous answer it submitted again


class ReturningCallers:
    """Callers answered by a batch that will come back with their next job, and when.

    A caller is the asyncio task that submits (each RPC stream is one); it is predicted back as
    long after its answer as it took last time, so a caller that comes back later than a batch
    lasts (a request away at the draft) or not at all (its task ended) is not waited for.
    """

    def __init__(self) -> None:
        self._callers: dict[asyncio.Task, _Caller] = {}

    def submitted(self, caller: asyncio.Task, now: float) -> bool:
        """Records a job of `caller`; whether it is back after an answer (not its first job)."""
        state = self._callers.setdefault(caller, _Caller())
        returning = state.answered_at is not None
        if returning:
            state.return_s = now - state.answered_at
        state.answered_at = None
        return returning

    def answered(self, caller: asyncio.Task, now: float) -> None:
        self._callers.setdefault(caller, _Caller()).answered_at = now

    def num_live(self) -> int:
        """Callers whose task has not ended (each an open RPC stream)."""
        return sum(not caller.done() for caller in self._callers)

    def is_any_due(self, start: float, end: float) -> bool:
        """Whether a caller still out is predicted back between `start` and `end` (loop times)."""
        for caller in [c for c in self._callers if c.done()]:
            del self._callers[caller]
        return any(state.answered_at is not None and start <= state.answered_at + state.return_s <= end
                   for state in self._callers.values())


STOPPED_MESSAGE = "this engine has stopped (its service is shutting down, or its draft was replaced): retry"


def _stopped_process(jobs: list) -> list:
    raise ServiceUnavailableError(STOPPED_MESSAGE)


class BatchingLoop(Generic[J, R]):
    def __init__(self, process: ProcessFn, max_batch_size: int, executor: ThreadPoolExecutor | None = None,
                 phase_of: Callable[[J], str] = lambda job: "step", max_linger_s: float = 0.01,
                 inline: Callable[[], AbstractContextManager] | None = None) -> None:
        """`phase_of(job)` names a job's phase for the observer ("prefill", "verify", "propose").

        `inline` (a model on a GPU): every batch runs on the event loop's thread, inside `inline()` (e.g.
        ModelRunner.on_calling_thread), not on the worker: no thread hand-offs (each a thread wake-up,
        70-220 us on the CPU, two a batch) and no second thread contending for the GIL. A caller alone (one
        request decoding, no other stream open) has its batch's device time waited for in place: with no
        one else to serve, blocking the loop costs nothing. With several streams open the loop polls the
        batch's GPU work (engine/gpu_work.run_polling) and serves the other requests' messages meanwhile:
        blocking the loop for the forward instead made 8 streams ~20 % slower on the H200
        (bench/rpc_overhead.py: target-only 947 -> 791 tok/s). Work handed over between batches
        (run_serialized: a released sequence's KV) runs on the loop's thread too, once no batch is in
        flight. None (a model on the CPU): every batch runs on the worker (a second thread would build a
        second OpenMP pool; see torch_thread). With no batch running or waiting, a lone caller's job after
        its first runs in its own task, inside `submit`, not handed to the loop's task and back: two
        event-loop iterations fewer a job (a submit with a no-op process: 17.7 -> 2.7-4.1 us on the 2-vCPU VM).

        Lingering: while callers answered by earlier batches are due back with their next job
        (ReturningCallers), the next batch waits for them - at most as long as the last batch took
        to run (a caller left out waits at least that long for its own batch) and `max_linger_s`.
        Requests answered by one forward come back staggered (each through its own RPC round
        trip); starting the next forward with the first arrivals splits a batch of 8 decoding
        streams into ~2 forwards per step, each paying for all the weights. Waiting (2 ms at most)
        only for as many jobs as the last batch held kept such a split for good (a group of 5 and
        one of 3 alternate, each batch as big as the last): 5.8 target rows per forward with 8
        target-only streams on the CPU (bench/rpc_overhead.py), 7.9 waiting for the callers due.
        """
        self._process = process
        self._max_batch_size = max_batch_size
        self._max_linger_s = max_linger_s
        self._last_batch_s = 0.0
        self._callers = ReturningCallers()
        self._phase_of = phase_of
        self.observer: ForwardObserver | None = None  # set by the service that exports metrics
        self._pending: list[tuple[J, asyncio.Future[R], asyncio.Task]] = []  # job, its answer, its caller
        self._in_flight: list[tuple[J, asyncio.Future[R], asyncio.Task]] = []  # the batch the loop's task runs
        self._wakeup = asyncio.Event()
        # where the model and KV pool are touched: this single worker thread (CPU), or the loop's (`inline`)
        self.executor = executor or torch_thread()
        self._inline = inline
        self._deferred: list[Callable[[], None]] = []  # run_serialized's work waiting for the batch in flight
        self._running = False  # a batch is in flight (on the worker, or polled on the loop)
        self._stopped = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stops the loop and lets go of its process function, so that the loop's owner (a drafter and its
        model, which hold the loop) is freed as soon as nothing else holds it. Otherwise the two would
        form a reference cycle, as would the cancelled task's traceback (its frame holds the loop), and
        a replaced draft's weights and KV pool would stay allocated until a full garbage collection:
        in a service that allocates little, many swaps later. Jobs not answered yet, and any submitted
        after, fail with ServiceUnavailableError (UNAVAILABLE: the gateway moves the request on) rather
        than wait forever."""
        self._stopped = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for _, future, _ in [*self._in_flight, *self._pending]:
            if not future.done():
                future.set_exception(ServiceUnavailableError(STOPPED_MESSAGE))
        self._in_flight, self._pending = [], []
        self.executor.shutdown(wait=True)
        self._process = _stopped_process
        self._inline = None

    async def submit(self, job: J) -> R:
        if self._stopped:
            raise ServiceUnavailableError(STOPPED_MESSAGE)
        loop = asyncio.get_running_loop()
        caller = asyncio.current_task()
        returning = self._callers.submitted(caller, loop.time())
        if returning and self._is_alone() and not (self._pending or self._running):
            # a caller back alone, nothing else in flight: its job runs here, in its own task, not handed
            # to the loop's task and back (a first job goes there: others may join it in this iteration)
            [result] = self._run_inline([job])
            if result is not None:
                self._callers.answered(caller, loop.time())
                if isinstance(result, Exception):
                    raise result
                return result
        future: asyncio.Future[R] = loop.create_future()
        self._pending.append((job, future, caller))
        self._wakeup.set()
        return await future

    def run_serialized(self, fn: Callable[[], None]) -> None:
        """Runs `fn` between batches (e.g. freeing a sequence's KV) where the batches run: on the worker
        thread, or with `inline` on the loop's (at once, or after the batch in flight); once the loop has
        stopped, not at all (streams cancelled by a shutdown free state that goes with the process, and
        the worker takes no more work)."""
        if self._stopped:
            return
        if self._inline is None:
            self.executor.submit(fn)  # the worker runs it between batches, in order
        elif self._running:
            self._deferred.append(fn)
        else:
            fn()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._pending:
                await self._linger()
                batch = self._pending[: self._max_batch_size]
                del self._pending[: self._max_batch_size]
                batch = [entry for entry in batch if not entry[1].done()]  # drop cancelled
                if not batch:
                    continue
                self._in_flight = batch
                jobs = [job for job, _, _ in batch]
                if self._is_alone():
                    results = self._run_inline(jobs)
                else:
                    self._running = True
                    try:
                        if self._inline is not None:
                            results, duration_ns = await self._polled_process(
                                jobs, functools.partial(self._answer_early, batch))
                        else:
                            results, duration_ns = await loop.run_in_executor(
                                self.executor, self._timed_process, jobs,
                                functools.partial(loop.call_soon_threadsafe, self._answer_early, batch))
                    except Exception as e:  # a bug in process: fail this batch, keep serving
                        results = [e] * len(batch)
                    else:
                        self._ran(jobs, duration_ns)
                    finally:
                        self._running = False
                        self._run_deferred()
                self._answer(batch, results)
                self._in_flight = []

    def _run_inline(self, jobs: list[J]) -> list[R | Exception | None]:
        """Runs a batch on the event loop's thread, inside `inline()`, its GPU waits blocking."""
        try:
            with self._inline():
                results, duration_ns = self._timed_process(jobs)
        except Exception as e:  # a bug in process: fail this batch, keep serving
            return [e] * len(jobs)
        self._ran(jobs, duration_ns)
        return results

    async def _polled_process(self, jobs: list[J], on_answered: OnAnswered) -> tuple[list[R | Exception | None], int]:
        """Runs a batch on the event loop's thread, the loop serving other callbacks while its GPU work runs."""
        start = time.perf_counter_ns()
        with self._inline():
            work = self._process(jobs)
        results = await run_polling(work, self._inline, on_answered)
        return results, time.perf_counter_ns() - start

    def _run_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        for fn in deferred:
            fn()

    def _ran(self, jobs: list[J], duration_ns: int) -> None:
        self._last_batch_s = duration_ns / 1e9
        if self.observer is not None:
            self._observe(jobs, duration_ns)

    def _answer_early(self, batch: list[tuple[J, asyncio.Future[R], asyncio.Task]],
                      results: dict[int, R | Exception]) -> None:
        """Answers jobs of the batch in flight that its process has finished (engine/gpu_work.Answered): their
        callers go on (a request's first token streams, its next step is sent) while the batch's other forwards
        run. The batch's own `_answer` then passes over them."""
        self._answer([batch[i] for i in results], list(results.values()))

    def _answer(self, batch: list[tuple[J, asyncio.Future[R], asyncio.Task]],
                results: list[R | Exception | None]) -> None:
        unfinished = []
        now = asyncio.get_running_loop().time()
        for (job, future, caller), result in zip(batch, results):
            if future.done():  # answered early, or the request was cancelled meanwhile
                continue
            if result is None:
                unfinished.append((job, future, caller))
            elif isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)
                self._callers.answered(caller, now)
        self._pending[:0] = unfinished  # older jobs first

    def _is_alone(self) -> bool:
        """Whether a batch may run inline with blocking GPU waits: on the loop's thread, one stream open."""
        return self._inline is not None and self._callers.num_live() <= 1

    async def _linger(self) -> None:
        """Waits while a full batch is not pending and callers answered earlier are due back within
        the wait: at most as long as the last batch ran (and max_linger_s). A caller due back more
        than that long ago is late (stalled or gone) and not waited for."""
        window_s = min(self._last_batch_s, self._max_linger_s)
        start = asyncio.get_running_loop().time()
        deadline = start + window_s
        while len(self._pending) < self._max_batch_size and self._callers.is_any_due(start - window_s, deadline):
            if not await self._woken_before(deadline):
                return

    async def _woken_before(self, deadline: float) -> bool:
        """Whether a job was submitted before the loop's clock reached `deadline`."""
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            return False
        try:
            await asyncio.wait_for(self._wakeup.wait(), remaining)
        except TimeoutError:
            return False
        self._wakeup.clear()
        return True

    def _timed_process(self, jobs: list[J], on_answered: OnAnswered | None = None
                       ) -> tuple[list[R | Exception | None], int]:
        start = time.perf_counter_ns()
        results = run_to_end(self._process(jobs), on_answered)
        return results, time.perf_counter_ns() - start

    def _observe(self, jobs: list[J], duration_ns: int) -> None:
        phases = {self._phase_of(job) for job in jobs}
        phase = phases.pop() if len(phases) == 1 else MIXED_PHASE
        self.observer.observe_forward(phase, len(jobs), duration_ns / 1e9)
