"""CPU benchmark of adaptive speculation: fixed k in {1, 2, 4} vs adaptive k vs target-only, for
SmolLM2-135M and the default draft, through the three services, greedy and temperature 0.8, on two
prompt sets (prompts whose answers quote them, where drafts do well, and open-ended ones).

Same run, interleaved: every configuration runs on a prompt before the next prompt starts, in an
order rotated from one prompt to the next (so none always runs first, or right after the costliest),
over several rounds. Writes bench/results/cpu_adaptive.json with, per prompt set and temperature,
tokens/s, acceptance and the target's forward ms per step of each configuration over all rounds.

The ratios: this VM's speed drifts by 15 % and more over minutes (the target's forward time per step
varies that much between configurations doing equal work), more than the 3 % the goal asks about,
while configurations run back to back on one prompt see nearly the same speed. So a setting's
(prompt set, temperature) `adaptive_over_best_fixed` is the median over rounds of the round's
adaptive tok/s / the best fixed k's tok/s (each over the set's prompts), the best fixed k being the
one with the most tokens/s over all rounds (not each round's luckiest, which would favour fixed k by
the noise); `adaptive_over_target_only` likewise. Each comes with its spread over rounds (`_min`,
`_max`), the standard error of its mean over rounds (`_sem`: per-round ratios scatter by 7-34 %
here, so one run of 8 rounds resolves about +-5 %, not 3 %) and the ratio of the tokens/s over all
rounds (`_pooled`, the earlier definition). The headline `adaptive_over_best_fixed` /
`adaptive_over_target_only` are the worst case (min) over prompt sets and temperatures, of the
medians (and `*_pooled` of the pooled ratios). Every figure also comes as `*_decode`: tokens/s after
each request's first token (see RATES). Sampled requests set `ignore_eos` and all run to
max_new_tokens (see `run`); greedy ones end where the target's output does, the same under every configuration.
Usage: python bench/cpu_adaptive.py [--drafter model|ngram] [--rounds 8] [--max-new-tokens 48]
                                    [--sets quoting open] [--temperatures 0 0.8] [--fixed-ks 1 2 4]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from report import save_report  # noqa: E402
from specdec.launch import choose_draft, interrupt_on_sigterm, launch_parser, start_trio  # noqa: E402
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
# tokens/s of whole requests (the headline), and after each request's first token (`_decode`): k acts
# only there, and on this 2-core VM a prefill that runs beside the draft's takes 0.2-0.9 s at random
# (OpenMP threads of two processes spinning on two cores), the largest noise of a request's time
RATES = {"": Totals.tok_s, "_decode": Totals.decode_tok_s}


def run(address: str, prompt: str, max_new_tokens: int, temperature: float, k: int | None,
        totals: Totals) -> gateway_pb2.GenerationStats:
    # a sampled request draws differently under each configuration, so where it ends varies with them
    # (and a longer one amortizes its prefill better): sampled requests run past the end token to max_new_tokens
    request = gateway_pb2.GenerateRequest(max_new_tokens=max_new_tokens, temperature=temperature,
                                          ignore_eos=temperature > 0)
    request.chat.messages.add(role="user", content=prompt)
    if k is not None:  # unset: the gateway's adaptive policy chooses k per step
        request.num_draft_tokens = k
    stats = timed_generate(address, request, totals).final.stats
    if k is None:  # what the policy chose, for reading the run
        print(f"adaptive T={temperature:g} {prompt[:24]!r}: steps by k {list(stats.num_steps_by_k)}, "
              f"{stats.num_accepted_tokens}/{stats.num_draft_tokens} accepted", file=sys.stderr)
    return stats


def pooled(parts: list[Totals]) -> Totals:
    """One configuration's totals over all rounds."""
    total = Totals()
    for part in parts:
        total.seconds += part.seconds
        for name, count in part.counts.items():
            total.counts[name] += count
    return total


def ratio_metrics(prefix: str, by_round: list[float], pooled_ratio: float) -> dict[str, float]:
    """A ratio's median over rounds (the figure), its spread, the standard error of its mean over rounds
    (what one run can tell apart), and the ratio of the pooled tokens/s."""
    return {prefix: statistics.median(by_round), f"{prefix}_min": min(by_round), f"{prefix}_max": max(by_round),
            f"{prefix}_sem": statistics.stdev(by_round) / len(by_round) ** 0.5 if len(by_round) > 1 else 0.0,
            f"{prefix}_pooled": pooled_ratio}


