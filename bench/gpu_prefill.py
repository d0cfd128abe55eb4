"""H200 profile of a prompt's prefill as the services run it: random-weight Llama-3.1-8B (target,
--layer-kernels fused) and Llama-3.2-1B (draft, auto) shapes, bf16, one prompt of `--prompt` tokens.

A prefill is an eager forward (the CUDA graphs serve decodes and verifies): the layers' stages
torch.compile'd, cuBLAS products, the Triton attention. For each shape and variant: the wall time
of a prefill (host sync included) over a few runs, then one under torch.profiler (timing.kernel_census):
its kernels' summed device time and span (the rest of the wall time is the host's), the costliest
kernels and host ops.
Variants: `graphed` (the chunk replays its prefill bucket's CUDA graph, engine/cuda_graphs.py; the stages
torch.compile'd), `graphed_kernels` (as graphed, the stages engine/kernel_stages.py's: no inductor kernels, whose
bits can differ from process to process, bench/gpu_replicas.py), `graphed_eager` (as graphed, the stages in plain
PyTorch), `compiled` (no graph: the eager forward the services ran before), `eager` (no graph, plain PyTorch
stages), `nopdl` (compiled, the Triton kernels launched without programmatic dependent launch).
Writes bench/results/gpu_prefill.json.
Usage: python bench/gpu_prefill.py [--prompt 128] [--variants graphed graphed_kernels graphed_eager compiled eager nopdl]
                                   [--out PATH]
"""
from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

from engine import model_runner, pdl  # noqa: E402
from engine.batch import StepInput  # noqa: E402
from engine.cuda_graphs import GraphConfig  # noqa: E402
from engine.model_runner import ModelRunner, RuntimeConfig  # noqa: E402
from engine.model_source import LoadedModel  # noqa: E402
from gpu_e2e import LLAMA_1B, LLAMA_8B  # noqa: E402
from report import save_report  # noqa: E402
from timing import kernel_census  # noqa: E402
from tiny_models import build_tokenizer  # noqa: E402

SHAPES = {"8b": (LLAMA_8B, "fused"), "1b": (LLAMA_1B, "auto")}  # each service's default layer kernels
VARIANTS = ("graphed", "graphed_kernels", "graphed_eager", "compiled", "eager", "nopdl")
STAGES = {"graphed_kernels": "kernels", "graphed_eager": "eager", "eager": "eager"}  # the rest: compiled
# graphed: the default prefill buckets, and a decode graph only (the profile needs none)
model_runner.GraphConfig = lambda: GraphConfig(batch_buckets=(1,), query_buckets=(1,))


def prefill_ms(runner: ModelRunner, prompt: list[int]) -> float:
    kv = runner.kv.new_sequence()
    torch.cuda.synchronize()
    started = time.perf_counter()
    runner.forward([StepInput(kv, prompt, 1)])
    torch.cuda.synchronize()
    elapsed = (time.perf_counter() - started) * 1e3
    kv.release()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_prefill.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch._dynamo.config.recompile_limit = 64  # each runner's compiled stages guard on its own weights
    metrics: dict[str, float] = {"prompt": args.prompt}
    for shape_name, (shape, layer_kernels) in SHAPES.items():
        with torch.device("cuda"):
            hf = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=torch.bfloat16).eval()
        for variant in args.variants:
            name = f"{shape_name}_{variant}"
            pdl.ENABLED = variant != "nopdl"
            runner = ModelRunner(
                RuntimeConfig(model=f"random-{shape_name}", device="cuda", dtype="bfloat16", max_model_len=2048,
                              kv_cache_tokens=4 * 2048, layer_kernels=layer_kernels, use_cuda_graphs=variant.startswith("graphed"),
                              stages=STAGES.get(variant, "compiled")),
                loaded=LoadedModel(f"random-{shape_name}", hf, build_tokenizer()),
            )
            prompt = torch.randint(3, 30000, (args.prompt,)).tolist()
            started = time.perf_counter()
            prefill_ms(runner, prompt)  # compiles the stages
            metrics[f"{name}_first_prefill_s"] = time.perf_counter() - started
            runs = sorted(prefill_ms(runner, prompt) for _ in range(5))
            metrics[f"{name}_prefill_ms"] = runs[len(runs) // 2]
            census = kernel_census(functools.partial(prefill_ms, runner, prompt), host_ops=10)
            metrics.update({f"{name}_{key}": value for key, value in census.items()})
            print({k: v for k, v in metrics.items() if k.startswith(name)}, flush=True)
            save_report("gpu_prefill", metrics, args.out)  # after each: a call cut short keeps what it measured
            del runner
            torch.cuda.empty_cache()
        del hf


if __name__ == "__main__":
    main()
