"""A step's host work on scratch objects, run between steps to keep its code warm (opt-in).

A model service's host work runs once a step, after a gap of milliseconds in which the other service
computes; after such a gap the same Python runs several times slower than back to back, its code and
data gone cold in the CPU's caches (bench/cold_host.py on the 2-vCPU CI-class VM: 18 us back to back,
88-212 us after 3.5 ms of busy waiting, 23-41 us with the work rehearsed every 0.5 ms of the gap; on the
H200 host bench/step_trace.py saw the target's host work 1.6x slower in speculative steps than in
target-only ones). A polling event loop (specdec/busy_poll.py) can spend some of the gap rehearsing.

`Rehearsal` holds what a rehearsal writes instead of the engine's state: a sequence's KV bookkeeping on
an allocator of its own and graph inputs on the CPU (StaticInputs' host writes; no copy to the device,
no GPU work, nothing a running or next step reads). The engines' `rehearse()` run their step's own
host functions over it (TargetEngine, ModelDrafter).
"""
from __future__ import annotations

import torch

from engine.batch import StepInput
from engine.cuda_graphs import StaticInputs
from engine.kv_cache import BlockAllocator, SequenceKV

CONTEXT = 512  # tokens the scratch sequence holds: a mid-length context's block table


class Rehearsal:
    def __init__(self, block_size: int, num_tokens: int, max_model_len: int, num_extra: int = 0) -> None:
        """`num_tokens`: a step's tokens (a verify's k + 1); `num_extra`: StaticInputs' extra rows (the draft loop's)."""
        max_blocks = -(-(max_model_len + num_tokens + 16) // block_size)
        self.kv = SequenceKV(BlockAllocator(max_blocks, first_block_id=1), block_size)
        self.context = min(CONTEXT, max_model_len - num_tokens)
        self.kv.reserve(self.context)
        self.kv.commit(self.context)
        self.token_ids = list(range(num_tokens))
        self.inputs = StaticInputs(1, num_tokens, max_blocks, block_size, torch.device("cpu"), num_extra=num_extra)
        self.logits = torch.zeros(num_tokens, 8)  # a step's logits in miniature, for its read back's host code

    def step(self) -> StepInput:
        return StepInput(self.kv, list(self.token_ids), num_logits=len(self.token_ids))

    def fill(self, step: StepInput, extra: list[list[int]] | None = None) -> None:
        """The graph inputs' host writes for `step`, as a replay's fill does; then the KV rolled back."""
        step.kv.reserve(len(step.token_ids))
        self.inputs.fill([step], extra)
        step.kv.truncate(self.context)
