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


def test_live_blocks_group_by_stack_largest_first_naming_our_frames_packages_and_torch_cpp(draft_memory):
    root = str(draft_memory.ROOT)
    kv = (f"{root}/engine/kv_cache.py", 76, "__init__")
    graph = (f"{root}/engine/cuda_graphs.py", 285, "capture")
    workspace = ("/pytorch/aten/src/ATen/cuda/CublasHandlePool.cpp", 300, "at::cuda::getCUDABlasLtWorkspace()")
    linear = ("/usr/lib/python3/dist-packages/torch/nn/modules/linear.py", 125, "forward")
    outside = ("<frozen runpy>", 1, "_run_code")  # neither the repo, a package nor PyTorch's C++: left out
    snapshot = {"segments": [
        {"blocks": [_block(64, "active_allocated", kv, outside), _block(512, "inactive", kv)]},
        {"blocks": [_block(1024, "active_allocated", graph), _block(32, "active_allocated", kv)]},
        {"blocks": [_block(32, "active_allocated", workspace, linear, graph)]},
        {"blocks": [_block(2, "active_allocated")]},
    ]}
    assert draft_memory.leftover_stacks(snapshot) == [
        "1024.0 MiB: cuda_graphs.py:285 capture", "96.0 MiB: kv_cache.py:76 __init__",
        "32.0 MiB: CublasHandlePool.cpp:300 at::cuda::getCUDABlasLtWorkspace() <- linear.py:125 forward "
        "<- cuda_graphs.py:285 capture", "2.0 MiB: (no frames)"]
    assert draft_memory.leftover_stacks(snapshot, top=1) == ["1024.0 MiB: cuda_graphs.py:285 capture"]
