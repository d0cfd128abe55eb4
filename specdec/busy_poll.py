"""Busy polling: a service's event loop keeps polling, never sleeping, while one stream is open.

Between two messages of a step an idle event loop sleeps in epoll, and so does its core; on the
GPU host (a VM) a message that arrives after a few milliseconds of that pays for the wake-up.
Measured on the H200 host (bench/results/step_trace*.json, spec alpha 0.8 k 4, one stream): a
round trip to a model service spent 0.98-0.99 ms outside the service's engine call with every
loop sleeping, 0.63-0.65 ms with the loops of all three services polling; the step went from
12.25 to 11.36 ms, target-only from 5.87 to 5.39 ms. The cost is one busy core per service while
it serves one request (none while idle or serving several).

Only while exactly one stream is open: with several, their messages keep the loop awake anyway,
and a model service runs their batches on its worker thread, which needs the GIL the polling loop
keeps taking back (likely: it re-acquires it right after each zero-timeout poll, and the worker
then waits out the 5 ms switch interval; not measured further). Polling with any number of streams
open made 8 target-only streams ~42 % slower on the H200
(bench/results/gpu_e2e_busy_poll_all_streams.json: 512 tok/s, ~880 without).

`auto` (the default) polls where the host has cores to spare (at least MIN_CPUS) and, in a model
service, where the model runs on a GPU: a CPU model's torch threads need every core (on a 2-core
machine polling made the tiny trio's steps 7-18x slower). The gateway goes by the target's device
(ModelInfo.device): beside CPU models, as specdec-launch's default CPU trio on a many-core machine,
a polling gateway would take a core from their torch threads.

While it polls, gRPC's poller thread follows the loop's CPU (specdec/poller_affinity.py): the loop
keeps that CPU awake, so a message wakes the poller there without waiting for a halted CPU.

`--idle-poll` (same modes, same auto rule; off unless asked) keeps the host's idle CPUs from
halting while any stream is open: a SCHED_IDLE spinner per CPU (specdec/idle_cpus.py), which wakes
gRPC's own threads in time where the loop's polling cannot.

Keeping warm (`SPECDEC_KEEP_WARM=1`, off by default; not yet measured on the GPU host): while polling,
the loop runs the service's `rehearse` every REHEARSE_EVERY_S - its step's host work on scratch objects
(engine/rehearsal.py in the model services; the step's messages in the gateway) - so that code is not
cold in the CPU's caches when the next message comes (after a gap of milliseconds the same work ran
several times slower on the CPU VM: bench/cold_host.py). A rehearsal that raises is logged and not run
again.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from specdec.idle_cpus import IdleCpus
from specdec.poller_affinity import PollerAffinity

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
MIN_CPUS = 8
KEEP_WARM_ENV = "SPECDEC_KEEP_WARM"
# polling while up to this many streams are open (1 by default; module doc). Since a GPU model service runs
# its batches on the loop's thread (engine/batching_loop.py), no worker thread needs the GIL the polling
# loop takes, so more may pay: set for a measurement (bench/gpu_ab.py variants)
MAX_STREAMS_ENV = "SPECDEC_BUSY_POLL_MAX_STREAMS"
REHEARSE_EVERY_S = 0.5e-3  # bench/cold_host.py: every 0.25-1 ms kept the work as fast as back to back


def max_polling_streams() -> int:
    """Open streams up to which a service polls (SPECDEC_BUSY_POLL_MAX_STREAMS; 1 unless set)."""
    value = os.environ.get(MAX_STREAMS_ENV, "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{MAX_STREAMS_ENV} must be a whole number >= 1, got {value!r}")
    return int(value)


def keep_warm_enabled() -> bool:
    """Whether a polling service rehearses its step between messages (SPECDEC_KEEP_WARM=1; module doc)."""
    return os.environ.get(KEEP_WARM_ENV, "0") == "1"


def make_busy_poll(loop: bool, idle_cpus: bool, rehearse: Callable[[], None] | None = None) -> BusyPoll | None:
    """What a server holds per stream: its loop polling and/or the idle CPUs; None for neither.
    `rehearse`: run every REHEARSE_EVERY_S while the loop polls (keeping warm, module doc)."""
    if not (loop or idle_cpus):
        return None
    return BusyPoll(loop, IdleCpus() if idle_cpus else None, rehearse)


def busy_poll_enabled(mode: str, model_device: str, num_cpus: int | None = None) -> bool:
    """Whether a service polls: `mode` on/off, or auto (see the module doc); `model_device`: the torch
    device type its model runs on (the gateway: the target's, ModelInfo.device)."""
    if mode not in MODES:
        raise ValueError(f"busy poll must be one of {', '.join(MODES)}, got {mode!r}")
    if mode != "auto":
        return mode == "on"
    return model_device == "cuda" and (num_cpus or os.cpu_count() or 1) >= MIN_CPUS


class BusyPoll:
    """While held 1 to `max_holders` times (holds are counted: one per open stream; at most once unless
    SPECDEC_BUSY_POLL_MAX_STREAMS says more), a task on the running loop yields to it over and over, so the
    loop polls its selector with a zero timeout instead of sleeping; a holder beyond those stops it until
    fewer are left again (see the module doc). With
    `idle_cpus` (specdec/idle_cpus.py) the host's idle CPUs poll while it is held at all; with
    `loop=False` only they do."""

    def __init__(self, loop: bool = True, idle_cpus: IdleCpus | None = None,
                 rehearse: Callable[[], None] | None = None, max_holders: int | None = None) -> None:
        """`max_holders`: the loop polls while held 1 to this many times (None: max_polling_streams())."""
        self.loop = loop
        self.max_holders = max_polling_streams() if max_holders is None else max_holders
        self.idle_cpus = idle_cpus
        self.rehearse = rehearse
        self.num_holders = 0
        self.num_polls = 0
        self.num_rehearsals = 0
        self._task: asyncio.Task | None = None

    @contextmanager
    def held(self) -> Iterator[None]:
        self.num_holders += 1
        self._update()
        try:
            yield
        finally:
            self.num_holders -= 1
            self._update()

    @property
    def is_polling(self) -> bool:
        return self._task is not None

    def close(self) -> None:
        """Stops the idle CPUs' spinners for good (at shutdown)."""
        if self.idle_cpus is not None:
            self.idle_cpus.close()

    def _update(self) -> None:
        if self.idle_cpus is not None:
            if self.num_holders:
                self.idle_cpus.resume()
            else:
                self.idle_cpus.pause()
        if not self.loop:
            return
        polls = 1 <= self.num_holders <= self.max_holders
        if polls and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._poll())
        elif not polls and self._task is not None:
            self._task.cancel()
            self._task = None

    async def _poll(self) -> None:
        poller = PollerAffinity()  # gRPC's poller thread on the CPU this loop keeps awake
        next_rehearsal = time.perf_counter() + REHEARSE_EVERY_S
        try:
            while True:
                await asyncio.sleep(0)
                self.num_polls += 1
                poller.follow()
                if self.rehearse is not None and time.perf_counter() >= next_rehearsal:
                    self._rehearse()
                    next_rehearsal = time.perf_counter() + REHEARSE_EVERY_S
        finally:
            poller.release()

    def _rehearse(self) -> None:
        try:
            self.rehearse()
        except Exception:  # noqa: BLE001 - keeping warm is an optimisation: never worth a failed poll
            log.exception("rehearsal failed; not rehearsing again")
            self.rehearse = None
        else:
            self.num_rehearsals += 1
