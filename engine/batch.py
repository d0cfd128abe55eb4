"""The flat, varlen description of one batched forward over several sequences."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv_cache import SequenceKV


@dataclass(frozen=True)
class StepInput:
    """One sequence's share of a forward: tokens to append and which of them need logits."""

    kv: SequenceKV
    token_ids: list[int]
    num_logits: int  # logits for the last `num_logits` of token_ids

    def __post_init__(self) -> None:
        if not self.token_ids or not 0 <= self.num_logits <= len(self.token_ids):
            raise ValueError(f"bad step input: {len(self.token_ids)} tokens, {self.num_logits} logits")


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] all sequences' new tokens, concatenated
    positions: torch.Tensor  # [T] absolute position of each token
    slot_mapping: torch.Tensor  # [T] flat KV slot each token writes
    cu_seqlens_q: list[int]  # [B + 1] token offsets of each sequence in input_ids
    cu_seqlens_q_t: torch.Tensor  # [B + 1] int32, the same on the device
    context_lens: torch.Tensor  # [B] int32 tokens in each sequence's KV after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32 block ids (padding: 0)
    max_num_q: int  # the most new tokens of any one sequence
    # [N] rows of the hidden states that need logits; None: every row (a graph step's padded batch: no
    # gather kernel, which PDL could not overlap)
    logits_indices: torch.Tensor | None

    @property
    def num_sequences(self) -> int:
        return self.context_lens.shape[0]


def build_forward_batch(steps: list[StepInput], device: torch.device) -> ForwardBatch:
    """Flattens the steps (whose KV slots are reserved) into one varlen batch."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu_seqlens_q = [0]
    logits_indices: list[int] = []
    for step in steps:
        num_new, start = len(step.token_ids), step.kv.num_tokens
        input_ids += step.token_ids
        positions += range(start, start + num_new)
        slots += step.kv.slots(start, num_new)
        cu_seqlens_q.append(cu_seqlens_q[-1] + num_new)
        logits_indices += range(cu_seqlens_q[-1] - step.num_logits, cu_seqlens_q[-1])
    as_tensor = lambda xs, dtype=torch.long: torch.tensor(xs, dtype=dtype, device=device)  # noqa: E731
    max_blocks = max(len(step.kv.block_table) for step in steps)
    block_tables = [step.kv.block_table + [0] * (max_blocks - len(step.kv.block_table)) for step in steps]
    return ForwardBatch(
        input_ids=as_tensor(input_ids),
        positions=as_tensor(positions),
        slot_mapping=as_tensor(slots),
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_q_t=as_tensor(cu_seqlens_q, torch.int32),
        context_lens=as_tensor([s.kv.num_tokens + len(s.token_ids) for s in steps], torch.int32),
        block_tables=as_tensor(block_tables, torch.int32),
        max_num_q=max(len(step.token_ids) for step in steps),
        logits_indices=as_tensor(logits_indices),
    )
