"""Triton rotary embedding + KV cache write: one kernel from a layer's fused QKV projection to the
rotated queries and the paged cache (instead of a split, two rotations and two scatters).

One program per token: it rotates the token's query heads into `q`, and its key heads (rotated)
and value heads into the cache slot `slot_mapping` names. `rope_and_write_kv_reference` is the
same in PyTorch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import pdl
from engine.attention import write_kv
from engine.llama import ModelShape, apply_rope


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
    qkv_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
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
    d = tl.arange(0, BLOCK_HALF)[None, :]
    d_ok = d < HALF
    cos1 = tl.load(cos_ptr + token * stride_cos + d, mask=d_ok, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + token * stride_cos + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + token * stride_sin + d, mask=d_ok, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + token * stride_sin + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
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
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
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
    assert cos.shape == sin.shape == (num_tokens, head_dim) and cos.stride(1) == sin.stride(1) == 1
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (kv_heads, head_dim)
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    assert qkv.dtype == k_cache.dtype == v_cache.dtype
    assert slot_mapping.shape == (num_tokens,)
    q = torch.empty((num_tokens, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    _rope_write_kv_kernel[(num_tokens,)](
        qkv, cos, sin, slot_mapping, q, k_cache, v_cache,
        qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), kv_heads * head_dim,
        NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_KVH=triton.next_power_of_2(kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4, **pdl.launch_options(qkv.device),
    )
    return q


def rope_and_write_kv_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, slot_mapping: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """`rope_and_write_kv` in PyTorch ops."""
    q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = apply_rope(q.view(-1, shape.num_heads, shape.head_dim), cos, sin)
    k = apply_rope(k.view(-1, shape.num_kv_heads, shape.head_dim), cos, sin)
    write_kv(k, v.view(-1, shape.num_kv_heads, shape.head_dim), k_cache, v_cache, slot_mapping)
    return q
