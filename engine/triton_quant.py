"""Triton int8 rows for W8A8 products (--quantize w8a8, drafts): each row of activations becomes int8
values and one float32 scale, its largest magnitude over 127 (symmetric, rounded half away from zero,
as engine.linear.quantize_rows_reference). The products after a norm take theirs from the norm kernel
(engine/triton_norm.py: `rms_norm_triton(..., quantize=True)`); the others (o_proj after attention,
the down projection after gate/up) from this kernel, one program a row."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import pdl


@triton.jit
def store_int8_row(y, k, K, q_ptr, s_ptr, row, stride_q):
    """Stores float32 [BLOCK_K] `y` (masked past K) as int8 values at q_ptr's `row` and their scale."""
    scale = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12) / 127.0
    v = y / scale
    q = tl.minimum(tl.maximum(v + tl.where(v >= 0, 0.5, -0.5), -127.0), 127.0)
    tl.store(q_ptr + row * stride_q + k, q.to(tl.int8), mask=k < K)
    tl.store(s_ptr + row, scale)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # engine/pdl.py
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    y = tl.load(x_ptr + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
    store_int8_row(y, k, K, q_ptr, s_ptr, row, stride_q)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> int8 [M, K] and float32 scales [M]. Asserting host wrapper."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.is_floating_point()
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scales = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m,)](x, q, scales, k, x.stride(0), q.stride(0), BLOCK_K=triton.next_power_of_2(k),
                                    num_warps=8 if k >= 4096 else 4, **pdl.launch_options(x.device))
    return q, scales
