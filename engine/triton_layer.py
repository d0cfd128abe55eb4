"""A whole decoder layer as one persistent Triton kernel, for the draft's graph steps.

A 1B draft's decode step is a chain of ~135 small kernels (engine/fused_stages.py): on the H200 its
products stream their weights in about 0.3 ms, the chain takes 0.77, the rest being each kernel's
launch, ramp and drain (bench/results/gpu_draft_forward_bounds.json). Here a layer is one launch of
a grid that is resident all at once, which runs the layer's stages in turn, each over its tiles,
with a grid-wide barrier between two stages instead of a kernel boundary. On the H200 it is slower
than the chain (0.92 against 0.77 ms a 1B int8 decode: docs/benchmarks.md), so it is opt-in:

  0  x = rms_norm(hidden)                        (engine/triton_norm.rms_norm_row, a row a tile)
  1  q, K/V cache = rotary(x @ Wqkv)             (engine/triton_rope.qkv_rope_strip, a column strip)
  2  attention's key ranges                      (engine/triton_attention.attention_tile)
  3  their merge (without it where one range is all there is)   (triton_attention.combine_tile)
  4  mid = hidden + attn @ Wo                    (engine/triton_linear.product_tile)
  5  x = rms_norm(mid)
  6  act = silu_mul(x @ Wgate_up)
  7  out = mid + act @ Wdown                     (split along K where launch_config splits it)

The stages are the separate kernels' own code (their tile functions) with the same launch
configurations and attention cut, so a step's results are the same bits as the chain of kernels.
The barrier: each program counts itself in a counter (release) and spins until every program of
the grid has (acquire), as CUDA's cooperative grid sync does; the last program out zeroes the
counter for the next launch. A grid larger than can be resident at once would never pass it, so
the grid is what the compiled kernel's registers and shared memory let an SM hold (at most
PROGRAMS_PER_SM each). On CPU (the Triton interpreter runs programs one after another, and a
barrier would wait forever) each stage is a launch of its own: `staged=True`, also a GPU A/B.

Only where attention need not be batch-invariant (a draft's: --layer-kernels layer) and in the
fused stages' steps (engine/fused_stages.py: CUDA-graph steps).
"""
from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl

from engine import pdl
from engine.batch import ForwardBatch
from engine.linear import weight_and_scale
from engine.llama import DecoderLayer, Rotary
from engine.triton_attention import BLOCK_N as ATTENTION_BLOCK_N, COMBINE_BLOCK_S, AttentionPlan, attention_tile, combine_tile
from engine.triton_linear import BLOCK_M, LaunchConfig, launch_config, product_tile
from engine.triton_norm import rms_norm_row
from engine.triton_rope import qkv_rope_block_n, qkv_rope_strip

log = logging.getLogger(__name__)

STAGES = 8
NUM_WARPS = 4
NUM_STAGES = 3
# programs an SM at most: a persistent grid's loads in flight. On the H200 a 1B int8 decode replay took
# 1.16 ms with 1, 0.92 with 2, 1.03 with 4, against 0.77 for the chain of kernels
# (bench/results/gpu_draft_forward_layer.json, gpu_draft_forward_layer_grid.json)
PROGRAMS_PER_SM = 2
CPU_PROGRAMS = 3  # on the interpreter: a few, so the tile loops' strides are exercised


@triton.jit
def _grid_barrier(barrier_ptr, generation, num_programs):
    """Every program's stores before it are visible to every program's loads after it."""
    tl.debug_barrier()  # this program's threads are done
    tl.atomic_add(barrier_ptr, 1, sem="release")
    while tl.atomic_add(barrier_ptr, 0, sem="acquire") < generation * num_programs:
        pass
    tl.debug_barrier()


