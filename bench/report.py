"""The one shape every benchmark saves: bench/results/NAME.json with name, command, machine, when, metrics."""
from __future__ import annotations

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
    """The CPU side of the machine: GPU machine starts differ in it, and host time moves with them."""
    model = next((line.split(":", 1)[1].strip() for line in _read_lines("/proc/cpuinfo")
                  if line.startswith("model name")), platform.processor())
    return {"cpu": model, "cpus": os.cpu_count(), "kernel": platform.release(),
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
