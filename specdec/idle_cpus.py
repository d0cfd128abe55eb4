"""Idle CPUs kept polling: one busy-looping process per CPU, at the idle priority, while a service serves.

On the GPU host (a Firecracker VM whose kernel has no cpuidle driver: `current_driver` reads none)
an idle vCPU halts, and a thread woken on it waits until the hypervisor runs that vCPU again. A step
wakes several such threads (gRPC's poller threads in every process, each message direction), and
busy polling the event loop (specdec/busy_poll.py) does not keep those awake. Measured with
`python bench/grpc_pingpong.py [--idle-cpus]` on the H200 host
(bench/results/grpc_pingpong_idle_cpus{_base,}.json): a verify round trip over our stack after
4.5 ms of handler work cost 665-734 us outside the work with the CPUs free to halt and 361-481 us
with these spinners (448-551 against 340-395 with both event loops polling too); a bare grpc.aio
ping-pong 196 against 160 us. Holding /dev/cpu_dma_latency at 0 (PM QoS, the bare-metal cure for
deep C-states) changed nothing there (bench/results/grpc_pingpong_cpu_idle_probe.json): with no
cpuidle driver there is no state to forbid.

End to end it did not pay where it matters here (`python bench/gpu_e2e.py --skip-hf --ks 4
--batches 1 8 --draft-quantize int8 --draft-head-rows 32768 --idle-cpus-ab`, one run,
bench/results/gpu_e2e_idle_cpus_ab.json): target-only at batch 1 166.3 -> 177.1 tok/s, but
speculative alpha 0.8, k = 4 304.1 -> 300.3 (the services' loops already poll at batch 1), and at
batch 8 target-only 894 -> 844, speculative 818 -> 953 (a figure that moves run to run). So the
services' --idle-poll is off unless asked for.

A spinner runs under SCHED_IDLE, so any runnable thread of any process takes its CPU at once: it
only fills time the CPU would have halted. The cost is power and, where vCPUs are hyperthread
siblings, some of a busy sibling's throughput. Spinners start with the first stream (a service that
never serves, or fails to start, makes none), are paused (SIGSTOP) while nothing is served and
resumed (SIGCONT) while a stream is open, and die with the process that made them
(PR_SET_PDEATHSIG) even if it is killed.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterable

# the spinner: dies with its parent, takes the idle priority and its one CPU, then loops
SPIN = """\
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[2]):
    sys.exit()
os.sched_setaffinity(0, {int(sys.argv[1])})
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
while True:
    pass
"""


class IdleCpus:
    """One SCHED_IDLE spinner per CPU of `cpus` (default: those this process may run on), made at
    the first `resume`; `resume` / `pause` while serving / idle, `close` at shutdown."""

    def __init__(self, cpus: Iterable[int] | None = None) -> None:
        self.cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
        self.running = False
        self._spinners: list[subprocess.Popen] = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._spinners]

    def resume(self) -> None:
        if self.running:
            return
        if not self._spinners:  # from the loop's thread: PR_SET_PDEATHSIG follows the thread that forks
            self._spinners = [subprocess.Popen([sys.executable, "-S", "-c", SPIN, str(cpu), str(os.getpid())],
                                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
                              for cpu in self.cpus]
        self._signal(signal.SIGCONT)
        self.running = True

    def pause(self) -> None:
        if self.running:
            self._signal(signal.SIGSTOP)
            self.running = False

    def close(self) -> None:
        self._signal(signal.SIGKILL)
        for spinner in self._spinners:
            spinner.wait()
        self._spinners = []
        self.running = False

    def _signal(self, signum: int) -> None:
        for spinner in self._spinners:
            if spinner.poll() is None:
                spinner.send_signal(signum)
