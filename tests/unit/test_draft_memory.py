"""bench/draft_memory.py: what stays allocated, grouped by the stack that allocated it, largest first."""
from __future__ import annotations

import pytest
from harness import bench_module

MIB = 2**20


@pytest.fixture(scope="module")
def draft_memory():
    yield from bench_module("draft_memory")


def _block(size_mib: int, state: str, *frames: tuple[str, int, str]) -> dict:
    return {"size": size_mib * MIB, "state": state,
            "frames": [{"filename": f, "line": line, "name": name} for f, line, name in frames]}


def test_live_blocks_group_by_their_stack_in_the_repo_and_packages_largest_first(draft_memory):
    root = str(draft_memory.ROOT)
    kv = (f"{root}/engine/kv_cache.py", 76, "__init__")
    graph = (f"{root}/engine/cuda_graphs.py", 285, "capture")
    outside = ("<frozen runpy>", 1, "_run_code")  # neither the repo nor a package: left out of the stack
    snapshot = {"segments": [
        {"blocks": [_block(64, "active_allocated", kv, outside), _block(512, "inactive", kv)]},
        {"blocks": [_block(1024, "active_allocated", graph), _block(32, "active_allocated", kv)]},
        {"blocks": [_block(2, "active_allocated")]},
    ]}
    assert draft_memory.leftover_stacks(snapshot) == [
        "1024.0 MiB: cuda_graphs.py:285 capture", "96.0 MiB: kv_cache.py:76 __init__", "2.0 MiB: (no Python frames)"]
    assert draft_memory.leftover_stacks(snapshot, top=1) == ["1024.0 MiB: cuda_graphs.py:285 capture"]
