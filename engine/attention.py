"""Attention over the paged KV cache: the plain-PyTorch reference backend (serves CPU)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.batch import ForwardBatch


def write_kv(
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] flat slot per token
) -> None:
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v


def paged_attention_reference(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Varlen causal attention: sequence i's queries sit at the end of its context."""
    num_heads, block_size, num_kv_heads = q.shape[1], k_cache.shape[1], k_cache.shape[2]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    out = torch.empty_like(q)
    for i, num_ctx in enumerate(batch.context_lens.tolist()):
        start, end = batch.cu_seqlens_q[i], batch.cu_seqlens_q[i + 1]
        num_q = end - start
        positions = torch.arange(num_ctx, device=q.device)
        context_slots = batch.block_tables[i, positions // block_size].long() * block_size + positions % block_size
        qi = q[start:end].transpose(0, 1)  # [H, num_q, D]
        ki = flat_k[context_slots].transpose(0, 1)  # [KVH, num_ctx, D]
        vi = flat_v[context_slots].transpose(0, 1)
        ki = ki.repeat_interleave(num_heads // num_kv_heads, dim=0)
        vi = vi.repeat_interleave(num_heads // num_kv_heads, dim=0)
        # query j is at absolute position num_ctx - num_q + j and sees keys up to there
        q_pos = torch.arange(num_ctx - num_q, num_ctx, device=q.device)[:, None]
        mask = torch.arange(num_ctx, device=q.device)[None, :] <= q_pos
        oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
        out[start:end] = oi.transpose(0, 1)
    return out
