"""CUDA graphs for decode and verify steps: one captured forward per (batch bucket, query bucket).

A step whose sequences each feed at most `max(query_buckets)` tokens runs as a replay: every
sequence is padded to q tokens and the batch to b sequences. Pad tokens write their K/V into
the pool's scratch block and only pad queries attend to them; their logits are dropped. Context
lengths live in device buffers, so one graph serves every context length. Longer prefill chunks
run eagerly.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from tqdm import tqdm

from engine.batch import ForwardBatch, StepInput
from engine.kv_cache import SCRATCH_BLOCK, KVPool
from engine.llama import AttentionFn, CausalLM

T = TypeVar("T")

@dataclass(frozen=True)
class GraphConfig:
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    query_buckets: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8)  # k + 1 for k in 0..7


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    batch: ForwardBatch  # static input buffers
    logits: torch.Tensor  # [b * q, vocab] static output


class CudaGraphRunner:
    def __init__(self, model: CausalLM, kv: KVPool, attention: AttentionFn, max_model_len: int,
                 config: GraphConfig, device: torch.device) -> None:
        self._model, self._kv, self._attention = model, kv, attention
        self._config = config
        self._device = device
        # wide enough for a padded step at the very end of the context
        self._max_blocks = -(-(max_model_len + max(config.query_buckets)) // kv.block_size)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self.num_replays = 0
        self.num_captures = 0

    def capture_all(self) -> None:
        """Captures every bucket (largest first, so smaller graphs reuse its memory)."""
        shapes = [(b, q) for b in sorted(self._config.batch_buckets, reverse=True)
                  for q in sorted(self._config.query_buckets, reverse=True)]
        for b, q in tqdm(shapes, desc="capturing CUDA graphs", unit="graph"):
            self._graphs[(b, q)] = self._capture(b, q)

    def can_run(self, steps: list[StepInput]) -> bool:
        return (len(steps) <= self._config.batch_buckets[-1]
                and max(len(s.token_ids) for s in steps) <= self._config.query_buckets[-1])

    def run(self, steps: list[StepInput]) -> list[torch.Tensor]:
        """Replays the bucket's graph for steps whose KV slots are reserved; [num_logits, vocab] each."""
        b = _bucket(self._config.batch_buckets, len(steps))
        q = _bucket(self._config.query_buckets, max(len(s.token_ids) for s in steps))
        graph = self._graphs[(b, q)]
        fill_static_batch(graph.batch, steps, q, self._kv)
        graph.graph.replay()
        self.num_replays += 1
        return [graph.logits[i * q + len(s.token_ids) - s.num_logits: i * q + len(s.token_ids)]
                for i, s in enumerate(steps)]

    def _capture(self, b: int, q: int) -> _Graph:
        batch = static_batch(b, q, self._max_blocks, self._kv.block_size, self._device)
        graph, logits = capture(lambda: self._model(batch, self._kv, self._attention), self._pool)
        self.num_captures += 1
        return _Graph(graph, batch, logits)


def static_batch(b: int, q: int, max_blocks: int, block_size: int, device: torch.device) -> ForwardBatch:
    """Input buffers for b sequences of q tokens each, initialised as all padding."""
    return ForwardBatch(
        input_ids=torch.zeros(b * q, dtype=torch.long, device=device),
        positions=torch.zeros(b * q, dtype=torch.long, device=device),
        slot_mapping=torch.full((b * q,), SCRATCH_BLOCK * block_size, dtype=torch.long, device=device),
        cu_seqlens_q=list(range(0, b * q + 1, q)),
        cu_seqlens_q_t=torch.arange(0, b * q + 1, q, dtype=torch.int32, device=device),
        context_lens=torch.full((b,), q, dtype=torch.int32, device=device),
        block_tables=torch.full((b, max_blocks), SCRATCH_BLOCK, dtype=torch.int32, device=device),
        max_num_q=q,
        logits_indices=torch.arange(b * q, device=device),
    )


def fill_static_batch(batch: ForwardBatch, steps: list[StepInput], q: int, kv: KVPool) -> None:
    """Writes the steps (KV slots reserved) into a static batch, padding to q tokens and b sequences.

    Pad tokens write their K/V into the scratch block and only pad queries attend to them.
    """
    b, max_blocks = batch.block_tables.shape
    bs = kv.block_size
    scratch = SCRATCH_BLOCK * bs
    input_ids, positions, slots = [0] * (b * q), [0] * (b * q), [scratch] * (b * q)
    context_lens = [q] * b  # pad sequences: q pad queries over the scratch block
    block_tables = torch.full((b, max_blocks), SCRATCH_BLOCK, dtype=torch.int32)
    for i, step in enumerate(steps):
        n, start = len(step.token_ids), step.kv.num_tokens
        input_ids[i * q: i * q + n] = step.token_ids
        positions[i * q: i * q + n] = range(start, start + n)
        slots[i * q: i * q + n] = step.kv.slots(start, n)
        context_lens[i] = start + q  # the real queries keep their positions (see module doc)
        block_tables[i, : len(step.kv.block_table)] = torch.tensor(step.kv.block_table, dtype=torch.int32)
    host = torch.tensor([input_ids, positions, slots], dtype=torch.long)
    batch.input_ids.copy_(host[0], non_blocking=True)
    batch.positions.copy_(host[1], non_blocking=True)
    batch.slot_mapping.copy_(host[2], non_blocking=True)
    batch.context_lens.copy_(torch.tensor(context_lens, dtype=torch.int32), non_blocking=True)
    batch.block_tables.copy_(block_tables, non_blocking=True)


def capture(fn: Callable[[], T], pool: tuple) -> tuple[torch.cuda.CUDAGraph, T]:
    """Warms `fn` up on a side stream (compiling Triton kernels), then captures it; returns its static output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: CUDA calls of other threads (another model serving meanwhile) do not void the capture
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


def _bucket(buckets: tuple[int, ...], n: int) -> int:
    return buckets[bisect.bisect_left(buckets, n)]
