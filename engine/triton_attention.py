"""Triton paged attention: varlen queries (decode, verify, prefill chunks) against the block-table
KV cache, grouped-query, causal with each sequence's queries sitting at the end of its context.

One program handles one sequence, one KV head and a tile of BLOCK_Q query tokens; its rows are
(query token, query head of the group) pairs, so each K/V tile is loaded once for the whole
group. The loop runs over BLOCK_N keys at a time (gathered across pages through the block
table, so tiles stay large whatever the page size) with an online softmax (flash attention).
The plain-PyTorch reference is `engine.attention.paged_attention_reference`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.batch import ForwardBatch


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
    scale,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    num_q = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q < num_q:
        context_len = tl.load(context_lens_ptr + seq)
        rows = tl.arange(0, BLOCK_M)
        q_idx = q_tile * BLOCK_Q + rows // GROUP  # query token within the sequence
        head = kv_head * GROUP + rows % GROUP
        row_valid = (rows < BLOCK_Q * GROUP) & (q_idx < num_q)
        q_pos = context_len - num_q + q_idx  # absolute position of each row's query
        d = tl.arange(0, BLOCK_D)
        d_valid = d < HEAD_DIM
        q = tl.load(
            q_ptr + (q_start + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=row_valid[:, None] & d_valid[None, :], other=0.0,
        )
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # keys past this tile's last query are masked anyway: do not read them
        last_q = tl.minimum((q_tile + 1) * BLOCK_Q, num_q) - 1
        num_keys = context_len - num_q + last_q + 1
        offs = tl.arange(0, BLOCK_N)
        for start in range(0, num_keys, BLOCK_N):
            # BLOCK_N keys span several pages: gather each key's page from the block table
            k_pos = start + offs
            pos_valid = k_pos < num_keys
            block_ids = tl.load(block_tables_ptr + seq * stride_bt + k_pos // BLOCK_SIZE, mask=pos_valid, other=0)
            slot = block_ids.to(tl.int64) * stride_kb + (k_pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
            kv_valid = pos_valid[None, :] & d_valid[:, None]
            k_t = tl.load(k_cache_ptr + slot[None, :] + d[:, None], mask=kv_valid, other=0.0)  # [BLOCK_D, BLOCK_N]
            s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale  # [BLOCK_M, BLOCK_N]
            s = tl.where((k_pos[None, :] <= q_pos[:, None]) & row_valid[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            v_slot = block_ids.to(tl.int64) * stride_vb + (k_pos % BLOCK_SIZE) * stride_vs + kv_head * stride_vh
            v = tl.load(v_cache_ptr + v_slot[:, None] + d[None, :], mask=tl.trans(kv_valid), other=0.0)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + (q_start + q_idx)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :],
        )


def paged_attention_triton(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    batch: ForwardBatch,
    scale: float,
    block_n: int = 128,  # the best of bench/tune_attention.py's sweep on the H200 for decode and verify
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Asserting host wrapper: every shape, dtype and stride is checked before launch."""
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert k_cache.shape == v_cache.shape, "K and V caches differ in shape"
    assert q.dtype == k_cache.dtype == v_cache.dtype, "q and caches must share a dtype"
    assert cache_head_dim == head_dim, f"head_dim {head_dim} vs cache {cache_head_dim}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads not a multiple of {num_kv_heads} KV heads"
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1, "head_dim must be contiguous"
    num_seqs = batch.context_lens.shape[0]
    assert batch.cu_seqlens_q_t.shape == (num_seqs + 1,) and batch.cu_seqlens_q_t.dtype == torch.int32
    assert batch.context_lens.dtype == torch.int32 and batch.block_tables.dtype == torch.int32
    assert batch.block_tables.shape[0] == num_seqs and batch.block_tables.stride(1) == 1
    assert batch.cu_seqlens_q[-1] == num_tokens, "cu_seqlens_q does not cover q"
    group = num_heads // num_kv_heads
    block_q = max(1, min(triton.next_power_of_2(batch.max_num_q), 64 // group))
    block_m = max(16, triton.next_power_of_2(block_q * group))
    out = torch.empty_like(q)
    grid = (num_seqs, num_kv_heads, triton.cdiv(batch.max_num_q, block_q))
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out,
        batch.block_tables, batch.cu_seqlens_q_t, batch.context_lens,
        scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        batch.block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_N=block_n, BLOCK_Q=block_q, BLOCK_M=block_m,
        # float32 models stay exact float32 (no TF32), so greedy output matches the reference
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