def main() -> None:
    interrupt_on_sigterm()  # a timeout's SIGTERM still stops the services
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default=None, help="model or ngram; default: the launcher's default draft")
    parser.add_argument("--rounds", type=int, default=8)  # ratios are medians over rounds
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--sets", nargs="+", choices=list(PROMPT_SETS), default=list(PROMPT_SETS),
                        help="prompt sets (a partial run's worst cases cover only these)")
    parser.add_argument("--temperatures", nargs="+", type=float, default=list(TEMPERATURES))
    parser.add_argument("--fixed-ks", nargs="+", type=int, default=list(FIXED_KS),
                        help="the fixed k compared with adaptive; the largest is also the policy's cap")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu_adaptive.json")
    args = parser.parse_args()
    fixed_ks = tuple(args.fixed_ks)
    parser = launch_parser()
    launch_args = parser.parse_args(["--log-level", "WARNING", "-k", str(max(fixed_ks)),
                                     *(["--drafter", args.drafter] if args.drafter else [])])
    choose_draft(launch_args, parser)  # the gateway's k (and the adaptive policy's cap) is max(fixed_ks)
    configs = {"target_only": 0, **{f"k{k}": k for k in fixed_ks}, "adaptive": None}
    totals: dict[tuple, Totals] = defaultdict(Totals)  # by (round, set, temperature, configuration)
    steps_by_k: dict[str, list[int]] = defaultdict(lambda: [0] * (max(fixed_ks) + 1))  # the policy's, by setting
    with tempfile.TemporaryDirectory() as tmp:
        trio, address = start_trio(launch_args, Path(tmp))
        try:
            run(address, "Hello", 8, 0.0, 1, Totals())  # warms both services; k pinned: teaches the policy nothing
            names = list(configs)
            turn = 0
            for round_index in range(args.rounds):
                for set_name in args.sets:
                    for prompt in PROMPT_SETS[set_name]:
                        for temperature in args.temperatures:
                            turn += 1
                            for name in names[turn % len(names):] + names[:turn % len(names)]:
                                stats = run(address, prompt, args.max_new_tokens, temperature, configs[name],
                                            totals[(round_index, set_name, temperature, name)])
                                if configs[name] is None:
                                    for k, num_steps in enumerate(stats.num_steps_by_k):
                                        steps_by_k[f"{set_name}_t{temperature:g}"][k] += num_steps
        finally:
            trio.stop()
    metrics: dict[str, float] = {}
    ratios_by_round: dict[str, list[float]] = {}
    settings = [f"{set_name}_t{temperature:g}" for set_name in args.sets for temperature in args.temperatures]
    for set_name in args.sets:
        for temperature in args.temperatures:
            setting = f"{set_name}_t{temperature:g}"
            rounds = [{name: totals[(r, set_name, temperature, name)] for name in configs} for r in range(args.rounds)]
            over_rounds = {name: pooled([by_name[name] for by_name in rounds]) for name in configs}
            for name, k in configs.items():
                t = over_rounds[name]
                prefix = f"{setting}_{name}"
                if k != 0:
                    metrics[f"{prefix}_acceptance_rate"] = t.ratio("accepted", "drafted")
                steps = t.counts["steps"] or 1
                # the target's forward time per step shows a disturbed run: ~55-63 ms at k = 0 on this VM when
                # quiet; it counts the prefill too, so it grows with k (fewer steps share it), not only with noise
                metrics[f"{prefix}_target_ms_per_step"] = 1e3 * t.counts["target_s"] / steps
                print(f"{prefix}: {t.tok_s():.1f} tok/s ({t.decode_tok_s():.1f} after the first token), per step "
                      f"{1e3 * t.seconds / steps:.1f} ms: target {1e3 * t.counts['target_s'] / steps:.1f}, draft "
                      f"{1e3 * t.counts['draft_s'] / steps:.1f}, tokens {t.counts['tokens'] / steps:.2f}", file=sys.stderr)
            for suffix, rate in RATES.items():
                tok_s = {name: rate(t) for name, t in over_rounds.items()}
                for name in configs:
                    metrics[f"{setting}_{name}{suffix}_tok_s"] = tok_s[name]
                best_k = max(fixed_ks, key=lambda k: tok_s[f"k{k}"])
                metrics[f"{setting}_best_fixed_k{suffix}"] = best_k
                for versus, name in (("best_fixed", f"k{best_k}"), ("target_only", "target_only")):
                    by_round = [rate(by_name["adaptive"]) / rate(by_name[name]) for by_name in rounds]
                    ratios_by_round[f"{setting}_adaptive_over_{versus}{suffix}"] = [round(x, 4) for x in by_round]
                    metrics.update(ratio_metrics(f"{setting}_adaptive_over_{versus}{suffix}", by_round,
                                                 tok_s["adaptive"] / tok_s[name]))
    for suffix in RATES:
        for versus in ("best_fixed", "target_only"):
            name = f"adaptive_over_{versus}{suffix}"
            metrics[name] = min(metrics[f"{s}_{name}"] for s in settings)
            metrics[f"{name}_pooled"] = min(metrics[f"{s}_{name}_pooled"] for s in settings)
    save_report("cpu_adaptive", metrics, args.out, draft=launch_args.draft_model or launch_args.drafter,
                ratios_by_round=ratios_by_round, adaptive_steps_by_k=dict(steps_by_k))


if __name__ == "__main__":
    main()
