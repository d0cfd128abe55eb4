"""Triton rotary embedding + KV cache write: one kernel from a layer's fused QKV projection to the
rotated queries and the paged cache (instead of a split, two rotations and two scatters).

One program per token: it rotates the token's query heads into `q`, and its key heads (rotated)
and value heads into the cache slot `slot_mapping` names. Both kernels read the model's cos/sin
tables at each token's position themselves (no gathered copy: two PyTorch index kernels a forward
fewer, which also sat between PDL launches). `rope_and_write_kv_reference` is the same in PyTorch.

`qkv_rope_and_write_kv` goes one kernel further: the QKV product itself (the skinny linear's
strip product, engine/triton_linear.py) with the rotation and the cache write in its epilogue, so
the QKV activations never reach memory. A program's strip of W pairs each query or key dimension
p with its rotation partner p + D/2 (rows gathered, not a re-laid-out weight), so the rotation has
both halves in its tile; value strips are stored as they are. Its rounding is the two kernels'
(the product rounded to the activations' dtype, then rotated in float32), so the results are the
same values. engine/fused_stages.QKV_ROPE turns it on (the draft service's default).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import pdl
from engine.attention import write_kv
from engine.llama import ModelShape, apply_rope
from engine.triton_linear import LaunchConfig, launch_config, strip_product
from engine.triton_prefetch import prefetch_options, prefetch_strip


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, dst_head_stride, cos1, sin1, cos2, sin2,
                  NUM: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NUM) & (d < HALF)
    x1 = tl.load(src_ptr + heads * HEAD_DIM + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + heads * HEAD_DIM + HALF + d, mask=mask, other=0.0).to(tl.float32)
    dtype = dst_ptr.dtype.element_ty
    tl.store(dst_ptr + heads * dst_head_stride + d, (x1 * cos1 - x2 * sin1).to(dtype), mask=mask)
    tl.store(dst_ptr + heads * dst_head_stride + HALF + d, (x2 * cos2 + x1 * sin2).to(dtype), mask=mask)


@triton.jit
def _rope_write_kv_kernel(
    qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    stride_qkv, stride_cos, stride_sin, stride_q, stride_slot,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # engine/pdl.py
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    HALF: tl.constexpr = HEAD_DIM // 2
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)  # the token's row of the tables
    d = tl.arange(0, BLOCK_HALF)[None, :]
    d_ok = d < HALF
    cos1 = tl.load(cos_ptr + pos * stride_cos + d, mask=d_ok, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + pos * stride_cos + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + pos * stride_sin + d, mask=d_ok, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + pos * stride_sin + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
    row = qkv_ptr + token * stride_qkv
    slot = tl.load(slot_ptr + token).to(tl.int64)
    _rotate_heads(row, q_ptr + token * stride_q, HEAD_DIM, cos1, sin1, cos2, sin2,
                  NUM_HEADS, BLOCK_H, HEAD_DIM, HALF, BLOCK_HALF)
    _rotate_heads(row + NUM_HEADS * HEAD_DIM, k_cache_ptr + slot * stride_slot, HEAD_DIM, cos1, sin1, cos2, sin2,
                  NUM_KV_HEADS, BLOCK_KVH, HEAD_DIM, HALF, BLOCK_HALF)
    heads = tl.arange(0, BLOCK_KVH)[:, None]
    dv = tl.arange(0, BLOCK_D)[None, :]
    v_mask = (heads < NUM_KV_HEADS) & (dv < HEAD_DIM)
    v = tl.load(row + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + heads * HEAD_DIM + dv, mask=v_mask, other=0.0)
    tl.store(v_cache_ptr + slot * stride_slot + heads * HEAD_DIM + dv, v, mask=v_mask)


def rope_and_write_kv(
    qkv: torch.Tensor,  # [T, (H + 2 * KVH) * D] a layer's fused QKV projection
    cos: torch.Tensor,  # [max_positions, D] the model's table
    sin: torch.Tensor,  # [max_positions, D]
    positions: torch.Tensor,  # [T] each token's row of the tables
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    slot_mapping: torch.Tensor,  # [T] flat slot per token
    shape: ModelShape,
) -> torch.Tensor:  # [T, H, D] rotated queries
    """Asserting host wrapper: every shape, dtype and stride is checked before launch."""
    num_tokens = qkv.shape[0]
    heads, kv_heads, head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
    assert qkv.shape == (num_tokens, (heads + 2 * kv_heads) * head_dim) and qkv.stride(1) == 1
    assert head_dim % 2 == 0, "rotary embedding needs an even head_dim"
    _check_tables(cos, sin, positions, num_tokens, head_dim)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (kv_heads, head_dim)
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    assert qkv.dtype == k_cache.dtype == v_cache.dtype
    assert slot_mapping.shape == (num_tokens,)
    q = torch.empty((num_tokens, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    _rope_write_kv_kernel[(num_tokens,)](
        qkv, cos, sin, positions, slot_mapping, q, k_cache, v_cache,
        qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), kv_heads * head_dim,
        NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_KVH=triton.next_power_of_2(kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4, **pdl.launch_options(qkv.device),
    )
    return q


def rope_and_write_kv_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                                k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                                shape: ModelShape) -> torch.Tensor:
    """`rope_and_write_kv` in PyTorch ops."""
    cos, sin = cos[positions], sin[positions]
    q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = apply_rope(q.view(-1, shape.num_heads, shape.head_dim), cos, sin)
    k = apply_rope(k.view(-1, shape.num_kv_heads, shape.head_dim), cos, sin)
    write_kv(k, v.view(-1, shape.num_kv_heads, shape.head_dim), k_cache, v_cache, slot_mapping)
    return q


def _check_tables(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, num_tokens: int, head_dim: int) -> None:
    assert cos.shape == sin.shape and cos.shape[1] == head_dim and cos.stride(1) == sin.stride(1) == 1
    assert positions.shape == (num_tokens,) and not positions.is_floating_point()


@triton.jit
def qkv_rope_strip(
    row_tile, strip,
    x_ptr, w_ptr, bias_ptr, scale_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    M, K, stride_xm, stride_wn, stride_cos, stride_sin, stride_q, stride_slot,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    x_scale_ptr=None, A_INT8: tl.constexpr = False,
):
    """One (row tile, column strip): the kernel's program, and a stage of engine/triton_layer.py's.
    `A_INT8`: x int8 with a float32 scale a row at `x_scale_ptr` (W8A8)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    PAIRS: tl.constexpr = BLOCK_N // 2
    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    col0 = strip * BLOCK_N  # the strip's first column of the QKV output; one head's
    head = col0 // HEAD_DIM  # of the H query, KVH key and KVH value heads, in that order
    offset = col0 % HEAD_DIM
    j = tl.arange(0, BLOCK_N)
    rotated = head < NUM_HEADS + NUM_KV_HEADS
    pair = offset // 2 + j // 2  # a rotated strip: columns (p, p + HALF) side by side
    w_rows = tl.where(rotated, head * HEAD_DIM + pair + (j % 2) * HALF, col0 + j)
    acc = strip_product(x_ptr, w_ptr, rows, w_rows, row_ok, j < BLOCK_N, K, stride_xm, stride_wn, 0, K,
                        HAS_SCALE, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, A_INT8)
    if A_INT8:
        acc *= tl.load(x_scale_ptr + rows, mask=row_ok, other=0.0)[:, None]
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + w_rows).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + w_rows).to(tl.float32)[None, :]
    dtype = q_ptr.dtype.element_ty
    y = acc.to(dtype)  # the QKV product's own rounding
    slot = tl.load(slot_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    if rotated:
        x1, x2 = tl.split(tl.reshape(y.to(tl.float32), [BLOCK_M, PAIRS, 2]))
        p = offset // 2 + tl.arange(0, PAIRS)[None, :]
        r = rows[:, None].to(tl.int64)
        pos = tl.load(pos_ptr + r, mask=row_ok[:, None], other=0).to(tl.int64)  # each row's table row
        mask = row_ok[:, None] & (p < HALF)
        cos1 = tl.load(cos_ptr + pos * stride_cos + p, mask=mask, other=0.0).to(tl.float32)
        cos2 = tl.load(cos_ptr + pos * stride_cos + HALF + p, mask=mask, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptr + pos * stride_sin + p, mask=mask, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + pos * stride_sin + HALF + p, mask=mask, other=0.0).to(tl.float32)
        out1 = (x1 * cos1 - x2 * sin1).to(dtype)
        out2 = (x2 * cos2 + x1 * sin2).to(dtype)
        if head < NUM_HEADS:
            dst = q_ptr + r * stride_q + head * HEAD_DIM + p
        else:
            dst = k_cache_ptr + slot[:, None] * stride_slot + (head - NUM_HEADS) * HEAD_DIM + p
        tl.store(dst, out1, mask=mask)
        tl.store(dst + HALF, out2, mask=mask)
    else:
        value_head = head - NUM_HEADS - NUM_KV_HEADS
        v_dst = v_cache_ptr + slot[:, None] * stride_slot + value_head * HEAD_DIM + offset + j[None, :]
        tl.store(v_dst, y, mask=row_ok[:, None])  # (a name of its own: a branch's names keep one shape)


@triton.jit
def _qkv_rope_write_kv_kernel(
    x_ptr, w_ptr, bias_ptr, scale_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    M, K, stride_xm, stride_wn, stride_cos, stride_sin, stride_q, stride_slot,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr, x_scale_ptr, A_INT8: tl.constexpr, PREFETCH_LINES: tl.constexpr = 0,
    LINE_ELEMS: tl.constexpr = 128,
):
    if USE_PDL:  # engine/pdl.py
        if PREFETCH_LINES > 0:  # the strip's first weights before the wait (engine/triton_prefetch.py)
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            prefetch_strip(w_ptr, cols, cols >= 0, 0, K, stride_wn, PREFETCH_LINES, LINE_ELEMS)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    qkv_rope_strip(tl.program_id(0), tl.program_id(1), x_ptr, w_ptr, bias_ptr, scale_ptr, cos_ptr, sin_ptr, pos_ptr,
                   slot_ptr, q_ptr, k_cache_ptr, v_cache_ptr, M, K, stride_xm, stride_wn, stride_cos, stride_sin,
                   stride_q, stride_slot, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HAS_BIAS, HAS_SCALE, EVEN_K, BLOCK_M,
                   BLOCK_N, BLOCK_K, DOT_PRECISION, x_scale_ptr, A_INT8)


def qkv_rope_block_n(weight: torch.Tensor, shape: ModelShape, int8: bool = False,
                     act_int8: bool = False) -> int | None:
    """The strip width the fused kernel would use for this QKV weight at a decode, or None where it
    cannot take it (a strip must lie within one head and hold whole rotation pairs)."""
    config = qkv_rope_config(weight, shape, int8, rows=1, act_int8=act_int8)
    return None if config is None else config.block_n


def qkv_rope_config(weight: torch.Tensor, shape: ModelShape, int8: bool, rows: int,
                    act_int8: bool = False) -> LaunchConfig | None:
    """The product's configuration for `rows` rows (engine/triton_linear.launch_config) if its strips fit
    the heads, else a decode's if those do, else None."""
    for r in (rows, 1):
        config = launch_config(weight.shape[0], weight.shape[1], int8=int8, rows=r, act_int8=act_int8)
        if config.split_k == 1 and shape.head_dim % config.block_n == 0:
            return config
    return None


def qkv_rope_and_write_kv(
    x: torch.Tensor,  # [T, hidden] the normed hidden states
    weight: torch.Tensor,  # [(H + 2 * KVH) * D, hidden] the fused QKV projection (int8 with `scale`)
    bias: torch.Tensor | None,  # [(H + 2 * KVH) * D]
    cos: torch.Tensor,  # [max_positions, D] the model's table
    sin: torch.Tensor,  # [max_positions, D]
    positions: torch.Tensor,  # [T] each token's row of the tables
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    slot_mapping: torch.Tensor,  # [T] flat slot per token
    shape: ModelShape,
    *,
    scale: torch.Tensor | None = None,  # [(H + 2 * KVH) * D] int8 rows' scales
    x_scale: torch.Tensor | None = None,  # [T] float32: x is int8 rows too (W8A8)
) -> torch.Tensor:  # [T, H, D] rotated queries
    """`rope_and_write_kv(skinny_linear(x, weight, bias, scale=scale, x_scale=x_scale), ...)` in one kernel
    (see the module doc). Asserting host wrapper."""
    num_tokens, hidden = x.shape
    heads, kv_heads, head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
    n = (heads + 2 * kv_heads) * head_dim
    assert weight.shape == (n, hidden) and x.stride(1) == 1 and weight.stride(1) == 1
    assert (scale is None and weight.dtype == x.dtype) or (weight.dtype == torch.int8 and scale.shape == (n,))
    assert (x.dtype == torch.int8) == (x_scale is not None) and (x_scale is None or scale is not None)
    dtype = k_cache.dtype  # the activations' (x's, unless x is int8)
    assert bias is None or bias.shape == (n,)
    _check_tables(cos, sin, positions, num_tokens, head_dim)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (kv_heads, head_dim)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and (x_scale is not None or dtype == x.dtype)
    assert slot_mapping.shape == (num_tokens,)
    config = qkv_rope_config(weight, shape, scale is not None, rows=num_tokens, act_int8=x_scale is not None)
    assert config is not None, f"head_dim {head_dim} does not take the fused QKV kernel's strips"
    q = torch.empty((num_tokens, heads, head_dim), dtype=dtype, device=x.device)
    if num_tokens == 0:
        return q
    options = pdl.launch_options(x.device)
    _qkv_rope_write_kv_kernel[(triton.cdiv(num_tokens, config.block_m), n // config.block_n)](
        x, weight, bias if bias is not None else x, scale if scale is not None else x,
        cos, sin, positions, slot_mapping, q, k_cache, v_cache,
        num_tokens, hidden, x.stride(0), weight.stride(0), cos.stride(0), sin.stride(0), q.stride(0),
        kv_heads * head_dim,
        NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        HAS_BIAS=bias is not None, HAS_SCALE=scale is not None, EVEN_K=hidden % config.block_k == 0,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages, **options,
        x_scale_ptr=x_scale if x_scale is not None else x, A_INT8=x_scale is not None,
        **prefetch_options(config.block_n, hidden, weight.element_size(), options["USE_PDL"]),
    )
    return q
