"""Triton: the draft loop's next step inputs from the token it just proposed, in one kernel.

Between two forwards of the captured proposal loop (engine/draft_loop.py) each row's next input is
its proposed token at position base + j, whose KV slot comes from the block table. In PyTorch ops
that is a dozen tiny kernels a step (an add, a division, a gather, casts, four copies), each a
launch and a ramp inside the graph; here it is one.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import pdl
from engine.batch import ForwardBatch


@triton.jit
def _advance_kernel(token_ptr, stride_token, base_ptr, tables_ptr, stride_tables, ids_ptr, positions_ptr, slots_ptr,
                    context_ptr, j, B, BLOCK_SIZE: tl.constexpr, BLOCK_B: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # engine/pdl.py
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.arange(0, BLOCK_B)
    ok = rows < B
    position = tl.load(base_ptr + rows, mask=ok, other=0) + j
    block = tl.load(tables_ptr + rows.to(tl.int64) * stride_tables + position // BLOCK_SIZE, mask=ok, other=0)
    tl.store(ids_ptr + rows, tl.load(token_ptr + rows * stride_token, mask=ok, other=0), mask=ok)
    tl.store(positions_ptr + rows, position, mask=ok)
    tl.store(slots_ptr + rows, block.to(tl.int64) * BLOCK_SIZE + position % BLOCK_SIZE, mask=ok)
    tl.store(context_ptr + rows, (position + 1).to(tl.int32), mask=ok)


def advance_step(token: torch.Tensor, base: torch.Tensor, j: int, block_tables: torch.Tensor, block_size: int,
                 step: ForwardBatch) -> None:
    """Writes `step`'s input_ids (= `token`), positions (base + j), slot_mapping and context_lens
    (position + 1) in place, for each of its rows; engine.draft_loop.advance_step_reference is the
    same in PyTorch."""
    b = step.input_ids.shape[0]
    assert token.shape == base.shape == (b,) and token.dtype == base.dtype == torch.long
    assert step.positions.dtype == step.slot_mapping.dtype == torch.long and step.context_lens.dtype == torch.int32
    assert block_tables.dtype == torch.int32 and block_tables.shape[0] == b and block_tables.stride(1) == 1
    assert all(t.is_contiguous() for t in (base, step.input_ids, step.positions, step.slot_mapping, step.context_lens))
    _advance_kernel[(1,)](token, token.stride(0), base, block_tables, block_tables.stride(0), step.input_ids,
                          step.positions, step.slot_mapping, step.context_lens, j, b,
                          BLOCK_SIZE=block_size, BLOCK_B=triton.next_power_of_2(b), num_warps=1,
                          **pdl.launch_options(token.device))
