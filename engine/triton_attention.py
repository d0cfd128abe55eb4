"""Triton paged attention: varlen queries (decode, verify, prefill chunks) against the block-table
KV cache, grouped-query, causal with each sequence's queries sitting at the end of its context.

One program handles one sequence, one KV head and a tile of BLOCK_Q query tokens; its rows are
(query token, query head of the group) pairs, so each K/V tile is loaded once for the whole
group. The loop runs over BLOCK_N keys at a time (gathered across pages through the block
table, so tiles stay large whatever the page size) with an online softmax (flash attention).
The plain-PyTorch reference is `engine.attention.paged_attention_reference`.

A decode at small batch has too few (sequence, head) tiles to fill the GPU, so each tile's keys
are split into ranges (flash decoding), each with its own partial softmax, which `combine_splits`
merges in order. Two ways to cut them:

* `split_len=None`: as many ranges per tile as fill the GPU (up to 16), as long as the context
  needs: the fastest, but a token's ranges (and so its rounding) depend on its batch and step.
* `split_len=n` (one constant per engine, `split_len_for(max_model_len)`): ranges of n keys fixed
  by position. How many programs share a tile's ranges still changes with the batch, but each
  range is computed alike whichever program takes it, so a token's attention is the same bits in a
  decode, a verify, a padded graph step or any batch around it: with the row-independent fused
  layer kernels (engine/fused_stages.py) this keeps bf16 speculative output equal to target-only
  output. It costs partial results and a combine at every context (bench/tune_attention.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine import pdl
from engine.batch import ForwardBatch


@triton.jit
def attention_tile(
    seq, kv_head, q_tile, run,  # which (sequence, KV head, query tile) and which run of its key ranges
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
    scale,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    stride_ps, stride_pt, stride_ph,  # partial outputs [splits, T, H, D] (and lse [splits, T, H] / D)
    SPLIT_LEN: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PROGRAMS: tl.constexpr,  # programs per (sequence, head, query tile), each a run of its key ranges
    DIRECT: tl.constexpr,  # one key range is all there can be: write the output, not a partial
):
    """One program's work: the kernel's, and a stage of engine/triton_layer.py's layer kernel."""
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
        # keys past this tile's last query are masked anyway: do not read them
        last_q = tl.minimum((q_tile + 1) * BLOCK_Q, num_q) - 1
        num_keys = context_len - num_q + last_q + 1
        offs = tl.arange(0, BLOCK_N)
        row_d_valid = row_valid[:, None] & d_valid[None, :]
        if SPLIT_LEN > 0:  # fixed ranges: the same for this token in any step
            split_len = SPLIT_LEN
        else:  # one range per program, as many as fill the GPU: depends on the batch
            split_len = tl.cdiv(tl.cdiv(num_keys, PROGRAMS), BLOCK_N) * BLOCK_N
        # this program's share of the tile's key ranges: a contiguous run, in one pipelined loop
        num_ranges = tl.cdiv(num_keys, split_len)
        per_program = tl.cdiv(num_ranges, PROGRAMS)
        k_begin = run * per_program * split_len
        k_end = tl.minimum(num_keys, k_begin + per_program * split_len)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
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
            if not DIRECT:
                # a range ends here: store its partial result and log-sum-exp (-inf: no key visible;
                # `combine_splits` merges them), and start the next from nothing, as if a fresh program
                range_done = ((start + BLOCK_N) % split_len == 0) | (start + BLOCK_N >= k_end)
                part = (start // split_len) * stride_ps + (q_start + q_idx) * stride_pt + head * stride_ph
                tl.store(part_out_ptr + part[:, None] + d[None, :], acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None],
                         mask=tl.where(range_done, row_d_valid, False))
                lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
                tl.store(part_lse_ptr + part // stride_ph, lse, mask=tl.where(range_done, row_valid, False))
                m_i = tl.where(range_done, float("-inf"), m_i)
                l_i = tl.where(range_done, 0.0, l_i)
                acc = tl.where(range_done, 0.0, acc)
        if SPLIT_LEN == 0 and not DIRECT and run >= num_ranges:  # the combine reads every program's slot
            part = run * stride_ps + (q_start + q_idx) * stride_pt + head * stride_ph
            tl.store(part_lse_ptr + part // stride_ph, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_valid)
        if DIRECT:  # the only range there can be: the output itself
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + (q_start + q_idx)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_d_valid)


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
    stride_ps, stride_pt, stride_ph,
    SPLIT_LEN: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PROGRAMS: tl.constexpr,
    DIRECT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # engine/pdl.py
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    attention_tile(
        tl.program_id(0), tl.program_id(1), tl.program_id(2) // PROGRAMS, tl.program_id(2) % PROGRAMS,
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
        block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr, scale, stride_qt, stride_qh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_ot, stride_oh, stride_bt,
        stride_ps, stride_pt, stride_ph, SPLIT_LEN, GROUP, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, BLOCK_Q, BLOCK_M,
        DOT_PRECISION, PROGRAMS, DIRECT,
    )


SPLIT_LEN = 128  # keys per range at most contexts (`split_len_for`); one BLOCK_N tile
MAX_SPLITS = 64  # ranges a context may have: bounds the partial buffers of a step
# The fewest query tokens per tile for a step. 8 would give decode (1 query) and verify (k + 1) the
# same tile shape, in case a row's sums followed it; they do not (bf16 decode vs verify is bit-equal
# on the H200 with tiles by query count, tests/engine), and 8 costs a decode 2 us a layer.
STEP_BLOCK_Q = 1
MAX_FILL_SPLITS = 16  # with split_len None: ranges per tile at most
# Keys a loop step: the best of bench/tune_attention.py's sweeps on the H200, for fixed ranges (decode and
# verify) and for a draft's ranges that fill the GPU alike. Shorter steps cut a short context into more
# ranges (a range is a whole number of steps), and a 1B draft at a 192-token context gained (32 keys:
# decode replay 0.756 ms against 0.770, attention 5.0 us against 5.9), but they lose at long contexts and
# in batches: 15.7 against 9.1 us at one 4096-token context, 66 against 34 at 8, 35 against 19 at 32
# sequences of 768 (bench/results/gpu_draft_forward_attn_launch.json, tune_attention_draft.json).
BLOCK_N = 128
COMBINE_BLOCK_S = 16  # ranges the combine loads at once (a fixed number: the sum's order must not vary)


@dataclass(frozen=True)
class AttentionPlan:
    """How a step's attention is cut into programs (the kernel's grid, and the layer kernel's tiles)."""

    group: int  # query heads a KV head
    block_q: int  # query tokens a tile
    block_m: int  # a tile's rows: (query token, query head) pairs, padded
    q_tiles: int  # query tiles a sequence
    programs: int  # programs (runs of key ranges) a (sequence, KV head, query tile)
    max_splits: int  # key ranges a tile may have: partial results' slots (1: the output written directly)

    @classmethod
    def of(cls, q: torch.Tensor, k_cache: torch.Tensor, batch: ForwardBatch, split_len: int | None,
           programs_per_tile: int | None = None) -> AttentionPlan:
        num_heads, num_kv_heads, block_size = q.shape[1], k_cache.shape[2], k_cache.shape[1]
        group = num_heads // num_kv_heads
        # queries per tile: as many as the step's longest query run (at least STEP_BLOCK_Q), as many as fit
        block_q = max(1, min(max(STEP_BLOCK_Q, triton.next_power_of_2(batch.max_num_q)), 64 // group))
        q_tiles = triton.cdiv(batch.max_num_q, block_q)
        num_tiles = batch.num_sequences * num_kv_heads * q_tiles
        if split_len is None:  # a range per program
            max_splits = programs = programs_per_tile or _programs_per_tile(num_tiles, MAX_FILL_SPLITS, q.device)
        else:  # the block tables are as wide as the longest context may grow: that many ranges at most
            max_splits = triton.cdiv(batch.block_tables.shape[1] * block_size, split_len)
            programs = programs_per_tile or _programs_per_tile(num_tiles, max_splits, q.device)
        return cls(group, block_q, max(16, triton.next_power_of_2(block_q * group)), q_tiles, programs, max_splits)

    def partials(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each key range's output and log-sum-exp (placeholders where the output is written directly)."""
        if self.max_splits == 1:  # the kernel never touches them
            part = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=q.device)
            return part, part
        part_out = torch.empty((self.max_splits, *q.shape), dtype=torch.float32, device=q.device)
        return part_out, torch.empty(part_out.shape[:3], dtype=torch.float32, device=q.device)


def split_len_for(max_model_len: int) -> int:
    """Keys per range for an engine: the default, or longer where a context would need more ranges."""
    return max(SPLIT_LEN, triton.next_power_of_2(triton.cdiv(max_model_len, MAX_SPLITS)))


def paged_attention_triton(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    batch: ForwardBatch,
    scale: float,
    block_n: int = BLOCK_N,
    num_warps: int = 4,
    num_stages: int = 3,
    split_len: int | None = None,  # keys per range, one constant per engine; None: fill the GPU (see the module doc)
    programs_per_tile: int | None = None,  # None: enough to fill the GPU; never changes the result
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Asserting host wrapper: every shape, dtype and stride is checked before launch."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert k_cache.shape == v_cache.shape, "K and V caches differ in shape"
    assert q.dtype == k_cache.dtype == v_cache.dtype, "q and caches must share a dtype"
    assert cache_head_dim == head_dim, f"head_dim {head_dim} vs cache {cache_head_dim}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads not a multiple of {num_kv_heads} KV heads"
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1, "head_dim must be contiguous"
    assert split_len is None or split_len % block_n == 0, f"split_len {split_len} is not a multiple of {block_n}"
    num_seqs = batch.context_lens.shape[0]
    assert batch.cu_seqlens_q_t.shape == (num_seqs + 1,) and batch.cu_seqlens_q_t.dtype == torch.int32
    assert batch.context_lens.dtype == torch.int32 and batch.block_tables.dtype == torch.int32
    assert batch.block_tables.shape[0] == num_seqs and batch.block_tables.stride(1) == 1
    assert batch.cu_seqlens_q[-1] == num_tokens, "cu_seqlens_q does not cover q"
    assert batch.positions.shape == (num_tokens,)
    plan = AttentionPlan.of(q, k_cache, batch, split_len, programs_per_tile)
    out = torch.empty_like(q)
    part_out, part_lse = plan.partials(q)
    _paged_attention_kernel[(num_seqs, num_kv_heads, plan.q_tiles * plan.programs)](
        q, k_cache, v_cache, out, part_out, part_lse,
        batch.block_tables, batch.cu_seqlens_q_t, batch.context_lens,
        scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        batch.block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        SPLIT_LEN=split_len or 0, GROUP=plan.group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_N=block_n, BLOCK_Q=plan.block_q, BLOCK_M=plan.block_m,
        # float32 models stay exact float32 (no TF32), so greedy output matches the reference
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        PROGRAMS=plan.programs, DIRECT=plan.max_splits == 1,
        num_warps=num_warps, num_stages=num_stages, **pdl.launch_options(q.device),
    )
    return out if plan.max_splits == 1 else combine_splits(part_out, part_lse, batch.positions, split_len or 0, out)


@triton.jit
def combine_tile(
    token, head, part_out_ptr, part_lse_ptr, positions_ptr, out_ptr, stride_ps, stride_pt, stride_ph, stride_ot,
    stride_oh, SPLIT_LEN: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # out = sum_s exp(lse_s - lse) * out_s / sum_s exp(lse_s - lse), lse = max_s lse_s, for one (token,
    # head), over the ranges up to the token's own position (the kernel wrote those; later slots may
    # be stale), BLOCK_S ranges at a time in range order
    if SPLIT_LEN > 0:
        num_splits = tl.minimum(tl.load(positions_ptr + token) // SPLIT_LEN + 1, NUM_SPLITS)
    else:  # a slot per program, each written
        num_splits = NUM_SPLITS
    base = token * stride_pt + head * stride_ph
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    max_lse = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
    for first in range(0, num_splits, BLOCK_S):
        lse = tl.load(part_lse_ptr + (base + (first + s) * stride_ps) // stride_ph, mask=first + s < num_splits,
                      other=float("-inf"))
        max_lse = tl.maximum(max_lse, lse)
    top = tl.max(max_lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    total = tl.zeros([1], dtype=tl.float32)
    for first in range(0, num_splits, BLOCK_S):
        valid = first + s < num_splits
        lse = tl.load(part_lse_ptr + (base + (first + s) * stride_ps) // stride_ph, mask=valid, other=float("-inf"))
        weights = tl.exp(lse - top)
        seen = valid & (lse > float("-inf"))  # a range that saw no key may have left its output unwritten
        parts = tl.load(part_out_ptr + base + (first + s)[:, None] * stride_ps + d[None, :],
                        mask=seen[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
        acc += tl.sum(weights[:, None] * parts, axis=0)
        total += tl.sum(weights, axis=0)
    out = acc / tl.maximum(total, 1e-30)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def _combine_splits_kernel(
    part_out_ptr, part_lse_ptr, positions_ptr, out_ptr, stride_ps, stride_pt, stride_ph, stride_ot, stride_oh,
    SPLIT_LEN: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:  # engine/pdl.py
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    combine_tile(tl.program_id(0), tl.program_id(1), part_out_ptr, part_lse_ptr, positions_ptr, out_ptr, stride_ps,
                 stride_pt, stride_ph, stride_ot, stride_oh, SPLIT_LEN, NUM_SPLITS, BLOCK_S, HEAD_DIM, BLOCK_D)


def combine_splits(
    part_out: torch.Tensor,  # [splits, T, H, D] each range's softmax-normalized output
    part_lse: torch.Tensor,  # [splits, T, H] each range's log-sum-exp (-inf: the range saw no key)
    positions: torch.Tensor,  # [T] each token's position: it reads ranges 0 .. position // split_len
    split_len: int,  # 0: every slot (a range per program)
    out: torch.Tensor,  # [T, H, D] written
) -> torch.Tensor:
    splits, num_tokens, num_heads, head_dim = part_out.shape
    assert part_out.is_contiguous() and part_lse.is_contiguous() and part_lse.shape == part_out.shape[:3]
    assert out.shape == part_out.shape[1:] and out.stride(-1) == 1 and positions.shape == (num_tokens,)
    _combine_splits_kernel[(num_tokens, num_heads)](
        part_out, part_lse, positions, out, part_out.stride(0), part_out.stride(1), part_out.stride(2),
        out.stride(0), out.stride(1),
        SPLIT_LEN=split_len, NUM_SPLITS=splits, BLOCK_S=COMBINE_BLOCK_S, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), **pdl.launch_options(out.device),
    )
    return out


def _programs_per_tile(num_tiles: int, max_splits: int, device: torch.device) -> int:
    """About two programs per SM (a decode at small batch has few tiles); one on the CPU interpreter."""
    if device.type != "cuda":
        return 1
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(max_splits, target // num_tiles))
