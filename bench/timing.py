"""Device-side timing shared by the GPU benchmarks."""
from __future__ import annotations

import statistics
import time
from collections import defaultdict
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


def idle_launch_ms(fn: Callable[[], object], iters: int = 100,
                   statistic: Callable[[list[float]], float] = statistics.mean) -> tuple[float, float]:
    """Milliseconds of `fn` started on an idle device, their mean (or `statistic`): (host time of the
    call, the call to the end of its work). Against cuda_ms's back-to-back time, the second shows what
    a synced caller pays. A mean takes in the host's outliers; a median shows the usual call."""
    fn()
    calls, totals = [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        called = time.perf_counter()
        torch.cuda.synchronize()
        calls.append(called - start)
        totals.append(time.perf_counter() - start)
    return 1e3 * statistic(calls), 1e3 * statistic(totals)


def kernel_census(fn: Callable[[], object], host_ops: int = 0) -> dict[str, float]:
    """Kernels of one call of `fn` (after a warm-up call): count, summed device time against their
    span, the costliest names; with `host_ops`, that many costliest host ops by self time too."""
    fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if host_ops else [])
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        return {"kernels": 0}
    by_name: dict[str, float] = defaultdict(float)
    for e in kernels:
        by_name[e.name[:60]] += e.device_time_total / 1e3
    start = min(e.time_range.start for e in kernels)
    end = max(e.time_range.end for e in kernels)
    census = {"kernels": len(kernels), "kernel_ms": sum(by_name.values()), "span_ms": (end - start) / 1e3}
    for name, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:8]:
        census[f"top:{name}"] = ms
    host = sorted(prof.key_averages(), key=lambda r: -r.self_cpu_time_total)[:host_ops] if host_ops else []
    for row in host:
        census[f"host_self_ms:{row.key[:60]}"] = row.self_cpu_time_total / 1e3
        census[f"host_calls:{row.key[:60]}"] = row.count
    return census


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
        # the loop's k step graphs replayed back to back: their device time, without the host's fill and sync
        def replay(device_loop=loop._loops[(batch, 1, False)]) -> None:
            device_loop.run(k)

        metrics[f"loop_replay_ms_k{k}_bs{batch}"] = cuda_ms(replay, iters)
        launch, total = idle_launch_ms(replay)
        metrics[f"loop_launch_host_ms_k{k}_bs{batch}"], metrics[f"loop_idle_replay_ms_k{k}_bs{batch}"] = launch, total
        if batch == batches[0]:
            census = kernel_census(replay)
            metrics.update({f"loop_{key}_bs{batch}": census[key] for key in ("kernels", "kernel_ms", "span_ms")})
    return metrics


def decode_logits(runner, kv, gen: torch.Generator, positions: int, prompt_len: int) -> torch.Tensor:
    """[positions, vocab] float32 logits of decode steps (graph replays) along a random continuation of
    `kv`, rolled back to `prompt_len` after: to compare the numerics of two builds of a model."""
    from engine.batch import StepInput

    continuation = torch.randint(3, 30000, (positions,), generator=gen).tolist()
    logits = torch.cat([runner.forward([StepInput(kv, [t], 1)])[0].float() for t in continuation])
    kv.truncate(prompt_len)
    return logits
