"""Triton products of quantized weights for one row a program, without tensor cores (GEMV).

The skinny linear (engine/triton_linear.py) multiplies a tile of rows with tensor-core dots, which
needs each weight tile widened and moved into the dot's register layout; for int8 that holds a
Llama-3.2-1B gate/up projection to 12.8 us at one row, for int4 to 18 (bench/results/tune_linear_int4.json),
well short of their bytes. Here a program takes one row of x and a BLOCK_N-column strip of W: each
weight becomes a float32 by bit tricks (a byte or nibble u or'ed into the mantissa of 2^23 is the float
2^23 + u, exactly; subtracting the offset gives the signed value), is multiplied by x's element into a
[BLOCK_N, BLOCK_K] float32 accumulator, which is summed over K once at the end. So a row's result never
depends on the other rows (each is a program of its own), and the weights of a strip are read from
memory once: the programs of the rows that share it run together and meet in L2.

  int8   W [N, K] int8, one scale a column (engine/linear.Int8Linear)
  int4   W [N, K / 2] uint8 nibbles with scales [N, K / G] (engine/linear.Int4Linear,
         engine/triton_int4.py's format): a K step multiplies the low nibbles with x[j] and the high
         ones with x[j + K / 2]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine import pdl

TWO_23 = tl.constexpr(8388608.0)  # 2^23: or'ed into its mantissa, u in [0, 2^23) reads as 2^23 + u


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int  # weight bytes a row a K step
    num_warps: int
    num_stages: int


def gemv_launch_config(n: int, k: int, int4: bool) -> GemvConfig:
    return GemvConfig(block_n=16, block_k=128, num_warps=4, num_stages=4)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr, N, K, stride_xm, stride_wn, stride_sn, stride_om,
    INT4: tl.constexpr,
    GROUP: tl.constexpr,  # int4's quantization group (a multiple of BLOCK_K)
    SILU_MUL: tl.constexpr,
    EVEN_N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # engine/pdl.py: wait for the previous kernel before any load or store
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    offs = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * stride_xm
    w_cols = w_ptr + cols[:, None].to(tl.int64) * stride_wn
    s_cols = scale_ptr + cols.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    width = K // 2 if INT4 else K  # weight bytes a row
    for j0 in range(0, width, BLOCK_K):
        j = j0 + offs
        if EVEN_N:
            w = tl.load(w_cols + j[None, :])
        else:
            w = tl.load(w_cols + j[None, :], mask=col_ok[:, None], other=0)
        x = tl.load(x_row + j).to(tl.float32)
        if INT4:
            x_hi = tl.load(x_row + width + j).to(tl.float32)
            s_lo = tl.load(s_cols + j0 // GROUP, mask=col_ok, other=0.0).to(tl.float32)
            s_hi = tl.load(s_cols + (j0 + width) // GROUP, mask=col_ok, other=0.0).to(tl.float32)
            lo = (((w & 15).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - (TWO_23 + 8.0))
            hi = (((w >> 4).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - (TWO_23 + 8.0))
            acc += lo * s_lo[:, None] * x[None, :] + hi * s_hi[:, None] * x_hi[None, :]
        else:  # int8: its two's complement byte plus 128 is u in [0, 256)
            u = (w.to(tl.uint8, bitcast=True) ^ 0x80).to(tl.int32)
            acc += ((u | 0x4B000000).to(tl.float32, bitcast=True) - (TWO_23 + 128.0)) * x[None, :]
    y = tl.sum(acc, axis=1)  # [BLOCK_N]
    if not INT4:
        y *= tl.load(s_cols, mask=col_ok, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    if SILU_MUL:  # columns (2j, 2j + 1) are (gate_j, up_j); each op rounded like PyTorch's
        gate, up = tl.split(tl.reshape(y.to(dtype).to(tl.float32), [BLOCK_N // 2, 2]))
        y = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
        cols = tl.program_id(1) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        col_ok = cols < N // 2
    tl.store(out_ptr + row * stride_om + cols, y.to(out_ptr.dtype.element_ty), mask=col_ok)


def gemv(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # int8 [N, K], or uint8 [N, K / 2] (int4)
    scale: torch.Tensor,  # int8: [N]; int4: [N, K / G]
    *,
    silu_mul: bool = False,
    out_dtype: torch.dtype | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:  # [M, N] ([M, N / 2] with silu_mul)
    """Asserting host wrapper (module doc)."""
    assert x.dim() == 2 and weight.dim() == 2 and x.stride(1) == 1 and weight.stride(1) == 1
    m, k = x.shape
    n = weight.shape[0]
    int4 = weight.dtype == torch.uint8
    if int4:
        assert weight.shape[1] * 2 == k and scale.dim() == 2 and scale.shape[0] == n and k % scale.shape[1] == 0, \
            f"int4 weights {tuple(weight.shape)}, scales {tuple(scale.shape)} for x {tuple(x.shape)}"
        group = k // scale.shape[1]
    else:
        assert weight.dtype == torch.int8 and weight.shape[1] == k and scale.shape == (n,), \
            f"int8 weights {tuple(weight.shape)}, scales {tuple(scale.shape)} for x {tuple(x.shape)}"
        group = k
    assert scale.stride(-1) == 1 and x.device == weight.device == scale.device
    config = config or gemv_launch_config(n, k, int4)
    width = weight.shape[1]
    assert width % config.block_k == 0 and group % config.block_k == 0, \
        f"K step {config.block_k} must divide the {width} weight bytes a row (and the group {group})"
    assert not silu_mul or (config.block_n % 2 == 0 and n % 2 == 0), "silu_mul needs gate/up row pairs"
    out = torch.empty((m, n // 2 if silu_mul else n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    _gemv_kernel[(m, triton.cdiv(n, config.block_n))](
        x, weight, scale, out, n, k, x.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
        INT4=int4, GROUP=group, SILU_MUL=silu_mul, EVEN_N=n % config.block_n == 0, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch_options(x.device),
    )
    return out
