"""gRPC reads GRPC_EXPERIMENTS once, when it loads: every process of ours must have chosen the poller
(specdec/__init__.py) before its first `import grpc`."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdec import LEGACY_POLLER

ROOT = Path(__file__).resolve().parents[2]

# records GRPC_EXPERIMENTS as it is when `import grpc` first runs, then imports the module named
SPY = """
import os, sys
seen = []
class Spy:
    def find_spec(self, name, path=None, target=None):
        if name == "grpc" and not seen:
            seen.append(os.environ.get("GRPC_EXPERIMENTS"))
sys.meta_path.insert(0, Spy())
import {module}
print(repr(seen[0]))
"""


def grpc_experiments_seen_by_grpc(module: str, env: dict[str, str]) -> str | None:
    environ = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"} | env
    out = subprocess.run([sys.executable, "-c", SPY.format(module=module)], cwd=ROOT, env=environ,
                         stdout=subprocess.PIPE, text=True, check=True).stdout
    return eval(out.strip())  # noqa: S307 - our own repr of a str or None


@pytest.mark.parametrize("module", ["gateway.cli", "draft_service.cli", "target_service.cli", "specdec.admin"])
def test_each_entry_point_loads_grpc_with_the_legacy_poller_chosen(module):
    assert grpc_experiments_seen_by_grpc(module, {}) == LEGACY_POLLER


@pytest.mark.parametrize("value", ["", "-event_engine_client"])
def test_an_operators_grpc_experiments_is_kept(value):
    assert grpc_experiments_seen_by_grpc("gateway.cli", {"GRPC_EXPERIMENTS": value}) == value
