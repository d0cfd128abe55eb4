"""Where the host time of one engine call goes: a verify of the 8B-shape target, a k = 4 proposal of
the 1B-shape draft, each driven through its engine on an asyncio loop as the servicers do (no gRPC).

Per call: the engine call's wall time, the worker's `_process`, and the CUDA graph's device time
alone; then cProfile over the calls, the functions by own time. bf16 random weights, one sequence,
prompt 128, the services' layer kernels (target fused, draft auto). Writes bench/results/host_profile.json
and the profiles as text beside it (`--profiles DIR`).
Usage: python bench/host_profile.py [--tiny] [--calls 200] [--profiles DIR] [--out PATH]
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

from gpu_e2e import LLAMA_1B, LLAMA_8B, TINY  # noqa: E402
from report import save_report  # noqa: E402
from timing import cuda_ms  # noqa: E402
from tiny_models import build_tokenizer  # noqa: E402

from engine.gpu_work import run_to_end  # noqa: E402
from engine.model_drafter import ModelDrafter  # noqa: E402
from engine.model_runner import ModelRunner, RuntimeConfig  # noqa: E402
from engine.model_source import LoadedModel  # noqa: E402
from engine.target_engine import TargetEngine  # noqa: E402

PROMPT = 128
NEW_TOKENS = 64  # room a sequence asks for: every call goes back to the prompt


def build_runner(shape: dict, layer_kernels: str, device: str) -> ModelRunner:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=dtype).eval()
    config = RuntimeConfig(model="random", device=device, dtype=str(dtype).removeprefix("torch."), max_model_len=1024,
                           kv_cache_tokens=16 * 1024, layer_kernels=layer_kernels)
    return ModelRunner(config, loaded=LoadedModel("random", hf, build_tokenizer()))


def timed_process(owner) -> list[int]:
    """Wraps `owner._process` (already bound in its batching loop) to collect its wall times, ns."""
    times: list[int] = []
    loop = owner._loop
    inner = loop._process

    def process(jobs):
        start = time.perf_counter_ns()
        try:
            return run_to_end(inner(jobs))  # its GPU waits block (engine/gpu_work.py)
        finally:
            times.append(time.perf_counter_ns() - start)

    loop._process = process
    return times


def profile_text(profiler: cProfile.Profile, sort: str, limit: int = 30) -> str:
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats(sort).print_stats(limit)
    return out.getvalue()


async def target_calls(engine: TargetEngine, calls: int) -> tuple[list[int], cProfile.Profile]:
    seq, _, _ = await engine.prefill(list(range(3, 3 + PROMPT)), NEW_TOKENS)
    walls = []
    profiler = cProfile.Profile()
    for i in range(2 * calls):
        drafts = [5, 6, 7, 8]
        if i == calls:
            profiler.enable()
        start = time.perf_counter_ns()
        await engine.verify(seq, drafts)
        walls.append(time.perf_counter_ns() - start)
        seq.token_ids[:] = seq.token_ids[:PROMPT + 1]  # stay at prompt length: every call alike
        seq.kv.truncate(PROMPT)
    profiler.disable()
    engine.release(seq)
    return walls[:calls], profiler


async def draft_calls(drafter: ModelDrafter, calls: int) -> tuple[list[int], cProfile.Profile]:
    seq = await drafter.start(list(range(3, 3 + PROMPT)), NEW_TOKENS)
    walls = []
    profiler = cProfile.Profile()
    await drafter.propose(seq, 0, [9], 4)
    for i in range(2 * calls):
        if i == calls:
            profiler.enable()
        start = time.perf_counter_ns()
        await drafter.propose(seq, 0, [9], 4)  # none accepted, then the target's token
        walls.append(time.perf_counter_ns() - start)
        del seq.token_ids[PROMPT:]  # back to the prompt: every call alike
        seq.num_proposed = 0
        seq.kv.truncate(PROMPT)
    profiler.disable()
    drafter.release(seq)
    return walls[:calls], profiler


def summary(name: str, walls: list[int], processes: list[int], replay_ms: float) -> dict[str, float]:
    wall, process = statistics.median(walls) / 1e6, statistics.median(processes) / 1e6
    return {f"{name}_call_ms": wall, f"{name}_process_ms": process, f"{name}_handoff_ms": wall - process,
            f"{name}_graph_ms": replay_ms, f"{name}_host_ms": process - replay_ms}


async def run(args: argparse.Namespace) -> dict[str, float]:
    metrics: dict[str, float] = {}
    texts: dict[str, str] = {}
    device = "cpu" if args.tiny else "cuda"
    runner = build_runner(TINY if args.tiny else LLAMA_8B, "reference" if args.tiny else "fused", device)
    engine = TargetEngine(runner)
    processes = timed_process(engine)
    engine.start()
    walls, profiler = await target_calls(engine, args.calls)
    replay = cuda_ms(runner.graphs._graphs[(1, 5)].graph.replay, 50) if runner.graphs else 0.0
    metrics.update(summary("verify", walls, processes[1:args.calls + 1], replay))
    print(metrics, flush=True)
    texts["verify"] = profile_text(profiler, "tottime") + profile_text(profiler, "cumulative")
    save_profiles(args.profiles, texts)
    await engine.stop()
    del engine, runner
    if device == "cuda":
        torch.cuda.empty_cache()
    runner = build_runner(TINY if args.tiny else LLAMA_1B, "auto", device)
    drafter = ModelDrafter(runner)
    processes = timed_process(drafter)
    drafter.start_background()
    walls, profiler = await draft_calls(drafter, args.calls)
    loops = [loop for shape, loop in drafter.draft_loop._loops.items() if shape[0] == 1]
    replay = min((cuda_ms(lambda loop=loop: loop.run(4), 20) for loop in loops if loop.graphs), default=0.0)
    metrics.update(summary("propose", walls, processes[2:args.calls + 2], replay))
    texts["propose"] = profile_text(profiler, "tottime") + profile_text(profiler, "cumulative")
    await drafter.stop()
    save_profiles(args.profiles, texts)
    return metrics


def save_profiles(directory: Path | None, texts: dict[str, str]) -> None:
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in texts.items():
            (directory / f"{name}.txt").write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU: checks the script only")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--profiles", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "host_profile.json")
    args = parser.parse_args()
    save_report("host_profile", asyncio.run(run(args)), args.out)


if __name__ == "__main__":
    main()
