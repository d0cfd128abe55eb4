"""gRPC's poller thread follows a busy-polling loop's CPU, and gets its CPUs back (specdec/poller_affinity.py)."""
from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import grpc
import pytest

from specdec.busy_poll import BusyPoll
from specdec.poller_affinity import PollerAffinity, current_cpu, grpc_poller_threads

CPUS = sorted(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(current_cpu is None, reason="the C library has no sched_getcpu")


@contextmanager
def this_thread_on(cpu: int) -> Iterator[None]:
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@asynccontextmanager
async def grpc_aio_running() -> AsyncIterator[list[int]]:
    """A grpc.aio server started on the running loop (so gRPC's poller thread runs); the poller's ids."""
    server = grpc.aio.server()
    server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        pollers = grpc_poller_threads()
        assert pollers, "grpc.aio started no thread named after its poller: gRPC's internals changed"
        yield pollers
    finally:
        await server.stop(None)


def test_the_poller_moves_to_the_cpu_of_the_thread_that_follows_and_back_on_release():
    async def scenario() -> None:
        async with grpc_aio_running() as pollers:
            before = [os.sched_getaffinity(tid) for tid in pollers]
            affinity = PollerAffinity()
            for cpu in (CPUS[0], CPUS[-1]):  # a second CPU where there is one: it moves again
                with this_thread_on(cpu):
                    affinity.follow()
                assert affinity.cpu == cpu
                assert [os.sched_getaffinity(tid) for tid in pollers] == [{cpu}] * len(pollers)
            affinity.release()
            assert [os.sched_getaffinity(tid) for tid in pollers] == before
            assert affinity.cpu is None

    asyncio.run(scenario())


def test_a_busy_polling_loop_keeps_the_poller_on_its_cpu_only_while_it_polls():
    async def scenario() -> None:
        async with grpc_aio_running() as pollers:
            before = [os.sched_getaffinity(tid) for tid in pollers]
            poll = BusyPoll()
            with this_thread_on(CPUS[-1]), poll.held():
                await asyncio.sleep(0.02)
                assert poll.num_polls > 10
                assert [os.sched_getaffinity(tid) for tid in pollers] == [{CPUS[-1]}] * len(pollers)
            await asyncio.sleep(0)  # the cancelled polling task ends, and gives the poller its CPUs back
            assert not poll.is_polling
            assert [os.sched_getaffinity(tid) for tid in pollers] == before

    asyncio.run(scenario())
