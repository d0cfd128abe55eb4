"""gRPC's poller thread kept on the CPU its process's event loop is polling on, while it polls.

grpc.aio reads the sockets on a thread of its own (the completion queue's poller, a thread named
"...(_poll_wrapper)"), which sleeps in epoll between messages and hands each event to the loop. A
busy-polling loop (specdec/busy_poll.py) keeps its own CPU awake, not the poller's: on a VM host
whose idle vCPUs halt (the H200 host, specdec/idle_cpus.py) a message that arrives after a step's
few milliseconds waits for the hypervisor to run the poller's vCPU again. `--cpus` (one CPU a
service) puts the two threads on one CPU, and on the H200 took a speculative step's time outside
the forwards from 1.05 to 0.88 ms (bench/results/gpu_e2e_pin_ab.json); but which CPUs are free is
the deployment's to say. Following needs no CPU named: while the loop polls, the poller may run
only on the CPU the loop is on now, and moves when the loop does (the loop itself is not pinned,
so the scheduler still moves it off a busy CPU); when polling stops, the poller gets back the CPUs
it had.
"""
from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable

POLLER_THREAD_SUFFIX = "(_poll_wrapper)"  # threading names a thread after its target: PollerCompletionQueue._poll_wrapper


def _load_getcpu() -> Callable[[], int] | None:
    try:
        getcpu = ctypes.CDLL(None, use_errno=True).sched_getcpu  # glibc, through the vDSO
    except (OSError, AttributeError):
        return None
    getcpu.restype, getcpu.argtypes = ctypes.c_int, []
    return getcpu if getcpu() >= 0 else None


current_cpu = _load_getcpu()  # None where the C library has no sched_getcpu: following is then off


def grpc_poller_threads() -> list[int]:
    """Native thread ids of this process's grpc.aio poller threads (none before grpc.aio has started)."""
    return [t.native_id for t in threading.enumerate() if t.name.endswith(POLLER_THREAD_SUFFIX) and t.native_id]


class PollerAffinity:
    """Call `follow()` from the polling loop's thread each time it polls; `release()` when it stops."""

    def __init__(self) -> None:
        self.cpu: int | None = None  # the CPU the pollers were last moved to
        self._saved: dict[int, set[int]] = {}  # poller thread id -> its CPUs before the first move

    def follow(self) -> None:
        if current_cpu is None:
            return
        cpu = current_cpu()
        if cpu == self.cpu:
            # a poller that was running when it was moved here (or any thread left on this CPU) runs
            # now, not once the scheduler preempts a loop that never sleeps (a time slice, ms later)
            os.sched_yield()
            return
        self.cpu = cpu
        for tid in grpc_poller_threads():
            try:
                cpus = self._saved[tid] if tid in self._saved else os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, {cpu})
            except OSError:  # the thread ended, or may not run on this CPU: left where it is
                continue
            self._saved[tid] = cpus  # what release() gives back: its CPUs before the first move

    def release(self) -> None:
        for tid, cpus in self._saved.items():
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:  # the thread ended
                pass
        self._saved.clear()
        self.cpu = None
