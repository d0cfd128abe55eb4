"""A service's threads pinned to chosen CPUs (`--cpus`, every service).

Why a step's round trips may want it: a service waiting for its next message sleeps in gRPC's
poller thread, and on a VM host whose idle vCPUs halt (the H200 host: specdec/idle_cpus.py) the
message's arrival wakes that thread only once the hypervisor runs its vCPU again. On the CPU a
busy-polling loop (specdec/busy_poll.py) spins on, a woken thread is scheduled at once: pinned to one
CPU, the process's poller and its spinning loop share it. (Busy polling now moves the poller onto the
loop's CPU itself while it polls, specdec/poller_affinity.py; pinning still bounds every thread.) On
this repository's 2-vCPU CI-class VM (`python bench/grpc_pingpong.py --rounds 150 [--pin]`, two runs
each) a verify round trip after 4.5 ms of blocking handler work cost 401 / 381 us outside the work
unpinned and 275 / 318 us pinned, and 215 / 210 against 213 / 210 with both event loops spinning:
pinning pays where nothing else keeps the CPU awake. Off by default; one CPU per service suits a GPU service at batch 1, whose forwards run on the event loop
(engine/batching_loop.py), not a CPU model's thread pool.
"""
from __future__ import annotations

import itertools
import os
from collections.abc import Iterator


def parse_cpus(text: str) -> frozenset[int]:
    """CPUs in the kernel's list format: "3", "2-3,6". Raises ValueError with what is wrong."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"not a CPU list (like 3 or 2-3,6): {text!r}")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"CPU range {part.strip()!r} runs backwards")
        cpus.update(range(low, high + 1))
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise ValueError(f"CPUs {sorted(cpus - allowed)} are not available here (available: {sorted(allowed)})")
    return frozenset(cpus)


def pin_process(cpus: frozenset[int], pid: int | None = None) -> None:
    """Every thread of a process (this one by default; gRPC's, torch's, already running or started
    later) on `cpus`. sched_setaffinity applies to one thread; new threads inherit their creator's set."""
    for task in os.listdir(f"/proc/{pid or 'self'}/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def cpus_from_the_last() -> Iterator[int]:
    """A CPU for each service started, from this process's last CPUs down (round robin once they run
    out): what the benchmarks' --pin-services / --pin-ab give each service."""
    return itertools.cycle(sorted(os.sched_getaffinity(0), reverse=True))
