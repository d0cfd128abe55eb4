"""Triton fused MLP for a draft's few-row graph steps: hidden + down(silu(gate) * up) in one kernel.

The chain (engine/fused_stages.py) runs the MLP as two skinny products: gate/up with the activation
in its epilogue, then the down projection with the residual; between them a kernel boundary, and
the down projection's weights are not read until the gate/up kernel has finished. Here program p
owns BLOCK_I intermediate columns: it computes them (the same strip product and epilogue as the
chain's gate/up), then multiplies them by the matching rows of the transposed down weight (`down_t`,
[I, H], contiguous along H) into a float32 partial of the whole output row. The partials are added
in a fixed tree (whichever program arrives last, the same sums): each group of GROUP programs' last
arrival adds its group's partials in order, and the last group's adds the groups' sums in order,
scales (an int8 `down_t`: one scale per output column), rounds, adds the residual and writes the
output; each zeroes the counter it counted in. So a row's result is the same bits in any batch and
run; not the chain's bits (another order of the sum), which a draft does not need.

For rows <= MAX_ROWS (a batch-1 proposal's steps): the partials are rows x H floats a program.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import pdl
from engine.triton_linear import BLOCK_M, strip_product

MAX_ROWS = 4
BLOCK_I = 16  # intermediate columns a program (the chain's gate/up strip: 32 interleaved rows)
GROUP = 16  # programs a first-level sum
NUM_WARPS, NUM_STAGES = 4, 3
SUM_ELEMENTS = 8192  # floats a load of the sums (64 a thread at 4 warps)


@triton.jit
def _fused_mlp_kernel(
    x_ptr, wgu_ptr, sgu_ptr, wd_ptr, sd_ptr, res_ptr, out_ptr, part_ptr, group_ptr, count_ptr,
    M, H, stride_xm, stride_rm, stride_om,
    NUM_PROGRAMS: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUP: tl.constexpr,
    GU_INT8: tl.constexpr, DOWN_INT8: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr, SUM_H: tl.constexpr, GROUPS_P2: tl.constexpr, TOP_H: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:  # engine/pdl.py
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    # gate/up: rows (gate_j, up_j) of this program's BLOCK_I intermediate columns, as the chain's epilogue
    gu_rows = pid * 2 * BLOCK_I + tl.arange(0, 2 * BLOCK_I)
    acc = strip_product(x_ptr, wgu_ptr, rows, gu_rows, row_ok, gu_rows >= 0, H, stride_xm, H, 0, H, GU_INT8,
                        EVEN_K, BLOCK_M, 2 * BLOCK_I, BLOCK_K, DOT_PRECISION)
    if GU_INT8:
        acc *= tl.load(sgu_ptr + gu_rows).to(tl.float32)[None, :]
    gate, up = tl.split(tl.reshape(acc.to(dtype).to(tl.float32), [BLOCK_M, BLOCK_I, 2]))
    act = ((gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up).to(dtype)  # [BLOCK_M, BLOCK_I]
    # down: this program's share of every output column, a float32 partial
    i_rows = pid * BLOCK_I + tl.arange(0, BLOCK_I)
    cols = tl.arange(0, BLOCK_H)
    w_rows = wd_ptr + i_rows[:, None].to(tl.int64) * H
    parts = part_ptr + pid * M * H + rows[:, None] * H
    for n0 in range(0, H, BLOCK_H):
        w = tl.load(w_rows + n0 + cols[None, :])
        if DOWN_INT8:  # int8 values are exact in bf16, fp16 and float32
            w = w.to(dtype)
        tl.store(parts + n0 + cols[None, :], tl.dot(act, w, input_precision=DOT_PRECISION), mask=row_ok[:, None])
    # the sums, in a fixed order: a group's last arrival adds the group's partials, the last group's the groups'
    tl.debug_barrier()  # every thread's partials written before the count (release) says so
    group = pid // GROUP
    first = group * GROUP
    members = tl.minimum(GROUP, NUM_PROGRAMS - first)
    arrived = tl.atomic_add(count_ptr + group, 1, sem="acq_rel")
    if arrived == members - 1:
        slots = tl.arange(0, GROUP)
        sum_cols = tl.arange(0, SUM_H)
        for r in tl.static_range(ROWS):  # a [GROUP, SUM_H] tile a load, from L2 (.cg), where the others' stores are
            for n0 in range(0, H, SUM_H):
                tile = tl.load(part_ptr + (first + slots)[:, None] * M * H + r * H + n0 + sum_cols[None, :],
                               mask=(slots < members)[:, None] & (sum_cols * 0 + r < M)[None, :], other=0.0, cache_modifier=".cg")
                tl.store(group_ptr + group * M * H + r * H + n0 + sum_cols, tl.sum(tile, axis=0),
                         mask=sum_cols * 0 + r < M)
        tl.atomic_xchg(count_ptr + group, 0)  # zeroed for the next launch
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + NUM_GROUPS, 1, sem="acq_rel")
        if done == NUM_GROUPS - 1:
            groups = tl.arange(0, GROUPS_P2)
            top_cols = tl.arange(0, TOP_H)
            for r in tl.static_range(ROWS):
                for n0 in range(0, H, TOP_H):
                    tile = tl.load(group_ptr + groups[:, None] * M * H + r * H + n0 + top_cols[None, :],
                                   mask=(groups < NUM_GROUPS)[:, None] & (top_cols * 0 + r < M)[None, :], other=0.0, cache_modifier=".cg")
                    total = tl.sum(tile, axis=0)
                    if DOWN_INT8:
                        total *= tl.load(sd_ptr + n0 + top_cols).to(tl.float32)
                    row_mask = top_cols * 0 + r < M
                    res = tl.load(res_ptr + r * stride_rm + n0 + top_cols, mask=row_mask, other=0.0)
                    y = total.to(dtype).to(tl.float32) + res.to(tl.float32)  # rounded as the unfused add
                    tl.store(out_ptr + r * stride_om + n0 + top_cols, y.to(out_ptr.dtype.element_ty), mask=row_mask)
            tl.atomic_xchg(count_ptr + NUM_GROUPS, 0)


def fused_mlp(
    x: torch.Tensor,  # [M, H] the normed hidden rows
    gate_up: torch.Tensor,  # [2I, H] rows gate_0, up_0, gate_1, ... (int8 with gate_up_scale)
    gate_up_scale: torch.Tensor | None,  # [2I]
    down_t: torch.Tensor,  # [I, H] the down projection's weight transposed (int8 with down_scale)
    down_scale: torch.Tensor | None,  # [H]
    residual: torch.Tensor,  # [M, H]
    counters: torch.Tensor,  # zeroed int32, at least H / BLOCK_I / GROUP + 1 (engine/triton_linear.split_counters)
    block_i: int | None = None,  # None: BLOCK_I
    group: int | None = None,  # None: GROUP
) -> torch.Tensor:  # [M, H]
    """Asserting host wrapper: every shape, dtype and stride is checked before launch."""
    block_i, group = block_i or BLOCK_I, group or GROUP
    m, hidden = x.shape
    inter = down_t.shape[0]
    assert 0 < m <= MAX_ROWS, f"{m} rows: the fused MLP takes 1..{MAX_ROWS}"
    assert gate_up.shape == (2 * inter, hidden) and down_t.shape == (inter, hidden), \
        f"gate/up {tuple(gate_up.shape)} and down_t {tuple(down_t.shape)} vs hidden {hidden}"
    assert residual.shape == (m, hidden) and x.stride(1) == residual.stride(1) == 1
    assert gate_up.is_contiguous() and down_t.is_contiguous()
    assert (gate_up_scale is None) == (gate_up.dtype != torch.int8)
    assert (down_scale is None) == (down_t.dtype != torch.int8)
    assert inter % block_i == 0, f"intermediate size {inter} is not a multiple of {block_i}"
    block_h = next(b for b in (256, 128, 64, 32, 16) if hidden % b == 0)
    block_k = 256 if gate_up.dtype == torch.int8 else 128
    block_k = min(block_k, triton.next_power_of_2(hidden))
    num_programs = inter // block_i
    num_groups = triton.cdiv(num_programs, group)
    assert counters.dtype == torch.int32 and counters.numel() > num_groups
    assert group == triton.next_power_of_2(group), f"group {group} is not a power of two"
    groups_p2 = triton.next_power_of_2(num_groups)
    # the sums load [slots, columns] tiles of SUM_ELEMENTS floats, columns a power of two dividing H
    sum_h = next(b for b in (2048, 1024, 512, 256, 128, 64, 32, 16) if hidden % b == 0 and b * group <= SUM_ELEMENTS)
    top_h = next(b for b in (2048, 1024, 512, 256, 128, 64, 32, 16) if hidden % b == 0 and b * groups_p2 <= SUM_ELEMENTS)
    part = torch.empty((num_programs, m, hidden), dtype=torch.float32, device=x.device)
    group_part = torch.empty((num_groups, m, hidden), dtype=torch.float32, device=x.device)
    out = torch.empty_like(residual)
    _fused_mlp_kernel[(num_programs,)](
        x, gate_up, gate_up_scale if gate_up_scale is not None else x, down_t,
        down_scale if down_scale is not None else x, residual, out, part, group_part, counters,
        m, hidden, x.stride(0), residual.stride(0), out.stride(0),
        NUM_PROGRAMS=num_programs, NUM_GROUPS=num_groups, GROUP=group,
        GU_INT8=gate_up.dtype == torch.int8, DOWN_INT8=down_t.dtype == torch.int8, EVEN_K=hidden % block_k == 0,
        BLOCK_M=BLOCK_M, BLOCK_I=block_i, BLOCK_K=block_k, BLOCK_H=block_h, ROWS=max(2, triton.next_power_of_2(m)),
        SUM_H=sum_h, GROUPS_P2=groups_p2, TOP_H=top_h,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS, num_stages=NUM_STAGES, **pdl.launch_options(x.device),
    )
    return out
