"""A process's CPU time, all its threads (Linux /proc): host work per step, apart from the wall clock."""
from __future__ import annotations

import os
from pathlib import Path


def process_cpu_s(pid: int) -> float:
    """CPU seconds a process has run, all its threads, user and system (clock ticks: 10 ms granules)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
