"""Idle-CPU spinners (specdec/idle_cpus.py): paused until resumed, at the idle priority on their own
CPU, held by a busy poll while any stream is open, and gone after close or their parent's death."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc

from specdec.busy_poll import BusyPoll
from specdec.idle_cpus import IdleCpus
from specdec.serving import start_server

ROOT = Path(__file__).resolve().parents[2]
CPU = min(os.sched_getaffinity(0))


def state(pid: int) -> str | None:
    """The process's state letter (R running, S sleeping, T stopped), None once it is gone or a zombie."""
    try:
        letter = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if letter in "ZX" else letter


def eventually(check, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.01)
    return check()


def test_spinners_start_with_the_first_resume_and_spin_on_their_cpu_at_the_idle_priority():
    spinners = IdleCpus([CPU])
    assert spinners.pids == [] and not spinners.running  # none before anything is served
    try:
        spinners.resume()
        (pid,) = spinners.pids
        assert eventually(lambda: os.sched_getscheduler(pid) == os.SCHED_IDLE)
        assert os.sched_getaffinity(pid) == {CPU}
        assert eventually(lambda: state(pid) == "R")  # busy, never sleeping
        spinners.pause()
        assert eventually(lambda: state(pid) == "T")
        spinners.resume()  # the same spinner again
        assert spinners.pids == [pid] and eventually(lambda: state(pid) == "R")
    finally:
        spinners.close()
    assert state(pid) is None and spinners.pids == []


def test_a_busy_poll_runs_the_idle_cpus_while_any_stream_is_held():
    spinners = IdleCpus([CPU])

    async def scenario() -> None:
        poll = BusyPoll(loop=False, idle_cpus=spinners)
        assert not spinners.running
        with poll.held():
            assert spinners.running and not poll.is_polling  # loop=False: only the CPUs poll
            with poll.held():
                assert spinners.running  # two streams: still
            assert spinners.running
        assert not spinners.running

    try:
        asyncio.run(scenario())
    finally:
        spinners.close()


def test_spinners_die_with_the_process_that_made_them():
    code = ("import os, time; from specdec.idle_cpus import IdleCpus; s = IdleCpus(); s.resume()\n"
            "while not all(os.sched_getscheduler(p) == os.SCHED_IDLE for p in s.pids): time.sleep(0.01)\n"
            "print(*s.pids, flush=True); os._exit(0)")  # spinning, then killed without a close
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True).stdout
    pids = [int(p) for p in out.split()]
    assert len(pids) == len(os.sched_getaffinity(0))
    assert eventually(lambda: all(state(pid) is None for pid in pids)), [state(p) for p in pids]


def test_a_server_with_idle_poll_stops_its_spinners_when_it_stops():
    async def scenario() -> list[int]:
        server = await start_server(lambda s: None, [], "127.0.0.1", 0, idle_poll=True)
        assert not server.busy_poll.loop and server.busy_poll.idle_cpus.pids == []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            await channel.channel_ready()
        with server.busy_poll.held():  # as a Sequence stream holds it
            pids = server.busy_poll.idle_cpus.pids
            assert pids and all(state(pid) for pid in pids)
        await server.stop(0)
        return pids

    pids = asyncio.run(scenario())
    assert pids and all(state(pid) is None for pid in pids)
