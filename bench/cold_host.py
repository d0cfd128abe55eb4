"""How a step's host work slows after an idle gap, and whether rehearsing it in the gap keeps it fast.

In the trio a service's host work runs once a step, after a gap of a few milliseconds in which the other
service computes (bench/step_trace.py on the H200: the target's Python before and after its forward ran
~1.6x slower in speculative steps, 3.5 ms apart, than in target-only ones, 0.3 ms apart). This times a
fixed piece of the target's per-step host work - a verify command parsed, its StepInput, the KV
reservation, StaticInputs' host writes (no device: `device` cpu), a tiny torch op, the answer built and
serialized - after gaps of each length spent in a busy wait (as a polling event loop spends them), and
after 3.5 ms gaps in which the same work runs on scratch objects every `--every-ms` (a rehearsal, what a
polling loop could do). Medians (and p10/p90) in us over many repetitions. CPU only; any host.
Usage: python bench/cold_host.py [--every-ms 0.5] [--out PATH]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from engine.batch import StepInput  # noqa: E402
from engine.cuda_graphs import StaticInputs  # noqa: E402
from engine.kv_cache import KVCacheConfig, KVPool  # noqa: E402
from report import save_report  # noqa: E402
from specdec.v1 import target_pb2  # noqa: E402

GAPS_MS = (0.1, 0.3, 1.0, 2.0, 3.5, 5.0, 8.0)
CONTEXT, DRAFTS, MAX_BLOCKS = 700, 4, 96


def step_work() -> Callable[[], None]:
    """One step's host work on objects of its own (call it again for scratch ones)."""
    pool = KVPool(KVCacheConfig(256, 16), 1, 1, 8, torch.float32, torch.device("cpu"))
    kv = pool.new_sequence()
    kv.reserve(CONTEXT)
    kv.commit(CONTEXT)
    inputs = StaticInputs(1, DRAFTS + 1, MAX_BLOCKS, 16, torch.device("cpu"))
    request = target_pb2.TargetRequest(verify=target_pb2.VerifyCommand(draft_ids=range(DRAFTS))).SerializeToString()
    scratch = torch.zeros(8)

    def work() -> None:
        command = target_pb2.TargetRequest.FromString(request)
        draft_ids = list(command.verify.draft_ids)
        step = StepInput(kv, [7, *draft_ids], num_logits=DRAFTS + 1)
        kv.reserve(len(step.token_ids))
        inputs.fill([step])
        scratch.add_(1)
        kv.truncate(CONTEXT)
        answer = target_pb2.TargetResponse(verify=target_pb2.VerifyResult(num_accepted_draft_tokens=2,
                                                                          committed_ids=draft_ids[:3]))
        answer.SerializeToString()

    return work


def busy_wait(ms: float, rehearse: Callable[[], None] | None = None, every_ms: float = 0.5) -> None:
    end = time.perf_counter() + ms / 1e3
    next_rehearsal = time.perf_counter() + every_ms / 1e3
    while (now := time.perf_counter()) < end:
        if rehearse is not None and now >= next_rehearsal:
            rehearse()
            next_rehearsal = now + every_ms / 1e3


def timed_after(gap_ms: float, work: Callable[[], None], rehearse: Callable[[], None] | None, every_ms: float,
                total_ms: float = 1500.0) -> dict[str, float]:
    samples = []
    for _ in range(max(100, int(total_ms / gap_ms))):
        busy_wait(gap_ms, rehearse, every_ms)
        start = time.perf_counter_ns()
        work()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    samples.sort()
    return {"p10_us": samples[len(samples) // 10], "median_us": statistics.median(samples),
            "p90_us": samples[9 * len(samples) // 10]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every-ms", type=float, default=0.5, help="a rehearsal this often within a gap")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cold_host.json")
    args = parser.parse_args()
    work, rehearse = step_work(), step_work()
    for _ in range(1000):  # warm-up: imports, allocator, first-call paths
        work()
    metrics: dict[str, object] = {}
    for round_ in (1, 2):  # twice, interleaved: the host's state drifts
        for gap in GAPS_MS:
            metrics[f"gap{gap:g}ms_run{round_}"] = timed_after(gap, work, None, args.every_ms)
        metrics[f"gap3.5ms_rehearsed_run{round_}"] = timed_after(3.5, work, rehearse, args.every_ms)
    save_report("cold_host", metrics, args.out, note=f"rehearsal every {args.every_ms} ms on scratch objects")


if __name__ == "__main__":
    main()
