"""Triton RMS norm of a few rows (decode and verify steps): one program per row, the whole row in
registers, rounded exactly like engine.llama.rms_norm (normalize in float32, round, scale in the
activation dtype). One launch where the PyTorch ops take four."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import pdl


@triton.jit
def rms_norm_row(x_ptr, w_ptr, out_ptr, row, K, stride_x, stride_o, eps, BLOCK_K: tl.constexpr):
    """One row: the kernel's program, and a stage of engine/triton_layer.py's layer kernel."""
    row = tl.cast(row, tl.int64)
    k = tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + row * stride_x + k, mask=k < K, other=0.0)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / K + eps)
    w = tl.load(w_ptr + k, mask=k < K, other=0.0)
    y = ((x32 * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + row * stride_o + k, y, mask=k < K)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, K, stride_x, stride_o, eps, BLOCK_K: tl.constexpr,
                     USE_PDL: tl.constexpr):
    if USE_PDL:  # engine/pdl.py
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rms_norm_row(x_ptr, w_ptr, out_ptr, tl.program_id(0), K, stride_x, stride_o, eps, BLOCK_K)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, K], weight [K] -> [M, K]. Asserting host wrapper."""
    m, k = x.shape
    assert weight.shape == (k,) and weight.is_contiguous() and x.stride(1) == 1
    assert weight.dtype == x.dtype, f"weight {weight.dtype} vs x {x.dtype}"
    out = torch.empty_like(x)
    if m:
        _rms_norm_kernel[(m,)](x, weight, out, k, x.stride(0), out.stride(0), eps,
                               BLOCK_K=triton.next_power_of_2(k), num_warps=8 if k >= 4096 else 4, **pdl.launch_options(x.device))
    return out
