"""CUDA graphs for decode and verify steps: one captured forward per (batch bucket, query bucket);
and for prefill chunks: one per prefill bucket, of one sequence.

A step whose sequences each feed at most `max(query_buckets)` tokens runs as a replay: every
sequence is padded to q tokens and the batch to b sequences. Pad tokens write their K/V into
the pool's scratch block and only pad queries attend to them; their logits are dropped. Context
lengths live in device buffers, so one graph serves every context length.

A prefill chunk of up to `max(prefill_buckets)` tokens replays its bucket's graph, one chunk a
replay (a forward of up to MAX_PREFILL_REPLAYS chunks), padded alike, with the layers' fallback
stages (compiled PyTorch, cuBLAS: many rows, where the fused kernels lose) and logits for its last
token only. Why: an eager prefill is bound by its host launches, not by the GPU: on the H200 a
128-token prefill of a Llama-3.1-8B shape took 37 ms of wall time for 5.9 ms of kernels, a
Llama-3.2-1B shape 13 ms for 1.6 (bench/results/gpu_prefill.json). Longer chunks run eagerly:
their kernels outweigh their launches, and a bucket's attention partials grow with its rows.
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from engine.batch import ForwardBatch, StepInput
from engine.kv_cache import SCRATCH_BLOCK, KVPool
from engine.llama import AttentionFn, CausalLM
from engine.progress import progress

T = TypeVar("T")

@dataclass(frozen=True)
class GraphConfig:
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    query_buckets: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8)  # k + 1 for k in 0..7
    # prefill chunks of one sequence (those up to the model's context length are captured); () for none
    prefill_buckets: tuple[int, ...] = (16, 32, 64, 96, 128, 192, 256, 384, 512)

    def for_max_batch(self, max_batch_size: int) -> GraphConfig:
        """Only the batch buckets a forward of at most `max_batch_size` sequences can take."""
        return dataclasses.replace(self, batch_buckets=buckets_covering(self.batch_buckets, max_batch_size))


def buckets_covering(buckets: tuple[int, ...], n: int) -> tuple[int, ...]:
    """`buckets` up to the first that holds `n` (all of them when none does: larger batches split)."""
    return buckets[: bisect.bisect_left(buckets, n) + 1]


# A forward of more prefill chunks runs eagerly: each replay reads all the weights, one eager forward
# reads them once for all its chunks.
MAX_PREFILL_REPLAYS = 8


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: StaticInputs
    logits: torch.Tensor  # [b * q, vocab] static output
    # decode/verify graphs: every row's argmax token, computed in the graph, its pinned host mirror, and
    # an event recorded after each copy into it
    greedy: torch.Tensor | None = None  # [b * q]
    host_greedy: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None


@dataclass
class GreedyIds:
    """Each step's argmax tokens on their way to the host: `ready` is recorded after the copy (None:
    there already)."""

    host: torch.Tensor  # every row's token, flat (pinned on CUDA)
    rows: list[tuple[int, int]]  # each step's rows in `host`
    ready: torch.cuda.Event | None

    @classmethod
    def of(cls, per_step: list[torch.Tensor]) -> GreedyIds:
        """Starts the read back of each step's logit rows' argmax tokens, one kernel and one copy for all."""
        ends = list(itertools.accumulate(len(rows) for rows in per_step))
        rows = [(end - len(logits), end) for logits, end in zip(per_step, ends)]
        if not ends or not ends[-1]:
            return cls(torch.zeros(0, dtype=torch.long), rows, None)
        ids = torch.cat(per_step).argmax(-1)
        if not ids.is_cuda:
            return cls(ids, rows, None)
        host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        host.copy_(ids, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(host, rows, ready)

    def get(self) -> list[list[int]]:
        """Each step's tokens, as Python ints (waits for the copy, if it has not ended)."""
        if self.ready is not None:
            self.ready.synchronize()
        ids = self.host.tolist()
        return [ids[start: end] for start, end in self.rows]


