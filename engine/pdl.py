"""Programmatic dependent launch (PDL, Hopper and later) for the Triton kernels of graph steps.

A decode step is a chain of ~9 small kernels a layer; in a CUDA graph each still waits for the
previous one to finish, then launches, ramps up and drains. With PDL a kernel is launched while
its predecessor runs: its programs start as soon as every program of the predecessor has started
(`gdc_launch_dependents`), and wait at their first line (`gdc_wait`) until the predecessor has
finished and its writes are visible. So every kernel here waits before it touches global memory,
reads or writes: a kernel sees exactly what it would without PDL, and the results are the same bits.

`launch_options(device)` gives a kernel launch its keyword arguments: the kernel's `USE_PDL`
constexpr and Triton's `launch_pdl` where PDL is on (`ENABLED`, CUDA, compute capability 9+), else
`USE_PDL=False` alone (the CPU interpreter knows neither instruction).
"""
from __future__ import annotations

import os
from functools import cache

import torch


def from_env(default: bool) -> bool:
    """SPECDEC_PDL=1 or 0 if set, else `default`."""
    return os.environ.get("SPECDEC_PDL", "1" if default else "0") == "1"


# Off unless SPECDEC_PDL=1, the target's default: it cuts graph replays (bench/results/gpu_pdl.json: 8B
# decode 4.41 -> 4.25 ms), but the trio end to end did not gain (gpu_e2e_pdl_ab_{off,on}.json: 277 vs
# 269 tok/s at alpha 0.8, k 4, batch 1, both services with it, one run each; again with the services
# pinned, gpu_e2e_target_pdl{0,1}.json: 363.5 vs 361.6, a verify 4.70 vs 4.86 ms). The draft service turns
# it on (draft_service/cli.py): a 1B decode replay 1.084 -> 1.007 ms, int8 with a 32k head 0.908 ->
# 0.833, a k = 4 proposal 5.22 -> 4.77 and 4.39 -> 4.00 ms (bench/results/gpu_draft_forward.json).
ENABLED = from_env(default=False)


def launch_options(device: torch.device) -> dict[str, bool]:
    if ENABLED and device.type == "cuda" and _supported(device.index or 0):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@cache
def _supported(device_index: int) -> bool:
    import triton.language as tl  # an optional dependency (GPU hosts): only where PDL may run

    return torch.cuda.get_device_capability(device_index)[0] >= 9 and hasattr(tl.extra.cuda, "gdc_wait")
