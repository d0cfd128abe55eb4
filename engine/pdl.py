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
import triton.language as tl

# opt-in (SPECDEC_PDL=1): on the H200 it cuts graph replays (bench/results/gpu_pdl.json: 8B decode
# 4.41 -> 4.25 ms, 1B k = 4 proposal 4.43-4.54 -> 4.24-4.26 ms), but the trio end to end did not gain
# (bench/results/gpu_e2e_pdl_ab_{off,on}.json: 277 vs 269 tok/s at alpha 0.8, k 4, batch 1, one run each)
ENABLED = os.environ.get("SPECDEC_PDL", "0") == "1"


def launch_options(device: torch.device) -> dict[str, bool]:
    if ENABLED and device.type == "cuda" and _supported(device.index or 0):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9 and hasattr(tl.extra.cuda, "gdc_wait")
