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
    inputs: StaticInputs
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
        graph.inputs.fill(steps)
        graph.graph.replay()
        self.num_replays += 1
        return [graph.logits[i * q + len(s.token_ids) - s.num_logits: i * q + len(s.token_ids)]
                for i, s in enumerate(steps)]

    def _capture(self, b: int, q: int) -> _Graph:
        inputs = StaticInputs(b, q, self._max_blocks, self._kv.block_size, self._device)
        graph, logits = capture(lambda: self._model(inputs.batch, self._kv, self._attention), self._pool)
        self.num_captures += 1
        return _Graph(graph, inputs, logits)


class StaticInputs:
    """The input buffers of a captured step: b sequences of q tokens, initialised as all padding.

    The device tensors of `batch` are views of two flat buffers (int64: token ids, positions, slots;
    int32: context lengths, block tables), filled from host mirrors (pinned on CUDA) in two copies:
    a step's host work is a few numpy writes, not a dozen tensor ops and copies. `num_extra` more
    int64 rows of b values ride along for the caller (`extra`: device, `host_extra`: numpy, written
    before `fill`).
    """

    def __init__(self, b: int, q: int, max_blocks: int, block_size: int, device: torch.device,
                 num_extra: int = 0) -> None:
        self.q = q
        self._scratch = SCRATCH_BLOCK * block_size
        pin = device.type == "cuda"
        self._host_long = torch.zeros(3 * b * q + num_extra * b, dtype=torch.long, pin_memory=pin)
        self._host_int = torch.zeros(b + b * max_blocks, dtype=torch.int32, pin_memory=pin)
        self._long = self._host_long[: 3 * b * q].view(3, b * q).numpy()
        self.host_extra = self._host_long[3 * b * q:].view(num_extra, b).numpy()
        self._context_lens = self._host_int[:b].numpy()
        self._block_tables = self._host_int[b:].view(b, max_blocks).numpy()
        self._fill_padding()
        device_long, device_int = self._host_long.to(device), self._host_int.to(device)
        self._device = (device_long, device_int)
        self.extra = device_long[3 * b * q:].view(num_extra, b)
        self._copied: torch.cuda.Event | None = None
        self.batch = ForwardBatch(
            input_ids=device_long[: b * q],
            positions=device_long[b * q: 2 * b * q],
            slot_mapping=device_long[2 * b * q: 3 * b * q],
            cu_seqlens_q=list(range(0, b * q + 1, q)),
            cu_seqlens_q_t=torch.arange(0, b * q + 1, q, dtype=torch.int32, device=device),
            context_lens=device_int[:b],
            block_tables=device_int[b:].view(b, max_blocks),
            max_num_q=q,
            logits_indices=torch.arange(b * q, device=device),
        )

    def fill(self, steps: list[StepInput]) -> None:
        """Writes the steps (KV slots reserved), padding to q tokens and b sequences.

        Pad tokens write their K/V into the scratch block and only pad queries attend to them.
        """
        self.wait_for_copy()
        self._fill_padding()
        q, tokens = self.q, self._long
        for i, step in enumerate(steps):
            n, start = len(step.token_ids), step.kv.num_tokens
            tokens[0, i * q: i * q + n] = step.token_ids
            tokens[1, i * q: i * q + n] = range(start, start + n)
            tokens[2, i * q: i * q + n] = step.kv.slots(start, n)
            self._context_lens[i] = start + q  # the real queries keep their positions (see module doc)
            self._block_tables[i, : len(step.kv.block_table)] = step.kv.block_table
        device_long, device_int = self._device
        device_long.copy_(self._host_long, non_blocking=True)
        device_int.copy_(self._host_int, non_blocking=True)
        if device_long.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def wait_for_copy(self) -> None:
        """Before writing the host mirrors: the previous step's copy has read them."""
        if self._copied is not None:
            self._copied.synchronize()

    def _fill_padding(self) -> None:
        self._long[:2] = 0
        self._long[2] = self._scratch
        self._context_lens[:] = self.q  # pad sequences: q pad queries over the scratch block
        self._block_tables[:] = SCRATCH_BLOCK


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
