"""What loading a draft does to the draft serving beside it, in one process: the draft's own side of
bench/gpu_swap.py, without the 8B target, the gateway or gRPC, in a fraction of that benchmark's device time (whose
trio start alone took over 200 s on an H100).

bench/gpu_e2e.py's 1B-shape draft (bf16, CUDA; `--tiny`: the tiny one on the CPU, a check of the script) in a
DraftRegistry built as the draft service builds it. `--streams` sequences propose k = 4 tokens one proposal after
another on the default draft (every proposal accepted and one committed token appended, so each step extends the
KV by k + 1; a sequence at its end starts again), while the default is replaced by the same model `--loads` times
(a full load, quantization and graph capture on the new draft's own thread, as LoadDraft with replace does; each
old draft stopped and released before the next load). Each proposal's latency belongs to the window it ends in:
`idle` (before the first load) or `during` (a load running).

Metrics: load_s (each load's seconds), load_s_median; proposals_per_s_idle / _during, propose_ms_p50_idle /
_during, propose_ms_p99_idle / _during, propose_ms_max_idle / _during. A change to loading (engine/cuda_graphs.py's
capture) is measured against its parent by running this same script in a `git worktree` of the parent as well.
Usage: python bench/draft_load.py [--tiny] [--streams 8] [--loads 2] [--idle-s 10] [--draft-quantize none|int8|w8a8]
                                  [--draft-head-rows N] [--stages kernels|compiled|eager] [--out PATH]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

from draft_memory import NAME, draft_config  # noqa: E402
from gpu_e2e import bench_models  # noqa: E402
from report import save_report  # noqa: E402
from soak import percentile  # noqa: E402

from draft_service.registry import DraftRegistry, model_loader  # noqa: E402
from engine.model_runner import RuntimeConfig  # noqa: E402

K = 4
MAX_NEW_TOKENS = 128


async def propose_steadily(drafts: DraftRegistry, prompt_ids: list[int], done: asyncio.Event,
                           ends: list[tuple[float, float]]) -> None:
    """One stream: sequences on the default draft, proposing until `done`; (end time, seconds) per proposal."""
    while not done.is_set():
        lease = drafts.acquire("")
        seq = await lease.drafter.start(prompt_ids, MAX_NEW_TOKENS)
        try:
            num_accepted, committed = 0, len(prompt_ids)
            while not done.is_set() and committed + 1 + K <= len(prompt_ids) + MAX_NEW_TOKENS:
                started = time.perf_counter()
                # the committed token: the sequence's last again (any in-vocabulary id: the draft's work is the same)
                proposal, _ = await lease.drafter.propose(seq, num_accepted, seq.token_ids[-1:], K)
                ended = time.perf_counter()
                ends.append((ended, ended - started))
                num_accepted, committed = len(proposal), committed + 1 + len(proposal)
        finally:
            lease.drafter.release(seq)
            drafts.release(lease)


async def load_beside_streams(config: RuntimeConfig, model: str, prompt_ids: list[list[int]], streams: int, loads: int,
                              idle_s: float) -> dict:
    drafts = DraftRegistry(model_loader(config))
    _, took = await drafts.load(NAME, model, make_default=True)
    print(f"first load (no streams): {took:.1f} s", flush=True)
    drafts.start()
    done, ends = asyncio.Event(), []
    tasks = [asyncio.create_task(propose_steadily(drafts, prompt_ids[i % len(prompt_ids)], done, ends))
             for i in range(streams)]
    try:
        await asyncio.sleep(idle_s / 2)  # warm: the streams' first proposals and buckets
        idle_start = time.perf_counter()
        await asyncio.sleep(idle_s)
        windows = {"idle": [(idle_start, time.perf_counter())], "during": []}
        seconds = []
        for _ in range(loads):
            started = time.perf_counter()
            _, took = await drafts.load(NAME, model, make_default=True, replace=True)
            windows["during"].append((started, time.perf_counter()))
            seconds.append(took)
            print(f"load {len(seconds)} beside {streams} streams: {took:.1f} s", flush=True)
            await drafts.retired()
    finally:
        done.set()
        await asyncio.gather(*tasks)  # a stream's error fails the run
        await drafts.stop()
    metrics = {"streams": streams, "load_s": [round(s, 3) for s in seconds],
               "load_s_median": statistics.median(seconds)}
    for name, spans in windows.items():
        metrics.update(window_metrics(name, spans, ends))
    return metrics


def window_metrics(name: str, spans: list[tuple[float, float]], ends: list[tuple[float, float]]) -> dict:
    """The proposals that ended within `spans`: how many a second, their latency's p50, p99 and max (ms)."""
    took = sorted(seconds for end, seconds in ends if any(start <= end < stop for start, stop in spans))
    span_s = sum(stop - start for start, stop in spans)
    at = (lambda q: 1e3 * percentile(took, q)) if took else (lambda q: None)
    return {f"proposals_per_s_{name}": len(took) / span_s, f"propose_ms_p50_{name}": at(0.5),
            f"propose_ms_p99_{name}": at(0.99), f"propose_ms_max_{name}": at(1.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU: checks the script only")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--loads", type=int, default=2)
    parser.add_argument("--idle-s", type=float, default=10.0, help="proposals timed before the first load")
    parser.add_argument("--draft-quantize", choices=["none", "int8", "w8a8"], default="none")
    parser.add_argument("--draft-head-rows", type=int, default=None)
    parser.add_argument("--stages", choices=["kernels", "compiled", "eager"], default="compiled")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "draft_load.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="specdec-draft-load-") as tmp:
        models = bench_models(Path(tmp), args.tiny, args.draft_head_rows, 8, 128, MAX_NEW_TOKENS,
                              with_target=False)
        config = draft_config(args, models.draft, models.service_flags)
        metrics = asyncio.run(load_beside_streams(config, models.draft, models.prompt_ids, args.streams,
                                                  args.loads, args.idle_s))
    save_report("draft_load", metrics, args.out)


if __name__ == "__main__":
    main()
