"""H200 A/B of a draft's weights, bf16 against weight-only int8 (--quantize int8, engine/linear.py):
a random-weight Llama-3.2-1B shape, bf16 activations, prompt 512, the draft service's default layer
kernels (auto; with int8 every graph step takes the fused kernels, which read the int8 rows).

For each setting (bf16, int8, twice each, alternating; the same process, the runner built afresh):
the device time of a batch-1 decode replay (q = 1) and of a q = 5 replay, and the wall time of a
k = 4 greedy proposal through the draft's captured loop (host sync included) at batch 1 and 8; and
how close int8's decode logits are to bf16's (cosine, and whether the top token is the same, over
64 decode positions; with random weights the top logits are close together, so agreement there is a
lower bound of what a trained draft keeps). Writes bench/results/gpu_draft_int8.json.
Usage: python bench/gpu_draft_int8.py [--out PATH]
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
from gpu_e2e import LLAMA_1B  # noqa: E402
from report import save_report  # noqa: E402
from timing import cuda_ms, decode_logits, prefilled_sequences, proposal_ms  # noqa: E402
from tiny_models import build_tokenizer  # noqa: E402

PROMPT = 512
NUM_LOGIT_POSITIONS = 64


def measure(hf, quantize: str) -> tuple[dict[str, float], torch.Tensor]:
    runner = ModelRunner(
        RuntimeConfig(model="random-1b", device="cuda", dtype="bfloat16", max_model_len=2048,
                      kv_cache_tokens=16 * 2048, quantize=quantize),
        loaded=LoadedModel("random-1b", hf, build_tokenizer()),
    )
    gen = torch.Generator().manual_seed(0)
    seqs = prefilled_sequences(runner, gen, 8, PROMPT)
    kv = seqs[0]
    metrics = {}
    for q in (1, 5):
        runner.forward([StepInput(kv, list(range(100, 100 + q)), q)])  # fills the bucket's buffers
        kv.truncate(PROMPT)
        metrics[f"replay_ms_q{q}"] = cuda_ms(runner.graphs._graphs[(1, q)].graph.replay, 100)
    logits = decode_logits(runner, kv, gen, NUM_LOGIT_POSITIONS, PROMPT)
    metrics.update(proposal_ms(runner, seqs, PROMPT))
    for s in seqs:
        s.release()
    return metrics, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_draft_int8.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA_1B), dtype=torch.bfloat16).eval()
    metrics: dict[str, float] = {}
    logits: dict[str, torch.Tensor] = {}
    for setting in ("bf16", "int8", "bf16_2", "int8_2"):  # alternating: the figures' spread
        # (quantizing replaces our model's linears, not the HF model's they were taken from)
        result, logits[setting] = measure(hf, "int8" if setting.startswith("int8") else "none")
        gc.collect()  # the runner and its graphs, before the next is built
        torch.cuda.empty_cache()
        for key, value in result.items():
            metrics[f"{setting}_{key}"] = value
        print(setting, result, flush=True)
    for key in ("replay_ms_q1", "replay_ms_q5", "propose_ms_k4_bs1", "propose_ms_k4_bs8"):
        bf16 = min(metrics[f"bf16_{key}"], metrics[f"bf16_2_{key}"])
        int8 = min(metrics[f"int8_{key}"], metrics[f"int8_2_{key}"])
        metrics[f"{key}_bf16"], metrics[f"{key}_int8"], metrics[f"{key}_int8_over_bf16"] = bf16, int8, int8 / bf16
    a, b = logits["bf16"], logits["int8"]
    metrics["logits_cosine_int8_vs_bf16"] = torch.nn.functional.cosine_similarity(a, b, dim=-1).mean().item()
    metrics["top1_agreement_int8_vs_bf16"] = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    metrics["same_bits_across_runs_int8"] = float(torch.equal(logits["int8"], logits["int8_2"]))
    save_report("gpu_draft_int8", metrics, args.out)


if __name__ == "__main__":
    main()
