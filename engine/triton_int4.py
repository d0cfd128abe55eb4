"""Triton skinny linear over int4 weights (engine/linear.Int4Linear): a draft's widest products.

A 1B draft's decode forward streams its gate/up projection (16384 x 2048) and its LM head in every
layer and step; in int8 they are half of bf16's bytes, here a quarter. The format:

  qweight  uint8 [N, K / 2]: byte j of row n holds u[n, j] in its low nibble and u[n, j + K / 2] in
           its high one, u = q + 8 for the signed value q in [-8, 7] (the two halves of K, so a K step
           of the loop reads two contiguous runs of x)
  scale    [N, K / G] (the activations' dtype): weight[n, k] stands for q[n, k] * scale[n, k // G]

One program streams a BLOCK_N x K / 2 strip of bytes, one quantization group of each half a loop step
(G bytes a row), and multiplies both halves' nibbles with the rows of x at once (tensor-core dots over
the rows padded to 16), each group's float32 sum times its scale. Epilogues as the skinny linear's
(engine/triton_linear.py): `silu_mul` for interleaved gate/up rows, else the product rounded to the
output dtype. A row's result does not depend on the other rows (the launch configuration is a
function of N and K only).

`MAGIC` unpacking (bf16 only): a nibble u or'ed into the mantissa of 128.0 is the bf16 number 128 + u,
exactly, with no integer-to-float conversion; the dot of x with those is the dot with q plus 136 times
the sum of x's group, which is subtracted. Otherwise each nibble is converted (u - 8, widened).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine import pdl

BLOCK_M = 16  # rows per program: the smallest tensor-core tile


@dataclass(frozen=True)
class Int4Config:
    block_n: int
    num_warps: int
    num_stages: int
    magic: bool = True  # bf16 activations only (module doc)


def int4_launch_config(n: int, k: int) -> Int4Config:
    """A function of the weight's shape only (never of the row count)."""
    return Int4Config(block_n=32, num_warps=4, num_stages=4)


@triton.jit
def _int4_linear_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
    SILU_MUL: tl.constexpr,
    GROUP: tl.constexpr,
    MAGIC: tl.constexpr,
    EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # engine/pdl.py: wait for the previous kernel before any load or store
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    dtype = x_ptr.dtype.element_ty
    half = K // 2
    offs = tl.arange(0, GROUP)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + cols[:, None].to(tl.int64) * stride_wn
    s_cols = scale_ptr + cols.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for j0 in range(0, half, GROUP):
        j = j0 + offs
        if EVEN_N:
            packed = tl.load(w_cols + j[None, :])  # [BLOCK_N, GROUP] bytes
        else:
            packed = tl.load(w_cols + j[None, :], mask=col_ok[:, None], other=0)
        a_lo = tl.load(x_rows + j[None, :], mask=row_ok[:, None], other=0.0)
        a_hi = tl.load(x_rows + half + j[None, :], mask=row_ok[:, None], other=0.0)
        if MAGIC:  # 128 + u as bf16 bits (0x4300 is 128.0), then 136 * sum(x) off each group's dot
            w_lo = ((packed & 15).to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)
            w_hi = ((packed >> 4).to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)
            d_lo = tl.dot(a_lo, tl.trans(w_lo), input_precision=DOT_PRECISION) \
                - 136.0 * tl.sum(a_lo.to(tl.float32), axis=1)[:, None]
            d_hi = tl.dot(a_hi, tl.trans(w_hi), input_precision=DOT_PRECISION) \
                - 136.0 * tl.sum(a_hi.to(tl.float32), axis=1)[:, None]
        else:
            w_lo = ((packed & 15).to(tl.int8) - 8).to(dtype)
            w_hi = ((packed >> 4).to(tl.int8) - 8).to(dtype)
            d_lo = tl.dot(a_lo, tl.trans(w_lo), input_precision=DOT_PRECISION)
            d_hi = tl.dot(a_hi, tl.trans(w_hi), input_precision=DOT_PRECISION)
        g = j0 // GROUP
        acc += d_lo * tl.load(s_cols + g, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc += d_hi * tl.load(s_cols + g + half // GROUP, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:  # columns (2j, 2j + 1) are (gate_j, up_j); each op rounded like PyTorch's
        gate, up = tl.split(tl.reshape(acc.to(dtype).to(tl.float32), [BLOCK_M, BLOCK_N // 2, 2]))
        y = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
        cols = tl.program_id(1) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        col_ok = cols < N // 2
    else:
        y = acc
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def int4_linear(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [N, K / 2] uint8 (module doc; silu_mul: rows gate_0, up_0, gate_1, ...)
    scale: torch.Tensor,  # [N, K / G]
    *,
    silu_mul: bool = False,
    out_dtype: torch.dtype | None = None,
    config: Int4Config | None = None,
) -> torch.Tensor:  # [M, N] ([M, N / 2] with silu_mul)
    """Asserting host wrapper: every shape, dtype and stride is checked before launch."""
    assert x.dim() == 2 and qweight.dim() == 2 and scale.dim() == 2, "x [M, K], qweight [N, K / 2], scale [N, K / G]"
    m, k = x.shape
    n = qweight.shape[0]
    assert qweight.dtype == torch.uint8 and qweight.shape[1] * 2 == k, f"qweight {tuple(qweight.shape)} for x {tuple(x.shape)}"
    assert scale.shape[0] == n and k % scale.shape[1] == 0, f"scale {tuple(scale.shape)} for {n} x {k} weights"
    group = k // scale.shape[1]
    assert (k // 2) % group == 0 and group >= 16 and group & (group - 1) == 0, \
        f"group {group}: a power of two of at least 16 dividing K / 2 = {k // 2}"
    assert x.stride(1) == 1 and qweight.stride(1) == 1 and scale.stride(1) == 1, "rows must be contiguous"
    assert x.device == qweight.device == scale.device and x.dtype != torch.uint8
    config = config or int4_launch_config(n, k)
    assert not silu_mul or (config.block_n % 2 == 0 and n % 2 == 0), "silu_mul needs gate/up row pairs"
    magic = config.magic and x.dtype == torch.bfloat16
    out = torch.empty((m, n // 2 if silu_mul else n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, config.block_n))
    _int4_linear_kernel[grid](
        x, qweight, scale, out, m, n, k, x.stride(0), qweight.stride(0), scale.stride(0), out.stride(0),
        SILU_MUL=silu_mul, GROUP=group, MAGIC=magic, EVEN_N=n % config.block_n == 0, BLOCK_M=BLOCK_M, BLOCK_N=config.block_n,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch_options(x.device),
    )
    return out