# the grid's size is not a specialization: the kernel _resident_grid compiles to read its registers is
# the one that runs
@triton.jit(do_not_specialize=["num_programs"])
def _layer_kernel(
    hidden_ptr, out_ptr, x_ptr, q_ptr, attn_ptr, mid_ptr, x2_ptr, act_ptr,  # [M, ...] activations, contiguous
    part_out_ptr, part_lse_ptr, part_ptr, count_ptr, barrier_ptr,  # workspaces and counters
    norm1_ptr, qkv_w_ptr, qkv_b_ptr, qkv_s_ptr, o_w_ptr, o_b_ptr, o_s_ptr,
    norm2_ptr, gu_w_ptr, gu_b_ptr, gu_s_ptr, down_w_ptr, down_b_ptr, down_s_ptr,
    cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
    M, num_seqs, eps, scale, stride_bt, stride_ps,
    down_k_per_split, num_programs,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    QKV_BN: tl.constexpr, QKV_BK: tl.constexpr, QKV_BIAS: tl.constexpr, QKV_INT8: tl.constexpr,
    O_BN: tl.constexpr, O_BK: tl.constexpr, O_BIAS: tl.constexpr, O_INT8: tl.constexpr,
    GU_BN: tl.constexpr, GU_BK: tl.constexpr, GU_BIAS: tl.constexpr, GU_INT8: tl.constexpr,
    DOWN_BN: tl.constexpr, DOWN_BK: tl.constexpr, DOWN_SPLIT: tl.constexpr, DOWN_BIAS: tl.constexpr,
    DOWN_INT8: tl.constexpr,
    ATT_BLOCK_N: tl.constexpr, ATT_BLOCK_Q: tl.constexpr, ATT_BLOCK_M: tl.constexpr, ATT_Q_TILES: tl.constexpr,
    ATT_PROGRAMS: tl.constexpr, ATT_SPLITS: tl.constexpr, COMBINE_S: tl.constexpr,
    BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr, STAGE: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:  # engine/pdl.py
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    ALL: tl.constexpr = STAGE < 0  # every stage, barriers between them; else the one stage
    DIRECT: tl.constexpr = ATT_SPLITS == 1
    QKV_N: tl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    BLOCK_D: tl.constexpr = HEAD_DIM  # (a power of two: checked by the host)
    pid = tl.program_id(0)
    row_tiles = tl.cdiv(M, BLOCK_M)
    kv_row = NUM_KV_HEADS * HEAD_DIM  # a cache slot's elements
    generation = 0
    if ALL or STAGE == 0:
        for row in range(pid, M, num_programs):
            rms_norm_row(hidden_ptr, norm1_ptr, x_ptr, row, HIDDEN, HIDDEN, HIDDEN, eps, HIDDEN)
    if ALL:
        generation += 1
        _grid_barrier(barrier_ptr, generation, num_programs)
    if ALL or STAGE == 1:
        QKV_STRIPS: tl.constexpr = QKV_N // QKV_BN
        for tile in range(pid, row_tiles * QKV_STRIPS, num_programs):
            qkv_rope_strip(tile % row_tiles, tile // row_tiles, x_ptr, qkv_w_ptr, qkv_b_ptr, qkv_s_ptr, cos_ptr,
                           sin_ptr, pos_ptr, slot_ptr, q_ptr, k_cache_ptr, v_cache_ptr, M, HIDDEN, HIDDEN, HIDDEN,
                           HEAD_DIM, HEAD_DIM, NUM_HEADS * HEAD_DIM, kv_row, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM,
                           QKV_BIAS, QKV_INT8, HIDDEN % QKV_BK == 0, BLOCK_M, QKV_BN, QKV_BK, DOT_PRECISION)
    if ALL:
        generation += 1
        _grid_barrier(barrier_ptr, generation, num_programs)
    if ALL or STAGE == 2:
        PER_SEQ: tl.constexpr = NUM_KV_HEADS * ATT_Q_TILES * ATT_PROGRAMS
        for tile in range(pid, num_seqs * PER_SEQ, num_programs):
            within = tile % PER_SEQ
            attention_tile(
                tile // PER_SEQ, within // (ATT_Q_TILES * ATT_PROGRAMS), within % (ATT_Q_TILES * ATT_PROGRAMS) // ATT_PROGRAMS,
                within % ATT_PROGRAMS,
                q_ptr, k_cache_ptr, v_cache_ptr, attn_ptr, part_out_ptr, part_lse_ptr,
                block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr, scale, NUM_HEADS * HEAD_DIM, HEAD_DIM,
                BLOCK_SIZE * kv_row, kv_row, HEAD_DIM, BLOCK_SIZE * kv_row, kv_row, HEAD_DIM,
                NUM_HEADS * HEAD_DIM, HEAD_DIM, stride_bt, stride_ps, NUM_HEADS * HEAD_DIM, HEAD_DIM,
                0, GROUP, HEAD_DIM, BLOCK_D, BLOCK_SIZE, ATT_BLOCK_N, ATT_BLOCK_Q, ATT_BLOCK_M, DOT_PRECISION,
                ATT_PROGRAMS, DIRECT,
            )
    if not DIRECT:
        if ALL:
            generation += 1
            _grid_barrier(barrier_ptr, generation, num_programs)
        if ALL or STAGE == 3:
            for tile in range(pid, M * NUM_HEADS, num_programs):
                combine_tile(tile // NUM_HEADS, tile % NUM_HEADS, part_out_ptr, part_lse_ptr, pos_ptr, attn_ptr,
                             stride_ps, NUM_HEADS * HEAD_DIM, HEAD_DIM, NUM_HEADS * HEAD_DIM, HEAD_DIM, 0, ATT_SPLITS,
                             COMBINE_S, HEAD_DIM, BLOCK_D)
    if ALL:
        generation += 1
        _grid_barrier(barrier_ptr, generation, num_programs)
    if ALL or STAGE == 4:  # o_proj, the residual added
        O_STRIPS: tl.constexpr = HIDDEN // O_BN
        for tile in range(pid, row_tiles * O_STRIPS, num_programs):
            product_tile(tile % row_tiles, tile // row_tiles, 0, O_STRIPS, attn_ptr, o_w_ptr, mid_ptr, o_b_ptr,
                         hidden_ptr, o_s_ptr, part_ptr, count_ptr, M, HIDDEN, NUM_HEADS * HEAD_DIM,
                         NUM_HEADS * HEAD_DIM, NUM_HEADS * HEAD_DIM, HIDDEN, HIDDEN, NUM_HEADS * HEAD_DIM,
                         1, False, O_BIAS, True, O_INT8, (NUM_HEADS * HEAD_DIM) % O_BK == 0, True, BLOCK_M,
                         O_BN, O_BK, DOT_PRECISION)
    if ALL:
        generation += 1
        _grid_barrier(barrier_ptr, generation, num_programs)
    if ALL or STAGE == 5:
        for row in range(pid, M, num_programs):
            rms_norm_row(mid_ptr, norm2_ptr, x2_ptr, row, HIDDEN, HIDDEN, HIDDEN, eps, HIDDEN)
    if ALL:
        generation += 1
        _grid_barrier(barrier_ptr, generation, num_programs)
    if ALL or STAGE == 6:  # gate/up, silu(gate) * up
        GU_STRIPS: tl.constexpr = 2 * INTER // GU_BN
        for tile in range(pid, row_tiles * GU_STRIPS, num_programs):
            product_tile(tile % row_tiles, tile // row_tiles, 0, GU_STRIPS, x2_ptr, gu_w_ptr, act_ptr, gu_b_ptr,
                         x2_ptr, gu_s_ptr, part_ptr, count_ptr, M, 2 * INTER, HIDDEN, HIDDEN, HIDDEN, INTER, 0,
                         HIDDEN, 1, True, GU_BIAS, False, GU_INT8, HIDDEN % GU_BK == 0, True, BLOCK_M, GU_BN, GU_BK,
                         DOT_PRECISION)
    if ALL:
        generation += 1
        _grid_barrier(barrier_ptr, generation, num_programs)
    if ALL or STAGE == 7:  # down, the residual added; split along K as the separate kernel is
        DOWN_STRIPS: tl.constexpr = HIDDEN // DOWN_BN
        for tile in range(pid, row_tiles * DOWN_STRIPS * DOWN_SPLIT, num_programs):
            within = tile % (row_tiles * DOWN_STRIPS)
            product_tile(within % row_tiles, within // row_tiles, tile // (row_tiles * DOWN_STRIPS), DOWN_STRIPS, act_ptr,
                         down_w_ptr, out_ptr, down_b_ptr, mid_ptr, down_s_ptr, part_ptr, count_ptr, M, HIDDEN, INTER,
                         INTER, INTER, HIDDEN, HIDDEN, down_k_per_split, DOWN_SPLIT, False, DOWN_BIAS, True, DOWN_INT8,
                         INTER % DOWN_BK == 0, True, BLOCK_M, DOWN_BN, DOWN_BK, DOT_PRECISION)
    if ALL:  # the last program out zeroes the barrier's counters for the next launch
        tl.debug_barrier()
        if tl.atomic_add(barrier_ptr + 1, 1, sem="acq_rel") == num_programs - 1:
            tl.atomic_xchg(barrier_ptr, 0, sem="relaxed")
            tl.atomic_xchg(barrier_ptr + 1, 0, sem="relaxed")


def layer_supported(layer: DecoderLayer) -> bool:
    """Whether the layer kernel takes this layer's shapes (else the chain of kernels runs)."""
    shape = layer.shape
    weight, _ = weight_and_scale(layer.qkv)
    hidden, inter = weight.shape[1], weight_and_scale(layer.down_proj)[0].shape[1]
    configs = [_config(linear) for linear in (layer.o_proj, layer.gate_up, layer.down_proj)]
    return (qkv_rope_block_n(weight, shape, int8=_is_int8(layer.qkv)) is not None
            and shape.head_dim == triton.next_power_of_2(shape.head_dim)
            and hidden == triton.next_power_of_2(hidden)
            and hidden % configs[0].block_n == 0 and (2 * inter) % configs[1].block_n == 0
            and hidden % configs[2].block_n == 0 and configs[0].split_k == configs[1].split_k == 1)


def layer_forward(layer: DecoderLayer, hidden: torch.Tensor, rotary: Rotary, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, batch: ForwardBatch, counters: torch.Tensor, barrier: torch.Tensor,
                  staged: bool = False, attention_programs: int | None = None) -> torch.Tensor:
    """The layer's output [M, hidden] for a step (its K/V written to the caches), attention with
    `split_len=None` key ranges (engine/triton_attention.py). `counters`: the split products' (MAX_TILES
    zeroed int32); `barrier`: layer_barrier's two (each launch leaves them zeroed); both made before any
    capture, one set for a model's kernels, which run one at a time. `staged`: each stage a launch of
    its own; `attention_programs`: as paged_attention_triton's `programs_per_tile`. Asserting host wrapper."""
    m, hidden_size = hidden.shape
    shape, device = layer.shape, hidden.device
    assert layer_supported(layer), "the layer kernel does not take this layer's shapes"
    assert hidden.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (shape.num_kv_heads, shape.head_dim)
    assert batch.block_tables.stride(1) == 1 and batch.cu_seqlens_q[-1] == m
    assert rotary.cos_table.stride(1) == 1 and rotary.cos_table.stride(0) == shape.head_dim == rotary.sin_table.stride(0)
    assert barrier.shape == (2,) and barrier.dtype == counters.dtype == torch.int32
    inter = weight_and_scale(layer.down_proj)[0].shape[1]
    q = torch.empty((m, shape.num_heads, shape.head_dim), dtype=hidden.dtype, device=device)
    plan = AttentionPlan.of(q, k_cache, batch, split_len=None, programs_per_tile=attention_programs)
    part_out, part_lse = plan.partials(q)
    qkv, o, gu, down = (_config(linear) for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down_proj))
    down_k_per_split = triton.cdiv(triton.cdiv(inter, down.split_k), down.block_k) * down.block_k
    partials = torch.empty((down.split_k, m, hidden_size), dtype=torch.float32, device=device) \
        if down.split_k > 1 else hidden
    # a buffer a stage's output: a line a program read before the barrier is never one rewritten after it
    x, mid, x2, out = (torch.empty_like(hidden) for _ in range(4))
    attn = torch.empty_like(q)
    act = torch.empty((m, inter), dtype=hidden.dtype, device=device)
    weights = []
    for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down_proj):
        weight, scale = weight_and_scale(linear)
        weights += [weight, linear.bias if linear.bias is not None else hidden, scale if scale is not None else hidden]
    args = (hidden, out, x, q, attn, mid, x2, act, part_out, part_lse, partials, counters, barrier,
            layer.input_norm, *weights[:6], layer.post_attention_norm, *weights[6:],
            rotary.cos_table, rotary.sin_table, rotary.positions, batch.slot_mapping, k_cache, v_cache,
            batch.block_tables, batch.cu_seqlens_q_t, batch.context_lens,
            m, batch.num_sequences, layer.eps, shape.head_dim**-0.5, batch.block_tables.stride(0), part_out.stride(0),
            down_k_per_split)
    constexprs = dict(
        HIDDEN=hidden_size, INTER=inter, NUM_HEADS=shape.num_heads, NUM_KV_HEADS=shape.num_kv_heads,
        HEAD_DIM=shape.head_dim, BLOCK_SIZE=k_cache.shape[1],
        QKV_BN=qkv.block_n, QKV_BK=qkv.block_k, QKV_BIAS=layer.qkv.bias is not None, QKV_INT8=_is_int8(layer.qkv),
        O_BN=o.block_n, O_BK=o.block_k, O_BIAS=layer.o_proj.bias is not None, O_INT8=_is_int8(layer.o_proj),
        GU_BN=gu.block_n, GU_BK=gu.block_k, GU_BIAS=layer.gate_up.bias is not None, GU_INT8=_is_int8(layer.gate_up),
        DOWN_BN=down.block_n, DOWN_BK=down.block_k, DOWN_SPLIT=down.split_k, DOWN_BIAS=layer.down_proj.bias is not None,
        DOWN_INT8=_is_int8(layer.down_proj),
        ATT_BLOCK_N=ATTENTION_BLOCK_N, ATT_BLOCK_Q=plan.block_q, ATT_BLOCK_M=plan.block_m, ATT_Q_TILES=plan.q_tiles,
        ATT_PROGRAMS=plan.programs, ATT_SPLITS=plan.max_splits, COMBINE_S=COMBINE_BLOCK_S,
        BLOCK_M=BLOCK_M, DOT_PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS, num_stages=NUM_STAGES, **pdl.launch_options(device),
    )
    if m == 0:
        return out
    num_programs = CPU_PROGRAMS if device.type != "cuda" else _resident_grid(args, constexprs, device)
    if staged or device.type != "cuda":
        for stage in range(STAGES):
            if stage != 3 or plan.max_splits > 1:
                _layer_kernel[(num_programs,)](*args, num_programs, STAGE=stage, **constexprs)
    else:
        _layer_kernel[(num_programs,)](*args, num_programs, STAGE=-1, **constexprs)
    return out


