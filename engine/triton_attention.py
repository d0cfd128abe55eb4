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
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
    scale,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    stride_ps, stride_pt, stride_ph,  # partial outputs [splits, T, H, D] (and lse [splits, T, H] / D)
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
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
        # split-K: this program takes one of NUM_SPLITS contiguous key ranges (flash decoding)
        split_len = tl.cdiv(tl.cdiv(num_keys, NUM_SPLITS), BLOCK_N) * BLOCK_N
        k_begin = split * split_len
        k_end = tl.minimum(num_keys, k_begin + split_len)
        offs = tl.arange(0, BLOCK_N)
        for start in range(k_begin, k_end, BLOCK_N):
            # BLOCK_N keys span several pages: gather each key's page from the block table
            k_pos = start + offs
            pos_valid = k_pos < k_end
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
        row_d_valid = row_valid[:, None] & d_valid[None, :]
        if NUM_SPLITS == 1:
            tl.store(out_ptr + (q_start + q_idx)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_d_valid)
        else:  # partial result and its log-sum-exp; `combine_splits` merges them
            part = split * stride_ps + (q_start + q_idx) * stride_pt + head * stride_ph
            tl.store(part_out_ptr + part[:, None] + d[None, :], out, mask=row_d_valid)
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
            tl.store(part_lse_ptr + part // stride_ph, lse, mask=row_valid)


def paged_attention_triton(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    batch: ForwardBatch,
    scale: float,
    block_n: int = 128,  # the best of bench/tune_attention.py's sweep on the H200 for decode and verify
    num_warps: int = 4,
    num_stages: int = 3,
    num_splits: int | None = None,  # None: enough key splits to fill the GPU
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
    num_tiles = num_seqs * num_kv_heads * triton.cdiv(batch.max_num_q, block_q)
    splits = num_splits or _num_splits(num_tiles, q.device)
    if splits > 1:
        part_out = torch.empty((splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((splits, num_tokens, num_heads), dtype=torch.float32, device=q.device)
    else:  # the kernel writes `out` directly and never touches the partial buffers
        part_out = part_lse = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=q.device)
    grid = (num_seqs, num_kv_heads, triton.cdiv(batch.max_num_q, block_q) * splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, part_out, part_lse,
        batch.block_tables, batch.cu_seqlens_q_t, batch.context_lens,
        scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        batch.block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_N=block_n, BLOCK_Q=block_q, BLOCK_M=block_m,
        # float32 models stay exact float32 (no TF32), so greedy output matches the reference
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        NUM_SPLITS=splits,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out if splits == 1 else combine_splits(part_out, part_lse, out)


@triton.jit
def _combine_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, stride_ps, stride_pt, stride_ph, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # out = sum_s exp(lse_s - lse) * out_s with lse = log sum_s exp(lse_s), for one (token, head)
    token, head = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    base = s * stride_ps + token * stride_pt + head * stride_ph
    lse = tl.load(part_lse_ptr + base // stride_ph, mask=s < NUM_SPLITS, other=float("-inf"))
    max_lse = tl.max(lse, axis=0)
    weights = tl.exp(lse - tl.where(max_lse == float("-inf"), 0.0, max_lse))
    parts = tl.load(part_out_ptr + base[:, None] + d[None, :], mask=(s < NUM_SPLITS)[:, None] & (d < HEAD_DIM)[None, :],
                    other=0.0)
    out = tl.sum(weights[:, None] * parts, axis=0) / tl.maximum(tl.sum(weights, axis=0), 1e-30)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def combine_splits(
    part_out: torch.Tensor,  # [splits, T, H, D] each split's softmax-normalized output
    part_lse: torch.Tensor,  # [splits, T, H] each split's log-sum-exp (-inf: the split saw no key)
    out: torch.Tensor,  # [T, H, D] written
) -> torch.Tensor:
    splits, num_tokens, num_heads, head_dim = part_out.shape
    assert part_out.is_contiguous() and part_lse.is_contiguous() and part_lse.shape == part_out.shape[:3]
    assert out.shape == part_out.shape[1:] and out.stride(-1) == 1
    _combine_splits_kernel[(num_tokens, num_heads)](
        part_out, part_lse, out, part_out.stride(0), part_out.stride(1), part_out.stride(2),
        out.stride(0), out.stride(1),
        NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out


def _num_splits(num_tiles: int, device: torch.device) -> int:
    """Key splits so that about two programs per SM run (decode at small batch has too few)."""
    if device.type != "cuda":
        return 1
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(16, target // num_tiles))
