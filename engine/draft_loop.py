"""The draft's proposal loop: feed each sequence's pending tokens, then extend it greedily.

On CUDA the loop's steps are captured graphs per (batch bucket, first-step query length): the
first forward's, then one per further step j, which feeds step j - 1's pick on the device (the next
positions and KV slots computed from the block table inside the graph) and writes its own into the
static outputs. A k-token proposal for a whole batch replays the first k of them back to back: k
forwards and one host sync. k graphs of one forward, not one graph of k: on the H200 a 1B draft's
541-kernel k = 4 graph took 130 us of host time to launch (its 134-kernel decode graph 5 us) and
finished 3.27 ms after an idle launch, the four step graphs 3.22 ms; a hot-loop proposal took 3.31
ms, 3.40 before (bench/results/gpu_draft_forward_loop.json, gpu_draft_forward_steps.json). And a
step graph serves every k: a bucket captures max_steps forwards, not 1 + 2 + ... + max_steps.
Elsewhere (CPU, or shapes outside the buckets) the same loop runs step by step through
`ModelRunner.forward`.
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.batch import ForwardBatch, StepInput
from engine.cuda_graphs import StaticInputs, buckets_covering, capture, release_cached_gpu_memory
from engine.gpu_work import GpuWork, run_to_end
from engine.kv_cache import SCRATCH_BLOCK
from engine.model_runner import POSITION_HEADROOM, ModelRunner
from engine.progress import progress
from engine.sampling import Distribution, SamplingParams, as_int64, sample_draft


@dataclass(frozen=True)
class LoopConfig:
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    max_steps: int = 8  # proposals longer than this run step by step
    # pending tokens before a proposal: 1 (after a rejection), 2 (all accepted: last draft + bonus)
    first_query_buckets: tuple[int, ...] = (1, 2)
    num_candidates: int = 8  # a sampled proposal's distribution: the draft's top candidates (sent over the wire)

    def for_max_batch(self, max_batch_size: int) -> LoopConfig:
        """Only the batch buckets a proposal for at most `max_batch_size` sequences can take."""
        return dataclasses.replace(self, batch_buckets=buckets_covering(self.batch_buckets, max_batch_size))


@dataclass(frozen=True)
class Proposal:
    token_ids: list[int]
    probs: list[Distribution]  # the distribution each token was drawn from; [] for greedy sequences


@dataclass
class _RowParams:
    """One sampling parameter per batch row, as device tensors (static buffers in a graph)."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    min_p: torch.Tensor
    seed: torch.Tensor

    @classmethod
    def empty(cls, b: int, device: torch.device) -> _RowParams:
        f, i = dict(dtype=torch.float32, device=device), dict(dtype=torch.long, device=device)
        return cls(torch.zeros(b, **f), torch.ones(b, **f), torch.zeros(b, **i), torch.zeros(b, **f), torch.zeros(b, **i))

    def fill(self, params: list[SamplingParams]) -> None:
        pad = [SamplingParams()] * (self.seed.shape[0] - len(params))
        rows = params + pad
        for name in ("temperature", "top_p", "top_k", "min_p"):
            getattr(self, name).copy_(torch.tensor([getattr(r, name) for r in rows]), non_blocking=True)
        self.seed.copy_(torch.tensor([as_int64(r.seed) for r in rows]), non_blocking=True)