class CudaGraphRunner:
    def __init__(self, model: CausalLM, kv: KVPool, attention: AttentionFn, max_model_len: int,
                 config: GraphConfig, device: torch.device) -> None:
        self._model, self._kv, self._attention = model, kv, attention
        self._config = config
        self._device = device
        # the prefill buckets up to the first that holds a whole context
        fits = bisect.bisect_left(config.prefill_buckets, max_model_len)
        self._prefill_buckets = config.prefill_buckets[: fits + 1]
        # wide enough for a padded step at the very end of the context
        widest = max(config.query_buckets + self._prefill_buckets)
        self._max_blocks = -(-(max_model_len + widest) // kv.block_size)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._prefills: dict[int, _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self.num_replays = 0  # decode and verify steps
        self.num_prefill_replays = 0  # prefill chunks
        self.num_captures = 0

    def capture_all(self) -> None:
        """Captures every bucket (largest first, so smaller graphs reuse its memory)."""
        prefills = sorted(self._prefill_buckets, reverse=True)
        shapes = [(b, q) for b in sorted(self._config.batch_buckets, reverse=True)
                  for q in sorted(self._config.query_buckets, reverse=True)]
        with progress(len(prefills) + len(shapes), "capturing CUDA graphs", "graph") as bar:
            for q in prefills:
                self._prefills[q] = self._capture_prefill(q)
                bar.update()
            for b, q in shapes:
                self._graphs[(b, q)] = self._capture(b, q)
                bar.update()
        release_cached_gpu_memory()  # the warm-ups' temporaries, once `capture` no longer empties the cache each time

    def can_run(self, steps: list[StepInput]) -> bool:
        return (len(steps) <= self._config.batch_buckets[-1]
                and max(len(s.token_ids) for s in steps) <= self._config.query_buckets[-1])

    def run(self, steps: list[StepInput]) -> list[torch.Tensor]:
        """Replays the bucket's graph for steps whose KV slots are reserved; [num_logits, vocab] each."""
        graph, q = self._replay(steps)
        return [graph.logits[start: end] for start, end in _logit_rows(steps, q)]

    def run_greedy(self, steps: list[StepInput]) -> tuple[list[torch.Tensor], GreedyIds]:
        """`run`, plus each step's argmax tokens (one per logit row) on their way to the host: computed in
        the graph, one copy for the whole batch, not an argmax kernel and a read back per step. Read them
        before the next replay of this bucket."""
        graph, q = self._replay(steps)
        graph.host_greedy.copy_(graph.greedy, non_blocking=True)
        graph.copied.record()
        rows = _logit_rows(steps, q)
        return [graph.logits[start: end] for start, end in rows], GreedyIds(graph.host_greedy, rows, graph.copied)

    def _replay(self, steps: list[StepInput]) -> tuple[_Graph, int]:
        b = _bucket(self._config.batch_buckets, len(steps))
        q = _bucket(self._config.query_buckets, max(len(s.token_ids) for s in steps))
        graph = self._graphs[(b, q)]
        graph.inputs.fill(steps)
        graph.graph.replay()
        self.num_replays += 1
        return graph, q

    def can_prefill(self, steps: list[StepInput]) -> bool:
        """Whether `steps` are prefill chunks (at most one logit each) the prefill graphs take."""
        return (bool(self._prefills) and len(steps) <= MAX_PREFILL_REPLAYS
                and all(s.num_logits <= 1 and len(s.token_ids) <= self._prefill_buckets[-1] for s in steps))

    def prefill(self, step: StepInput) -> torch.Tensor:
        """Replays the bucket's prefill graph for a chunk whose KV slots are reserved; its [num_logits,
        vocab] logits, a copy (the next replay of the bucket overwrites the graph's)."""
        graph = self._prefills[_bucket(self._prefill_buckets, len(step.token_ids))]
        graph.inputs.fill([step], extra=[[len(step.token_ids) - 1]])  # the row of the chunk's last token
        graph.graph.replay()
        self.num_prefill_replays += 1
        return graph.logits[: step.num_logits].clone()

    def _capture_prefill(self, q: int) -> _Graph:
        inputs = StaticInputs(1, q, self._max_blocks, self._kv.block_size, self._device, num_extra=1)
        batch = dataclasses.replace(inputs.batch, logits_indices=inputs.extra[0])
        with self._model.fallback_stages():
            graph, logits = capture(lambda: self._model(batch, self._kv, self._attention), self._pool)
        self.num_captures += 1
        return _Graph(graph, inputs, logits)

    def _capture(self, b: int, q: int) -> _Graph:
        inputs = StaticInputs(b, q, self._max_blocks, self._kv.block_size, self._device)

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            logits = self._model(inputs.batch, self._kv, self._attention)
            return logits, logits.argmax(-1)

        graph, (logits, greedy) = capture(step, self._pool)
        self.num_captures += 1
        return _Graph(graph, inputs, logits, greedy, torch.empty_like(greedy, device="cpu", pin_memory=True),
                      torch.cuda.Event())


class StaticInputs:
    """The input buffers of a captured step: b sequences of q tokens, initialised as all padding.

    The device tensors of `batch` are views of one flat buffer (int64: token ids, positions, slots;
    then int32: context lengths, block tables), filled from its host mirror (pinned on CUDA) in one
    copy: a step's host work is a few numpy writes, not a dozen tensor ops and copies. `num_extra`
    more int64 rows of b values ride along for the caller (`extra`: device; written by `fill(steps,
    extra)`, after the one wait for the last copy).
    """

    def __init__(self, b: int, q: int, max_blocks: int, block_size: int, device: torch.device,
                 num_extra: int = 0) -> None:
        self.q = q
        self._scratch = SCRATCH_BLOCK * block_size
        num_long, num_int = 3 * b * q + num_extra * b, b + b * max_blocks
        self._host = torch.zeros(8 * num_long + 4 * num_int, dtype=torch.uint8, pin_memory=device.type == "cuda")
        host_long, host_int = _long_and_int(self._host, num_long)
        self._long = host_long[: 3 * b * q].view(3, b * q).numpy()
        self._host_extra = host_long[3 * b * q:].view(num_extra, b).numpy()
        self._context_lens = host_int[:b].numpy()
        self._block_tables = host_int[b:].view(b, max_blocks).numpy()
        self._fill_padding()
        self._device = self._host.to(device)
        device_long, device_int = _long_and_int(self._device, num_long)
        self.extra = device_long[3 * b * q:].view(num_extra, b)
        # recorded after each copy: the next fill waits for it before writing the host mirror (an event
        # never recorded is waited for at once)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self.batch = ForwardBatch(
            input_ids=device_long[: b * q],
            positions=device_long[b * q: 2 * b * q],
            slot_mapping=device_long[2 * b * q: 3 * b * q],
            cu_seqlens_q=list(range(0, b * q + 1, q)),
            cu_seqlens_q_t=torch.arange(0, b * q + 1, q, dtype=torch.int32, device=device),
            context_lens=device_int[:b],
            block_tables=device_int[b:].view(b, max_blocks),
            max_num_q=q,
            logits_indices=None,  # every row
        )

    def fill(self, steps: list[StepInput], extra: list[list[int]] | None = None) -> None:
        """Writes the steps (KV slots reserved), padding to q tokens and b sequences, and the `extra`
        rows (b values each); then copies it all to the device.

        Pad tokens write their K/V into the scratch block and only pad queries attend to them.
        """
        self.wait_for_copy()
        if extra is not None:
            self._host_extra[:] = extra
        self._fill_padding()
        q, tokens = self.q, self._long
        for i, step in enumerate(steps):
            n, start = len(step.token_ids), step.kv.num_tokens
            tokens[0, i * q: i * q + n] = step.token_ids
            tokens[1, i * q: i * q + n] = range(start, start + n)
            tokens[2, i * q: i * q + n] = step.kv.slots(start, n)
            self._context_lens[i] = start + q  # the real queries keep their positions (see module doc)
            self._block_tables[i, : len(step.kv.block_table)] = step.kv.block_table
        self._device.copy_(self._host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def wait_for_copy(self) -> None:
        """Before writing the host mirror: the previous step's copy has read it."""
        if self._copied is not None:
            self._copied.synchronize()

    def _fill_padding(self) -> None:
        self._long[:2] = 0
        self._long[2] = self._scratch
        self._context_lens[:] = self.q  # pad sequences: q pad queries over the scratch block
        self._block_tables[:] = SCRATCH_BLOCK


def _long_and_int(flat: torch.Tensor, num_long: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The int64 and int32 views of a StaticInputs byte buffer: `num_long` int64 values, then int32s."""
    return flat[: 8 * num_long].view(torch.long), flat[8 * num_long:].view(torch.int32)


def capture(fn: Callable[[], T], pool: tuple) -> tuple[torch.cuda.CUDAGraph, T]:
    """Warms `fn` up (compiling Triton kernels), then captures it; returns its static output. Both on one side stream of
    the process, as `capture_begin`/`capture_end`: not in `torch.cuda.graph`, whose every entry synchronizes the
    device and empties PyTorch's device and pinned-host caches - a draft's load captures 100+ graphs while the
    service's other draft serves, and each `cudaFree` of an emptied cache waits for that draft's forwards too. Callers
    give the warm-ups' temporaries back once, after their last capture (release_cached_gpu_memory)."""
    stream = capture_stream(torch.cuda.current_device())
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()
        # thread_local: CUDA calls of other threads (another model serving meanwhile) do not void the capture
        graph.capture_begin(pool, capture_error_mode="thread_local")
        try:
            out = fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, out


def release_cached_gpu_memory() -> None:
    """Gives the GPU back the memory PyTorch's caching allocator keeps from freed tensors (a stopped model's weights,
    KV pool and graph pools; the capture warm-ups' temporaries), for other processes and later loads; a no-op without
    CUDA. It frees device memory, so it synchronizes the device (a stall of the work in flight, once) and must not run
    while this process captures a graph on another thread: the caller keeps captures out (the draft service's loads and
    releases take turns)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@functools.cache
def capture_stream(device_index: int) -> torch.cuda.Stream:
    """The side stream every capture of the process warms up and captures on. One, not a new torch.cuda.Stream() a
    capture: PyTorch keeps a cuBLAS workspace (32 MiB on Hopper) for each (thread's cuBLAS handle, stream) pair a
    product has run on, until the process ends, and new streams come round-robin from a pool of 32 - a loading
    thread's warm-ups took them all, about 1 GiB (bench/draft_memory.py). Sharing it only orders work: a capture
    waits for its thread's stream, and that stream for the capture's warm-up."""
    return torch.cuda.Stream(device_index)


def _logit_rows(steps: list[StepInput], q: int) -> list[tuple[int, int]]:
    """Each step's logit rows in a replay padded to q tokens a sequence: its last num_logits tokens."""
    return [(i * q + len(s.token_ids) - s.num_logits, i * q + len(s.token_ids)) for i, s in enumerate(steps)]


def _bucket(buckets: tuple[int, ...], n: int) -> int:
    return buckets[bisect.bisect_left(buckets, n)]
