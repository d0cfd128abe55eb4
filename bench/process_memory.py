"""A process's memory as Linux and the GPU driver report it, and a thread that samples any reading through a run:
memory that keeps rising is a leak, a step that levels off a high-water mark (bench/soak.py, bench/swap_memory.py,
bench/gpu_swap.py)."""
from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")


def process_rss_mb(pid: int) -> float:
    """Resident memory of a process (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def gpu_mib(pid: int) -> float | None:
    """GPU memory nvidia-smi charges to `pid`; None without nvidia-smi or when the process has none."""
    try:
        rows = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30).stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return None
    for row in rows:
        row_pid, used = (field.strip() for field in row.split(","))
        if int(row_pid) == pid:
            return float(used)
    return None


class Sampler(threading.Thread, Generic[T]):
    """`read()` every `period_s` until `stop`: (time.perf_counter(), value) samples, None readings left out;
    `started`: when it was made."""

    def __init__(self, read: Callable[[], T | None], period_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.samples: list[tuple[float, T]] = []
        self.started = time.perf_counter()
        self._read, self._period_s, self._stopped = read, period_s, threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(self._period_s):
            if (value := self._read()) is not None:
                self.samples.append((time.perf_counter(), value))

    def stop(self) -> None:
        self._stopped.set()
        self.join()