@dataclass
class _DeviceLoop:
    inputs: StaticInputs  # of the first forward (the pending tokens)
    params: _RowParams | None  # None: a greedy-only loop
    # [max_steps, b] tokens (+ [max_steps, b, c] candidate ids and q): row j is step j's pick
    outputs: tuple[torch.Tensor, ...]
    steps: list[Callable[[], None]]  # step j: feed pick j - 1 (none for j = 0), forward, write pick j
    # host mirrors of `outputs` (pinned on CUDA): a proposal's rows come back in one copy each and one wait
    host_outputs: tuple[torch.Tensor, ...]
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)  # `steps` captured (CUDA)
    copied: torch.cuda.Event | None = None  # CUDA: recorded after each copy into the host mirrors

    def run(self, k: int) -> None:
        """Steps 0..k-1: replays of their graphs where captured, else the steps themselves."""
        if self.graphs:
            for graph in self.graphs[:k]:
                graph.replay()
        else:
            for step in self.steps[:k]:
                step()

    def start_read(self, k: int) -> torch.cuda.Event | None:
        """Starts copying rows 0..k-1 of each output to the host: contiguous copies into the pinned mirrors
        (not `tolist` on a device view, which adds a gather kernel and a pageable copy); what `read` waits for."""
        for host, out in zip(self.host_outputs, self.outputs):
            host[:k].copy_(out[:k], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        return self.copied

    def read(self, k: int) -> list[np.ndarray]:
        """Rows 0..k-1 of each output on the host, once `start_read`'s copies have ended (one wait)."""
        if self.copied is not None:
            self.copied.synchronize()
        return [host[:k].numpy() for host in self.host_outputs]


class DraftLoop:
    def __init__(self, runner: ModelRunner, config: LoopConfig = LoopConfig(), device_loop: bool | None = None) -> None:
        """`device_loop`: feed proposals back on the device (default: when the runner uses CUDA graphs,
        and then captured); True without graphs runs the same loop uncaptured (tests it on CPU)."""
        if config.max_steps + 2 > POSITION_HEADROOM:
            raise ValueError(f"max_steps {config.max_steps} needs more than the runner's {POSITION_HEADROOM} positions of headroom")
        self._runner = runner
        self._config = config
        self._loops: dict[tuple[int, int, bool], _DeviceLoop] = {}  # (batch bucket, query bucket, sampled)
        self._device_loop = runner.graphs is not None if device_loop is None else device_loop
        self._max_blocks = -(-(runner.max_model_len + config.max_steps + 2) // runner.kv.block_size)
        self.num_forwards = 0
        self.num_sequence_steps = 0
        self.num_graph_replays = 0  # proposals that replayed captured step graphs
        if runner.graphs is not None and self._device_loop:  # CUDA with graphs enabled
            self._pool = torch.cuda.graph_pool_handle()
            self._capture_all()

    def propose(self, steps: list[StepInput], num_tokens: list[int],
                sampling: list[SamplingParams] | None = None) -> list[Proposal]:
        """Feeds each step's tokens, then proposes `num_tokens[i]` tokens for sequence i: its argmax
        (greedy) or a draw from its top candidates under `sampling[i]` (see engine/sampling.py).

        Every proposed token but the last is fed back (its K/V written); the caller reserved nothing.
        """
        return run_to_end(self.propose_work(steps, num_tokens, sampling))

    def propose_work(self, steps: list[StepInput], num_tokens: list[int],
                     sampling: list[SamplingParams] | None = None) -> GpuWork[list[Proposal]]:
        """`propose`, yielding before the device loop's read back (engine/gpu_work.py)."""
        sampling = sampling or [SamplingParams()] * len(steps)
        k = max(num_tokens)
        if self._device_loop and len(steps) <= self._config.batch_buckets[-1] and k <= self._config.max_steps:
            tokens, probs = yield from self._propose_graphed(steps, k, sampling)
        else:
            tokens, probs = self._propose_stepwise(steps, num_tokens, sampling)
        return [Proposal(t[:n], [] if s.is_greedy else p[:n]) for t, p, n, s in zip(tokens, probs, num_tokens, sampling)]

    def _propose_stepwise(self, steps: list[StepInput], num_tokens: list[int], sampling: list[SamplingParams]
                          ) -> tuple[list[list[int]], list[list[Distribution]]]:
        tokens: list[list[int]] = [[] for _ in steps]
        probs: list[list[Distribution]] = [[] for _ in steps]
        active = list(range(len(steps)))
        current = [dataclasses.replace(s, num_logits=1) for s in steps]
        positions = [s.kv.num_tokens + len(s.token_ids) for s in steps]  # of each next proposed token
        while current:
            logits = torch.cat([rows[-1:] for rows in self._runner.forward(current)])
            self.num_forwards += 1
            self.num_sequence_steps += len(current)
            picked = self._pick(logits, [sampling[i] for i in active], [positions[i] + len(tokens[i]) for i in active])
            current, still_active = [], []
            for i, token, dist in zip(active, *picked):
                tokens[i].append(token)
                probs[i].append(dist)
                if len(tokens[i]) < num_tokens[i]:
                    current.append(StepInput(steps[i].kv, [token], num_logits=1))
                    still_active.append(i)
            active = still_active
        return tokens, probs

    def _pick(self, logits: torch.Tensor, sampling: list[SamplingParams], positions: list[int]
              ) -> tuple[list[int], list[Distribution]]:
        if all(s.is_greedy for s in sampling):
            return logits.argmax(-1).tolist(), [([], [])] * len(sampling)
        params = _RowParams.empty(len(sampling), logits.device)
        params.fill(sampling)
        position = torch.tensor(positions, device=logits.device)
        token, ids, q = sample_draft(logits, params.temperature, params.top_p, params.top_k, params.min_p, params.seed,
                                     position, self._config.num_candidates)
        return token.tolist(), list(zip(ids.tolist(), q.tolist()))

    def _propose_graphed(self, steps: list[StepInput], k: int, sampling: list[SamplingParams]
                         ) -> GpuWork[tuple[list[list[int]], list[list[Distribution]]]]:
        q_max = self._config.first_query_buckets[-1]
        long = [s for s in steps if len(s.token_ids) > q_max]
        if long:  # catch up on everything but the last pending token first (rare: after k = 0 steps)
            self._runner.forward([StepInput(s.kv, s.token_ids[:-1], num_logits=0) for s in long])
            self.num_forwards += 1
            steps = [StepInput(s.kv, s.token_ids[-1:], 1) if len(s.token_ids) > q_max else s for s in steps]
        for s in steps:
            s.kv.reserve(len(s.token_ids) + k - 1)
        b = _bucket(self._config.batch_buckets, len(steps))
        q = _bucket(self._config.first_query_buckets, max(len(s.token_ids) for s in steps))
        sampled = not all(s.is_greedy for s in sampling)
        shape = (b, q, sampled)
        if shape not in self._loops:  # only without graphs: captured loops all exist from the start
            self._loops[shape] = self._build(*shape)
        loop = self._loops[shape]
        loop.inputs.fill(steps, extra=[  # each row's last token's row in the step, and its position
            [i * q + len(s.token_ids) - 1 for i, s in enumerate(steps)] + [i * q + q - 1 for i in range(len(steps), b)],
            [s.kv.num_tokens + len(s.token_ids) - 1 for s in steps] + [q - 1] * (b - len(steps))])
        if loop.params is not None:
            loop.params.fill(sampling)
        loop.run(k)
        self.num_graph_replays += bool(loop.graphs)
        yield loop.start_read(k)
        n = len(steps)
        outputs = [out[:, :n].swapaxes(0, 1) for out in loop.read(k)]  # [n, k] (+ [n, k, c]); the host sync
        tokens = outputs[0].tolist()
        probs = [list(zip(ids, q)) for ids, q in zip(outputs[1].tolist(), outputs[2].tolist())] \
            if sampled else [[] for _ in steps]  # per token: (candidate ids, q)
        for s in steps:
            s.kv.commit(len(s.token_ids) + k - 1)
        self.num_forwards += k
        self.num_sequence_steps += k * len(steps)
        return tokens, probs

    def _shapes(self) -> list[tuple[int, int, bool]]:
        """Every loop's (batch bucket, first query bucket, sampled), largest first."""
        c = self._config
        return [(b, q, sampled) for sampled in (False, True) for b in sorted(c.batch_buckets, reverse=True)
                for q in sorted(c.first_query_buckets, reverse=True)]

    def _capture_all(self) -> None:
        c, shapes = self._config, self._shapes()
        with progress(len(shapes) * c.max_steps, "capturing draft-loop CUDA graphs", "graph") as bar:
            for shape in shapes:
                loop = self._build(*shape)
                for step in loop.steps:  # in order: each step's warm-up reads the picks of the one before
                    loop.graphs.append(capture(step, self._pool)[0])
                    bar.update()
                self._loops[shape] = loop
        release_cached_gpu_memory()  # the warm-ups' temporaries (engine/cuda_graphs.py)

    def _build(self, b: int, q: int, sampled: bool) -> _DeviceLoop:
        runner, device, c = self._runner, self._runner.device, self._config
        model, kv, attention, bs = runner.model, runner.kv, runner.attention, runner.kv.block_size
        inputs = StaticInputs(b, q, self._max_blocks, bs, device, num_extra=2)  # logits rows, base positions
        first = dataclasses.replace(inputs.batch, logits_indices=inputs.extra[0])  # both written by every propose
        base = inputs.extra[1]
        step = ForwardBatch(
            input_ids=torch.zeros(b, dtype=torch.long, device=device),
            positions=torch.zeros(b, dtype=torch.long, device=device),
            slot_mapping=torch.full((b,), SCRATCH_BLOCK * bs, dtype=torch.long, device=device),
            cu_seqlens_q=list(range(b + 1)),
            cu_seqlens_q_t=torch.arange(b + 1, dtype=torch.int32, device=device),
            context_lens=torch.full((b,), q, dtype=torch.int32, device=device),
            block_tables=first.block_tables,  # the same tables: filled once per proposal
            max_num_q=1,
            logits_indices=None,  # every row
        )

        params = _RowParams.empty(b, device) if sampled else None
        outputs = (torch.zeros(c.max_steps, b, dtype=torch.long, device=device),)
        if sampled:
            outputs += (torch.zeros(c.max_steps, b, c.num_candidates, dtype=torch.long, device=device),
                        torch.zeros(c.max_steps, b, c.num_candidates, dtype=torch.float32, device=device))
        advance = advance_step_reference
        if model.stages.fused_kernels:  # one Triton kernel, not a dozen small ones a step
            from engine.triton_draft_step import advance_step as advance  # needs triton, as the fused stages do

        def run_step(j: int) -> None:  # proposal j sits at base + 1 + j
            batch = first if j == 0 else step
            if j > 0:  # feed proposal j - 1 at position base + j
                advance(outputs[0][j - 1], base, j, first.block_tables, bs, step)
            if params is None:  # the model's own argmax: a reduced head's without vocabulary-wide logits
                picked = (model(batch, kv, attention, greedy=True),)
            else:
                picked = sample_draft(model(batch, kv, attention), params.temperature, params.top_p, params.top_k,
                                      params.min_p, params.seed, base + 1 + j, c.num_candidates)
            for out, value in zip(outputs, picked):
                out[j].copy_(value)

        pin = device.type == "cuda"
        host_outputs = tuple(torch.empty(out.shape, dtype=out.dtype, pin_memory=pin) for out in outputs)
        return _DeviceLoop(inputs, params, outputs, [functools.partial(run_step, j) for j in range(c.max_steps)],
                           host_outputs, copied=torch.cuda.Event() if pin else None)


def advance_step_reference(token: torch.Tensor, base: torch.Tensor, j: int, block_tables: torch.Tensor,
                           block_size: int, step: ForwardBatch) -> None:
    """`step`'s inputs for feeding `token` at position base + j (engine/triton_draft_step.py in one kernel)."""
    positions = base + j
    block = block_tables.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1)
    step.input_ids.copy_(token)
    step.positions.copy_(positions)
    step.slot_mapping.copy_(block.long() * block_size + positions % block_size)
    step.context_lens.copy_(positions + 1)


def _bucket(buckets: tuple[int, ...], n: int) -> int:
    return buckets[bisect.bisect_left(buckets, n)]
