"""CPU benchmark: SmolLM2-135M target-only vs speculative (n-gram draft) through the three services,
side by side with Hugging Face transformers (plain greedy, and its prompt-lookup speculation).

Same prompts, same run, greedy, batch 1. This VM's speed drifts by tens of percent over minutes,
so every configuration runs on a prompt before the next prompt starts (interleaved), over several
rounds. Writes bench/results/cpu_smollm2[_DTYPE].json.
Usage: python bench/cpu_smollm2.py [--dtype float32|bfloat16] [--k 2] [--sweep 1 3 4]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from engine.model_source import DEFAULT_MODEL, converted_gguf_dir, default_cache_dir, resolve_path  # noqa: E402
from report import save_report  # noqa: E402
from specdec.client import build_request  # noqa: E402
from specdec.launch import interrupt_on_sigterm, start_trio  # noqa: E402
from totals import Totals, timed_generate  # noqa: E402

# Chat prompts of the kinds users send; several quote text the answer will reuse (where
# prompt lookup shines), several do not (where it cannot help).
PROMPTS = [
    "Rewrite this sentence in the passive voice: The committee approved the new budget after a long debate.",
    "Summarize: The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 "
    "individual reefs and 900 islands stretching over 2,300 kilometres off the coast of Queensland, Australia.",
    "Fix the bug in this Python function and show the corrected code:\n"
    "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(x)",
    "What is the capital of France, and what is it famous for?",
    "Write a short poem about the sea.",
    "Translate to French: Good morning, how are you today?",
]


def run_trio(address: str, prompt: str, max_new_tokens: int, k: int, totals: Totals) -> list[int]:
    return timed_generate(address, build_request(prompt, True, max_new_tokens, k, []), totals).token_ids


def run_hf(model, tokenizer, prompt: str, max_new_tokens: int, prompt_lookup: int | None, totals: Totals) -> None:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    extra = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **extra)
    totals.seconds += time.perf_counter() - start
    totals.counts["tokens"] += out.shape[1] - ids.shape[1]


def main() -> None:
    interrupt_on_sigterm()  # a timeout's SIGTERM still stops the services
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=2, help="the k reported as spec_tok_s")
    parser.add_argument("--sweep", type=int, nargs="*", default=[1, 3, 4], help="other k values to report")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/cpu_smollm2[_DTYPE].json")
    args = parser.parse_args()
    ks = sorted({args.k, *args.sweep})
    launch_args = argparse.Namespace(target_model=DEFAULT_MODEL, drafter="ngram", draft_model=None,
                                     num_draft_tokens=args.k, timeout_s=600, log_level="WARNING", dtype=args.dtype,
                                     draft_dtype=None)
    totals = defaultdict(Totals)
    mismatches = 0
    with tempfile.TemporaryDirectory() as tmp:
        trio, address = start_trio(launch_args, Path(tmp))
        try:
            path = converted_gguf_dir(resolve_path(DEFAULT_MODEL), default_cache_dir())
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
            run_trio(address, PROMPTS[0], 8, args.k, Totals())  # warm-up
            run_hf(model, tokenizer, PROMPTS[0], 8, None, Totals())
            for _ in range(args.rounds):
                for prompt in PROMPTS:
                    reference = run_trio(address, prompt, args.max_new_tokens, 0, totals["target_only"])
                    for k in ks:
                        output = run_trio(address, prompt, args.max_new_tokens, k, totals[f"k{k}"])
                        mismatches += output != reference
                    run_hf(model, tokenizer, prompt, args.max_new_tokens, None, totals["hf_greedy"])
                    run_hf(model, tokenizer, prompt, args.max_new_tokens, args.k, totals["hf_prompt_lookup"])
        finally:
            trio.stop()
    spec, target_only = totals[f"k{args.k}"], totals["target_only"]
    metrics = {
        "target_only_tok_s": target_only.tok_s(),
        "spec_tok_s": spec.tok_s(),
        "speedup": spec.tok_s() / target_only.tok_s(),
        "acceptance_rate": spec.ratio("accepted", "drafted"),
        "mean_accepted_len": spec.ratio("verified", "steps"),
        "k": args.k,
        "hf_greedy_tok_s": totals["hf_greedy"].tok_s(),
        "hf_prompt_lookup_tok_s": totals["hf_prompt_lookup"].tok_s(),
        **{f"spec_tok_s_k{k}": totals[f"k{k}"].tok_s() for k in ks},
        **{f"acceptance_rate_k{k}": totals[f"k{k}"].ratio("accepted", "drafted") for k in ks},
        "outputs_differing_from_target_only": mismatches,
        "dtype": args.dtype,
        "num_prompts": len(PROMPTS),
        "rounds": args.rounds,
        "max_new_tokens": args.max_new_tokens,
    }
    suffix = "" if args.dtype == "float32" else f"_{args.dtype}"
    save_report(f"cpu_smollm2{suffix}", metrics, args.out or ROOT / "bench" / "results" / f"cpu_smollm2{suffix}.json")


if __name__ == "__main__":
    main()
