"""Does the target's greedy output depend on --max-batch-size? One process, one random-weight
Llama-3.1-8B shape (bf16, the target's fused kernels), a runner built afresh for each max batch size
(its graphs captured for that size's buckets), each fed the same prompt as a prefill and then greedy
batch-1 decodes.

Why: on the H200 the trio's target-only output at --max-batch-size 8 differed from 1's and 64's on 7 of
8 prompts (bench/results/gpu_ab_max_batch.json), each setting alike from start to start. A batch-1 step
replays the same (1, q) graph in every setting, so this finds which step first differs: the prefill
(a prefill bucket's graph, the compiled PyTorch and cuBLAS stages) or a decode (the fused kernels).

Per max batch size against the first: `mbN_prefill_same_bits` (the prompt's last logits),
`mbN_prefill_max_abs_diff`, `mbN_first_differing_decode` (-1: none) and `mbN_same_tokens` (the greedy
continuations equal). `--tiny` runs a tiny model on the CPU (a check of the script: no graphs, no fused kernels there).
Usage: python bench/gpu_max_batch.py [--tiny] [--sizes 1 8 64] [--prompt 128] [--steps 64] [--out PATH]
"""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

from engine.batch import StepInput  # noqa: E402
from engine.model_runner import ModelRunner, RuntimeConfig  # noqa: E402
from engine.model_source import LoadedModel  # noqa: E402
from gpu_e2e import LLAMA_8B, TINY  # noqa: E402
from report import save_report  # noqa: E402
from tiny_models import build_tokenizer  # noqa: E402


def greedy_run(hf, device: str, max_batch_size: int, prompt: list[int], steps: int) -> list[torch.Tensor]:
    """The prompt's last logits, then each greedy decode's: float32 on the CPU."""
    runner = ModelRunner(
        RuntimeConfig(model="random-8b", device=device, dtype="bfloat16" if device == "cuda" else "float32",
                      max_model_len=1024, kv_cache_tokens=4096, max_batch_size=max_batch_size,
                      layer_kernels="fused" if device == "cuda" else "reference"),  # CPU: no Triton driver
        loaded=LoadedModel("random-8b", hf, build_tokenizer()),
    )
    kv = runner.kv.new_sequence()
    [logits] = runner.forward([StepInput(kv, prompt, 1)])
    out = [logits[-1].float().cpu()]
    for _ in range(steps):
        [logits] = runner.forward([StepInput(kv, [int(out[-1].argmax())], 1)])
        out.append(logits[-1].float().cpu())
    kv.release()
    del runner
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: checks the script only")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_max_batch.json")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    shape = TINY if args.tiny else LLAMA_8B
    torch.manual_seed(0)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=torch.float32 if args.tiny
                                              else torch.bfloat16).eval()
    prompt = torch.randint(3, shape["vocab_size"] - 1, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    runs = {size: greedy_run(hf, device, size, prompt, args.steps) for size in args.sizes}
    first, reference = args.sizes[0], runs[args.sizes[0]]
    metrics: dict[str, float] = {}
    for size in args.sizes[1:]:
        other = runs[size]
        metrics[f"mb{size}_prefill_same_bits"] = float(torch.equal(reference[0], other[0]))
        metrics[f"mb{size}_prefill_max_abs_diff"] = (reference[0] - other[0]).abs().max().item()
        differing = [i for i, (a, b) in enumerate(zip(reference[1:], other[1:])) if not torch.equal(a, b)]
        metrics[f"mb{size}_first_differing_decode"] = differing[0] if differing else -1
        metrics[f"mb{size}_same_tokens"] = float([int(x.argmax()) for x in reference] == [int(x.argmax()) for x in other])
        print(size, "vs", first, {k: v for k, v in metrics.items() if k.startswith(f"mb{size}_")}, flush=True)
    save_report("gpu_max_batch", metrics, args.out, reference_max_batch_size=first, prompt_tokens=args.prompt,
                decode_steps=args.steps)


if __name__ == "__main__":
    main()
