"""Device-side timing shared by the GPU benchmarks."""
from __future__ import annotations

from collections.abc import Callable

import torch


def cuda_ms(fn: Callable[[], object], iters: int = 20) -> float:
    """Mean milliseconds of `fn` on the current stream, by CUDA events, after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters
