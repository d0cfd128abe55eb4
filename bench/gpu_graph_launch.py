"""H200: what a CUDA graph's launch costs the host, and what of a draft proposal is not the device's.

Earlier runs saw a 1B decode graph's `replay()` hold the host 4.6 us in a fresh process but 43-90 us
after more runners had captured graphs in it (bench/results/gpu_draft_forward_int8down.json), and
that time was on the critical path (replay to the end of its work grew by as much). Two parts:

* synthetic: a graph of `--kernels` tiny Triton kernels (with and without PDL); its launch's host
  time from an idle device, then again after the process holds more such graphs (`--counts`), in
  the same memory pool and in pools of their own. Says whether the count of graphs, the pool or PDL
  makes a launch slow.
* draft: the served 1B draft (int8 wide products, 32k head, PDL, split down projection, QKV +
  rotary; bench/gpu_draft_forward.py's builder), a k = 4 greedy proposal at batch 1 cut in host
  phases (`_propose_graphed`'s fill, the step graphs' launches, the read-back's wait and
  conversion) against the device's span (CUDA events around the replays); then the decode graph's
  launch before and after the full draft loop's graphs (every batch bucket, as the service
  captures) are captured, and after they are dropped.

Usage: python bench/gpu_graph_launch.py [--kernels 134] [--counts 0 8 32 128 512] [--out PATH]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

import gpu_draft_forward  # noqa: E402
from engine.batch import StepInput  # noqa: E402
from engine.cuda_graphs import capture  # noqa: E402
from engine.draft_loop import DraftLoop, LoopConfig  # noqa: E402
from engine.model_runner import GraphConfig  # noqa: E402
from gpu_e2e import LLAMA_1B  # noqa: E402
from report import save_report  # noqa: E402
from timing import cuda_ms, idle_launch_ms, prefilled_sequences  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402


@triton.jit
def _bump(x_ptr, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    i = tl.arange(0, 128)
    tl.store(x_ptr + i, tl.load(x_ptr + i) + 1)


def launch_us(replay, iters: int = 200) -> tuple[float, float]:
    """Median host time of `replay()` from an idle device, and median time to the end of its work (us)."""
    call, total = idle_launch_ms(replay, iters, statistics.median)
    return 1e3 * call, 1e3 * total


def chain_graph(x: torch.Tensor, kernels: int, pdl: bool, pool) -> torch.cuda.CUDAGraph:
    options = {"USE_PDL": True, "launch_pdl": True} if pdl else {"USE_PDL": False}
    return capture(lambda: [_bump[(1,)](x, **options) for _ in range(kernels)], pool)[0]


def synthetic(kernels: int, counts: list[int]) -> dict[str, float]:
    metrics = {}
    for pdl in (False, True):
        for shared in (True, False):
            name = f"{'pdl' if pdl else 'plain'}_{'shared_pool' if shared else 'own_pools'}"
            x = torch.zeros(128, device="cuda")
            pool = torch.cuda.graph_pool_handle()
            graphs = [chain_graph(x, kernels, pdl, pool)]
            for count in counts:
                while len(graphs) < count + 1:
                    graphs.append(chain_graph(x, kernels, pdl, pool if shared else torch.cuda.graph_pool_handle()))
                call, total = launch_us(graphs[0].replay)
                metrics[f"{name}:launch_host_us_with_{count}_more"] = call
                metrics[f"{name}:idle_replay_us_with_{count}_more"] = total
                print(name, count, round(call, 1), round(total, 1), flush=True)
            del graphs
            gc.collect()
            torch.cuda.synchronize()
    return metrics


def draft(prompt: int, orders: list[str]) -> dict[str, float]:
    gpu_draft_forward.model_runner.GraphConfig = lambda: GraphConfig(batch_buckets=(1, 8), query_buckets=(1, 2, 5))
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA_1B), dtype=torch.bfloat16).eval()
    runner = gpu_draft_forward.build(hf, gpu_draft_forward.settings("int8_32k_pdl_split4_qkvrope"))
    seqs = prefilled_sequences(runner, torch.Generator().manual_seed(0), 1, prompt)
    kv = seqs[0]
    runner.forward([StepInput(kv, [100], 1)])
    kv.truncate(prompt)
    decode = runner.graphs._graphs[(1, 1)].graph.replay
    metrics = {"decode_replay_us": 1e3 * cuda_ms(decode, 200)}
    metrics["decode_launch_host_us_runner_only"], metrics["decode_idle_replay_us_runner_only"] = launch_us(decode)

    k = 4
    small = DraftLoop(runner, LoopConfig(batch_buckets=(1,), max_steps=k, first_query_buckets=(1,)))
    metrics.update(propose_phases(small, kv, prompt, k, "small_loop"))
    del small
    for order in orders:
        full = FullLoop(runner, order)  # every bucket, as the draft service captures (largest first)
        metrics["draft_loop_graphs"] = sum(len(loop.graphs) for loop in full._loops.values())
        metrics[f"decode_launch_host_us_{order}"], metrics[f"decode_idle_replay_us_{order}"] = launch_us(decode)
        metrics.update(propose_phases(full, kv, prompt, k, order))
        del full
        gc.collect()
        torch.cuda.synchronize()
    metrics["decode_launch_host_us_loop_dropped"], metrics["decode_idle_replay_us_loop_dropped"] = launch_us(decode)
    return metrics


class FullLoop(DraftLoop):
    """The service's DraftLoop (every bucket), its graphs captured in another order or pools."""

    def __init__(self, runner, order: str) -> None:
        self._order = order
        super().__init__(runner)

    def _capture_all(self) -> None:
        shapes = self._shapes()
        if self._order == "smallest_first":
            shapes.reverse()
        for shape in shapes:
            pool = torch.cuda.graph_pool_handle() if self._order == "pool_per_bucket" else self._pool
            loop = self._build(*shape)
            for step in loop.steps:
                loop.graphs.append(capture(step, pool)[0])
            self._loops[shape] = loop


def propose_phases(draft_loop, kv, prompt: int, k: int, name: str, iters: int = 200) -> dict[str, float]:
    """A batch-1 greedy proposal's host phases (median us) against its device span, and its wall ms
    through `propose` as served."""
    phases: dict[str, list[float]] = {p: [] for p in ("fill_us", "launches_us", "readback_us", "total_us", "device_span_us")}
    loop = draft_loop._loops[(1, 1, False)]
    start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(iters + 10):
        steps = [StepInput(kv, [7], 1)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for s in steps:
            s.kv.reserve(len(s.token_ids) + k - 1)
        loop.inputs.fill(steps, extra=[[0], [kv.num_tokens]])
        t1 = time.perf_counter()
        start_event.record()
        loop.run(k)
        end_event.record()
        t2 = time.perf_counter()
        tokens = loop.read(k)[0][:, :1].T.tolist()
        t3 = time.perf_counter()
        kv.commit(k)
        kv.truncate(prompt)
        assert len(tokens[0]) == k
        if i >= 10:
            for phase, value in (("fill_us", t1 - t0), ("launches_us", t2 - t1), ("readback_us", t3 - t2),
                                 ("total_us", t3 - t0), ("device_span_us", start_event.elapsed_time(end_event) / 1e3)):
                phases[phase].append(1e6 * value)
    metrics = {f"{name}:propose_k4_{phase}": statistics.median(values) for phase, values in phases.items()}
    metrics[f"{name}:propose_k4_outside_device_us"] = metrics[f"{name}:propose_k4_total_us"] - metrics[f"{name}:propose_k4_device_span_us"]
    walls = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        draft_loop.propose([StepInput(kv, [7], 1)], [k])
        walls.append(time.perf_counter() - start)
        kv.truncate(prompt)
    metrics[f"{name}:propose_k4_wall_ms"] = 1e3 * statistics.median(walls)
    print(name, {key: round(v, 2) for key, v in metrics.items()}, flush=True)
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", type=int, default=134, help="kernels a synthetic graph (a 1B decode's count)")
    parser.add_argument("--counts", type=int, nargs="+", default=[0, 8, 32, 128, 512])
    parser.add_argument("--prompt", type=int, default=192)
    parser.add_argument("--skip-synthetic", action="store_true")
    parser.add_argument("--skip-draft", action="store_true")
    parser.add_argument("--orders", nargs="*", default=["largest_first", "smallest_first", "pool_per_bucket"],
                        help="capture orders of the service's full draft loop to measure (none: the small loop only)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_graph_launch.json")
    args = parser.parse_args()
    metrics: dict[str, float] = {}
    if not args.skip_draft:  # first: a process that has captured nothing else
        metrics.update(draft(args.prompt, args.orders))
        save_report("gpu_graph_launch", metrics, args.out)
    if not args.skip_synthetic:
        metrics.update(synthetic(args.kernels, args.counts))
    save_report("gpu_graph_launch", metrics, args.out)


if __name__ == "__main__":
    main()
