"""Device-side timing shared by the GPU benchmarks."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch


def cuda_ms(fn: Callable[[], object], iters: int = 20) -> float:
    """Mean milliseconds of `fn` on the current stream, by CUDA events, after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def prefilled_sequences(runner, gen: torch.Generator, count: int, prompt_len: int) -> list:
    """`count` sequences of `runner`'s KV pool, each prefilled with a random prompt of `prompt_len` tokens."""
    from engine.batch import StepInput

    seqs = [runner.kv.new_sequence() for _ in range(count)]
    for kv in seqs:
        runner.forward([StepInput(kv, torch.randint(3, 30000, (prompt_len,), generator=gen).tolist(), 1)])
    return seqs


def proposal_ms(runner, seqs: list, prompt_len: int, batches: tuple[int, ...] = (1, 8), k: int = 4,
                iters: int = 200) -> dict[str, float]:
    """Wall ms (host sync included) of a greedy k-token proposal through the draft's captured loop
    (engine/draft_loop.py) for the first `batch` of `seqs`, each rolled back to `prompt_len` after."""
    from engine.batch import StepInput
    from engine.draft_loop import DraftLoop, LoopConfig

    loop = DraftLoop(runner, LoopConfig(batch_buckets=batches, max_steps=k, first_query_buckets=(1,)))
    metrics = {}
    for batch in batches:
        def propose(batch: int = batch) -> None:
            loop.propose([StepInput(s, [7], 1) for s in seqs[:batch]], [k] * batch)
            for s in seqs[:batch]:
                s.truncate(prompt_len)

        propose()  # the first call of a bucket
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            propose()
        torch.cuda.synchronize()
        metrics[f"propose_ms_k{k}_bs{batch}"] = (time.perf_counter() - start) * 1e3 / iters
    return metrics


def decode_logits(runner, kv, gen: torch.Generator, positions: int, prompt_len: int) -> torch.Tensor:
    """[positions, vocab] float32 logits of decode steps (graph replays) along a random continuation of
    `kv`, rolled back to `prompt_len` after: to compare the numerics of two builds of a model."""
    from engine.batch import StepInput

    continuation = torch.randint(3, 30000, (positions,), generator=gen).tolist()
    logits = torch.cat([runner.forward([StepInput(kv, [t], 1)])[0].float() for t in continuation])
    kv.truncate(prompt_len)
    return logits
