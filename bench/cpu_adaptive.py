"""CPU benchmark of adaptive speculation: fixed k in {1, 2, 4} vs adaptive k vs target-only, for
SmolLM2-135M and the default draft, through the three services, greedy and temperature 0.8, on two
prompt sets (prompts whose answers quote them, where drafts do well, and open-ended ones).

Same run, interleaved: every configuration runs on a prompt before the next prompt starts, in an
order rotated from one prompt to the next (so none always runs first, or right after the costliest),
over several rounds (this VM's speed drifts by tens of percent over minutes). Writes
bench/results/cpu_adaptive.json with, per prompt set and temperature, tokens/s and acceptance of
each configuration, and `adaptive_over_best_fixed` / `adaptive_over_target_only` as the worst case
over prompt sets and temperatures.
Usage: python bench/cpu_adaptive.py [--drafter model|ngram] [--rounds 4] [--max-new-tokens 48]
                                    [--sets quoting open] [--temperatures 0 0.8]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from report import save_report  # noqa: E402
from specdec.launch import choose_draft, launch_parser, start_trio  # noqa: E402
from specdec.v1 import gateway_pb2  # noqa: E402
from totals import Totals, timed_generate  # noqa: E402

PROMPT_SETS = {
    "quoting": [
        "Rewrite this sentence in the passive voice: The committee approved the new budget after a long debate.",
        "Fix the bug in this Python function and show the corrected code:\n"
        "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(x)",
        "Repeat after me, then explain it: The quick brown fox jumps over the lazy dog.",
    ],
    "open": [
        "What is the capital of France, and what is it famous for?",
        "Write a short poem about the sea.",
        "Give three tips for learning a new language.",
    ],
}
TEMPERATURES = (0.0, 0.8)
FIXED_KS = (1, 2, 4)


def run(address: str, prompt: str, max_new_tokens: int, temperature: float, k: int | None, totals: Totals) -> None:
    request = gateway_pb2.GenerateRequest(max_new_tokens=max_new_tokens, temperature=temperature)
    request.chat.messages.add(role="user", content=prompt)
    if k is not None:  # unset: the gateway's adaptive policy chooses k per step
        request.num_draft_tokens = k
    stats = timed_generate(address, request, totals).final.stats
    if k is None:  # what the policy chose, for reading the run
        print(f"adaptive T={temperature:g} {prompt[:24]!r}: steps by k {list(stats.num_steps_by_k)}, "
              f"{stats.num_accepted_tokens}/{stats.num_draft_tokens} accepted", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default=None, help="model or ngram; default: the launcher's default draft")
    parser.add_argument("--rounds", type=int, default=4)  # sampled outputs differ per configuration: noisy
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--sets", nargs="+", choices=list(PROMPT_SETS), default=list(PROMPT_SETS),
                        help="prompt sets (a partial run's worst cases cover only these)")
    parser.add_argument("--temperatures", nargs="+", type=float, default=list(TEMPERATURES))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu_adaptive.json")
    args = parser.parse_args()
    parser = launch_parser()
    launch_args = parser.parse_args(["--log-level", "WARNING", "-k", str(max(FIXED_KS)),
                                     *(["--drafter", args.drafter] if args.drafter else [])])
    choose_draft(launch_args, parser)  # the gateway's k (and the adaptive policy's cap) is max(FIXED_KS)
    configs = {"target_only": 0, **{f"k{k}": k for k in FIXED_KS}, "adaptive": None}
    totals: dict[tuple, Totals] = defaultdict(Totals)
    with tempfile.TemporaryDirectory() as tmp:
        trio, address = start_trio(launch_args, Path(tmp))
        try:
            run(address, "Hello", 8, 0.0, 1, Totals())  # warms both services; k pinned: teaches the policy nothing
            names = list(configs)
            turn = 0
            for _ in range(args.rounds):
                for set_name in args.sets:
                    for prompt in PROMPT_SETS[set_name]:
                        for temperature in args.temperatures:
                            turn += 1
                            for name in names[turn % len(names):] + names[:turn % len(names)]:
                                run(address, prompt, args.max_new_tokens, temperature, configs[name],
                                    totals[(set_name, temperature, name)])
        finally:
            trio.stop()
    metrics: dict[str, float] = {}
    over_best, over_target = [], []
    for set_name in args.sets:
        for temperature in args.temperatures:
            tok_s = {}
            for name in configs:
                t = totals[(set_name, temperature, name)]
                tok_s[name] = t.tok_s()
                prefix = f"{set_name}_t{temperature:g}_{name}"
                metrics[f"{prefix}_tok_s"] = tok_s[name]
                if configs[name] != 0:
                    metrics[f"{prefix}_acceptance_rate"] = t.ratio("accepted", "drafted")
                steps = t.counts["steps"] or 1
                # the target's forward time per step shows a disturbed run: ~55-60 ms on this VM when quiet
                metrics[f"{prefix}_target_ms_per_step"] = 1e3 * t.counts["target_s"] / steps
                print(f"{prefix}: {tok_s[name]:.1f} tok/s, per step {1e3 * t.seconds / steps:.1f} ms: target "
                      f"{1e3 * t.counts['target_s'] / steps:.1f}, draft {1e3 * t.counts['draft_s'] / steps:.1f}, "
                      f"tokens {t.counts['tokens'] / steps:.2f}", file=sys.stderr)
            best_fixed = max(tok_s[f"k{k}"] for k in FIXED_KS)
            over_best.append(tok_s["adaptive"] / best_fixed)
            over_target.append(tok_s["adaptive"] / tok_s["target_only"])
            metrics[f"{set_name}_t{temperature:g}_adaptive_over_best_fixed"] = over_best[-1]
            metrics[f"{set_name}_t{temperature:g}_adaptive_over_target_only"] = over_target[-1]
    metrics["adaptive_over_best_fixed"] = min(over_best)
    metrics["adaptive_over_target_only"] = min(over_target)
    save_report("cpu_adaptive", metrics, args.out, draft=launch_args.draft_model or launch_args.drafter)


if __name__ == "__main__":
    main()
