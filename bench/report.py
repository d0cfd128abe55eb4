"""The one shape every benchmark saves: bench/results/NAME.json with name, command, machine, host, when, metrics."""
from __future__ import annotations

import itertools
import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {platform.machine()}"
    return f"{platform.node()} {platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def host() -> dict:
    """The CPU side of the machine: the time a step spends outside the forwards moves between GPU machine starts
    (0.06-0.13 of a step for the same code), so each report names its host, to compare runs by it."""
    first_cpu = itertools.takewhile(str.strip, _read_lines("/proc/cpuinfo"))  # its block ends at a blank line
    cpuinfo = {key.strip(): value.strip() for key, value in (line.split(":", 1) for line in first_cpu if ":" in line)}
    # a VM may name its CPUs generically ("Intel(R) Xeon(R) Processor"): the clock and cache tell hosts apart
    return {"cpu": cpuinfo.get("model name", platform.processor()), "cpu_mhz": cpuinfo.get("cpu MHz", ""),
            "cpu_cache": cpuinfo.get("cache size", ""), "cpus": os.cpu_count(), "kernel": platform.release(),
            "cpuidle_driver": next(iter(_read_lines("/sys/devices/system/cpu/cpuidle/current_driver")), "none")}


def _read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def save_report(name: str, metrics: dict, out: Path, **extra) -> dict:
    """Writes the report (floats rounded to 4 places, nested ones too) and prints its metrics; returns it."""
    report = {
        "name": name,
        "command": f"python bench/{Path(sys.argv[0]).name} " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "host": host(),
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **extra,
        "metrics": _rounded(metrics),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["metrics"], indent=2))
    return report


def _rounded(value):
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return round(value, 4) if isinstance(value, float) else value
