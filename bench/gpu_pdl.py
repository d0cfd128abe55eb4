"""H200 A/B of a switch of the fused layer kernels' graph steps: programmatic dependent launch
(engine/pdl.py, the default `--lever pdl`) or the QKV product with rotary in its epilogue
(`--lever qkv_rope`, engine/fused_stages.QKV_ROPE); random-weight Llama-3.1-8B (target) and
Llama-3.2-1B (draft) shapes, bf16, prompt 512. (A third lever, the attention's combine inside its
kernel, measured slower and was dropped: bench/results/gpu_fused_combine.json, docs/benchmarks.md.)

For each shape and each setting (off, then on; the same process, the graphs captured afresh):
the device time of a batch-1 decode replay (q = 1) and verify replay (q = 5) back to back, and of one
started on an idle device with its launch's host time (medians: a service's step starts so; does a
graph of PDL edges launch slower?), the wall time of a
k = 4 greedy proposal through the draft's captured loop (1B, host sync included), and whether the
logits of a decode and a verify are the same bits either way (and their largest difference).
Writes bench/results/gpu_LEVER.json.
Usage: python bench/gpu_pdl.py [--lever pdl|qkv_rope] [--out PATH]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

from engine import fused_stages, pdl  # noqa: E402
from engine.batch import StepInput  # noqa: E402
from engine.draft_loop import DraftLoop, LoopConfig  # noqa: E402
from engine.model_runner import ModelRunner, RuntimeConfig  # noqa: E402
from engine.model_source import LoadedModel  # noqa: E402
from gpu_e2e import LLAMA_1B, LLAMA_8B  # noqa: E402
from gpu_target import wall_ms  # noqa: E402
from report import save_report  # noqa: E402
from timing import cuda_ms, idle_launch_ms  # noqa: E402
from tiny_models import build_tokenizer  # noqa: E402

PROMPT = 512
SHAPES = {"8b": (LLAMA_8B, "fused"), "1b": (LLAMA_1B, "auto")}  # each service's default layer kernels
LEVERS = {"pdl": (pdl, "ENABLED"), "qkv_rope": (fused_stages, "QKV_ROPE")}  # read when a runner is built


def measure(hf, name: str, layer_kernels: str) -> tuple[dict[str, float], list[torch.Tensor]]:
    runner = ModelRunner(
        RuntimeConfig(model=f"random-{name}", device="cuda", dtype="bfloat16", max_model_len=2048,
                      kv_cache_tokens=4 * 2048, layer_kernels=layer_kernels),
        loaded=LoadedModel(f"random-{name}", hf, build_tokenizer()),
    )
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 30000, (PROMPT,), generator=gen).tolist()
    kv = runner.kv.new_sequence()
    runner.forward([StepInput(kv, prompt, 1)])
    metrics, logits = {}, []
    for q in (1, 5):
        tokens = torch.randint(3, 30000, (q,), generator=gen).tolist()
        logits.append(runner.forward([StepInput(kv, tokens, q)])[0].clone())  # fills the bucket's buffers
        kv.truncate(PROMPT)
        replay = runner.graphs._graphs[(1, q)].graph.replay
        metrics[f"replay_ms_q{q}"] = cuda_ms(replay, 100)
        # started on an idle device, as a service's step is: the launch's host time, and the call to the end
        metrics[f"launch_host_ms_q{q}"], metrics[f"idle_replay_ms_q{q}"] = idle_launch_ms(replay, 100, statistics.median)
    if name == "1b":
        loop = DraftLoop(runner, LoopConfig(batch_buckets=(1,), max_steps=4, first_query_buckets=(1,)))

        def propose() -> None:
            loop.propose([StepInput(kv, [7], 1)], [4])
            kv.truncate(PROMPT)

        metrics["propose_ms_k4"] = wall_ms(propose, 200)
    kv.release()
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    return metrics, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lever", choices=list(LEVERS), default="pdl")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or ROOT / "bench" / "results" / f"gpu_{args.lever}.json"
    torch.manual_seed(0)
    metrics: dict[str, float] = {}
    for name, (shape, layer_kernels) in SHAPES.items():
        with torch.device("cuda"):
            hf = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=torch.bfloat16).eval()
        results = {}
        for setting in ("off", "on", "off2", "on2"):  # twice each, alternating: the figures' spread
            module, switch = LEVERS[args.lever]
            setattr(module, switch, setting.startswith("on"))
            results[setting] = measure(hf, name, layer_kernels)
            for key, value in results[setting][0].items():
                metrics[f"{name}_{key}_{args.lever}_{setting}"] = value
            print(name, setting, results[setting][0], flush=True)
        metrics[f"{name}_same_bits"] = float(all(torch.equal(a, b) for a, b in zip(results["off"][1], results["on"][1])))
        metrics[f"{name}_max_abs_logit_diff"] = max((a - b).abs().max().item()
                                                    for a, b in zip(results["off"][1], results["on"][1]))
        for key in results["off"][0]:
            off = min(results[s][0][key] for s in ("off", "off2"))
            on = min(results[s][0][key] for s in ("on", "on2"))
            metrics[f"{name}_{key}_saved_ms"] = off - on
        del hf
        gc.collect()
        torch.cuda.empty_cache()
    save_report(f"gpu_{args.lever}", metrics, out)


if __name__ == "__main__":
    main()