def check_every_sm_is_ours() -> None:
    """The barrier needs the whole grid resident at once. Under MPS with an active-thread limit a process
    gets fewer SMs than the device reports, and the grid would wait at its first barrier forever."""
    limit = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    if limit is not None and float(limit) < 100:
        raise ValueError(f"--layer-kernels layer needs every SM of the GPU, but CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="
                         f"{limit} gives this process a share of them; unset it, or use --layer-kernels auto")


def layer_barrier(device: torch.device) -> torch.Tensor:
    """The layer kernel's barrier counters, zeroed; made before any graph capture."""
    return torch.zeros(2, dtype=torch.int32, device=device)


_GRIDS: dict[tuple, int] = {}


def _resident_grid(args: tuple, constexprs: dict, device: torch.device) -> int:
    """The most programs that are resident all at once (the barrier's premise), at most PROGRAMS_PER_SM
    an SM: from the compiled kernel's registers and shared memory, once per compiled variant."""
    key = (device.index, *(a.dtype if isinstance(a, torch.Tensor) else type(a) for a in args),
           *sorted(constexprs.items()), PROGRAMS_PER_SM)
    if key not in _GRIDS:
        props = torch.cuda.get_device_properties(device)
        try:
            kernel = _layer_kernel.warmup(*args, 1, STAGE=-1, grid=(1,), **constexprs)
            kernel._init_handles()  # loads it: its register count
        except (AttributeError, TypeError) as error:  # another Triton's API: one an SM is resident if it runs at all
            log.warning("layer kernel: one program an SM (its occupancy is unknown: %s)", error)
            per_sm = 1
        else:
            warps = constexprs["num_warps"]
            registers = -(-kernel.n_regs * 32 // 256) * 256 * warps  # allocated a warp at a time, 256 at once
            per_sm = min(PROGRAMS_PER_SM, getattr(props, "regs_per_multiprocessor", 65536) // registers,
                         props.max_threads_per_multi_processor // (32 * warps),
                         getattr(props, "shared_memory_per_multiprocessor", 228 * 1024) // (kernel.metadata.shared + 1024))
            assert per_sm >= 1, f"the layer kernel does not fit an SM ({kernel.n_regs} registers, {kernel.metadata.shared} B)"
        _GRIDS[key] = per_sm * props.multi_processor_count
    return _GRIDS[key]


def _is_int8(linear) -> bool:
    return weight_and_scale(linear)[1] is not None


def _config(linear) -> LaunchConfig:
    weight, scale = weight_and_scale(linear)
    return launch_config(weight.shape[0], weight.shape[1], int8=scale is not None)
