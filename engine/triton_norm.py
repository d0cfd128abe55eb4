"""Triton RMS norm of a few rows (decode and verify steps): one program per row, the whole row in
registers, rounded exactly like engine.llama.rms_norm (normalize in float32, round, scale in the
activation dtype). One launch where the PyTorch ops take four. `quantize=True`: the normed rows as
int8 values and a scale a row (engine/triton_quant.py), for the W8A8 products after the norm."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import pdl
from engine.triton_quant import store_int8_row


@triton.jit
def rms_norm_values(x_ptr, w_ptr, row, K, stride_x, eps, BLOCK_K: tl.constexpr):
    """A row's normed values [BLOCK_K] in the activation dtype (0 past K)."""
    k = tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + row * stride_x + k, mask=k < K, other=0.0)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / K + eps)
    w = tl.load(w_ptr + k, mask=k < K, other=0.0)
    return ((x32 * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)).to(x.dtype)


@triton.jit
def rms_norm_row(x_ptr, w_ptr, out_ptr, row, K, stride_x, stride_o, eps, BLOCK_K: tl.constexpr):
    """One row: the kernel's program, and a stage of engine/triton_layer.py's layer kernel."""
    row = tl.cast(row, tl.int64)
    k = tl.arange(0, BLOCK_K)
    y = rms_norm_values(x_ptr, w_ptr, row, K, stride_x, eps, BLOCK_K)
    tl.store(out_ptr + row * stride_o + k, y, mask=k < K)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, scale_ptr, K, stride_x, stride_o, eps, BLOCK_K: tl.constexpr,
                     QUANTIZE: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # engine/pdl.py
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if QUANTIZE:
        row = tl.program_id(0).to(tl.int64)
        y = rms_norm_values(x_ptr, w_ptr, row, K, stride_x, eps, BLOCK_K).to(tl.float32)
        store_int8_row(y, tl.arange(0, BLOCK_K), K, out_ptr, scale_ptr, row, stride_o)
    else:
        rms_norm_row(x_ptr, w_ptr, out_ptr, tl.program_id(0), K, stride_x, stride_o, eps, BLOCK_K)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    quantize: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [M, K], weight [K] -> [M, K] (quantize: int8 [M, K] and float32 scales [M]). Asserting host wrapper."""
    m, k = x.shape
    assert weight.shape == (k,) and weight.is_contiguous() and x.stride(1) == 1
    assert weight.dtype == x.dtype, f"weight {weight.dtype} vs x {x.dtype}"
    out = torch.empty_like(x, dtype=torch.int8 if quantize else x.dtype)
    scales = torch.empty((m,), dtype=torch.float32, device=x.device) if quantize else out
    if m:
        _rms_norm_kernel[(m,)](x, weight, out, scales, k, x.stride(0), out.stride(0), eps,
                               BLOCK_K=triton.next_power_of_2(k), QUANTIZE=quantize,
                               num_warps=8 if k >= 4096 else 4, **pdl.launch_options(x.device))
    return (out, scales) if quantize else out
