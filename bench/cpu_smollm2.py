"""CPU benchmark: SmolLM2-135M target-only vs speculative (n-gram draft) through the three services,
side by side with Hugging Face transformers (plain greedy and its prompt-lookup speculation).

Same prompts, same run, greedy, batch 1. Writes bench/results/cpu_smollm2.json.
Usage: python bench/cpu_smollm2.py [--max-new-tokens 64] [--k 2]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.model_source import DEFAULT_MODEL, converted_gguf_dir, default_cache_dir, resolve_path  # noqa: E402
from specdec.client import build_request, stream  # noqa: E402
from specdec.launch import start_trio  # noqa: E402

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


def run_trio(address: str, prompts: list[str], max_new_tokens: int, k: int) -> dict[str, float]:
    tokens = drafted = accepted = verify_steps = verified = 0
    start = time.perf_counter()
    for prompt in prompts:
        final = stream(address, build_request(prompt, True, max_new_tokens, k, [])).final
        s = final.stats
        tokens += s.num_completion_tokens
        drafted += s.num_draft_tokens
        accepted += s.num_accepted_tokens
        verify_steps += s.num_verify_steps
        verified += round(s.mean_accepted_len * s.num_verify_steps)
    elapsed = time.perf_counter() - start
    return {"tok_s": tokens / elapsed, "tokens": tokens, "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_len": verified / verify_steps if verify_steps else 0.0}


def run_hf(model, tokenizer, prompts: list[str], max_new_tokens: int, prompt_lookup: int | None) -> float:
    tokens, start = 0, time.perf_counter()
    for prompt in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
        extra = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **extra)
        tokens += out.shape[1] - ids.shape[1]
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=2, help="k reported as spec_tok_s")
    parser.add_argument("--sweep", type=int, nargs="*", default=[1, 2, 3, 4], help="other k values to report")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu_smollm2.json")
    args = parser.parse_args()
    launch_args = argparse.Namespace(target_model=DEFAULT_MODEL, drafter="ngram", draft_model=None,
                                     num_draft_tokens=args.k, timeout_s=600, log_level="WARNING")
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        trio, address = start_trio(launch_args, Path(tmp))
        try:
            run_trio(address, PROMPTS[:1], 8, args.k)  # warm-up
            target_only = run_trio(address, PROMPTS, args.max_new_tokens, 0)
            sweep = {k: run_trio(address, PROMPTS, args.max_new_tokens, k) for k in sorted({args.k, *args.sweep})}
        finally:
            trio.stop()
    path = converted_gguf_dir(resolve_path(DEFAULT_MODEL), default_cache_dir())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    run_hf(model, tokenizer, PROMPTS[:1], 8, None)  # warm-up
    spec = sweep[args.k]
    results = {
        "target_only_tok_s": target_only["tok_s"],
        "spec_tok_s": spec["tok_s"],
        "speedup": spec["tok_s"] / target_only["tok_s"],
        "acceptance_rate": spec["acceptance_rate"],
        "mean_accepted_len": spec["mean_accepted_len"],
        "k": args.k,
        "hf_greedy_tok_s": run_hf(model, tokenizer, PROMPTS, args.max_new_tokens, None),
        "hf_prompt_lookup_tok_s": run_hf(model, tokenizer, PROMPTS, args.max_new_tokens, args.k),
        **{f"spec_tok_s_k{k}": r["tok_s"] for k, r in sweep.items()},
        **{f"acceptance_rate_k{k}": r["acceptance_rate"] for k, r in sweep.items()},
        "num_prompts": len(PROMPTS),
        "max_new_tokens": args.max_new_tokens,
    }
    report = {
        "name": "cpu_smollm2",
        "command": "python bench/cpu_smollm2.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
                   f"torch threads, torch {torch.__version__}",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "metrics": {k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
