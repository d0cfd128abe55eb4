"""Time to first token of a burst: N prompts reach a batch-invariant target engine together.

A batch-invariant target (--layer-kernels fused on a GPU) prefills each prompt's chunk in a forward of its own
(ModelRunner.forward_groups), one iteration of the engine running them all. This times each prompt's first
token from the burst's start on the CPU, through the TargetEngine's own API (not the services), with the
runner's iterations split as a batch-invariant one's but its forwards in PyTorch (the fused kernels run on
the CPU only in Triton's interpreter: seconds a forward). Variants run in
subprocesses, alternating round by round; `tree=DIR` runs one from another checkout (e.g. the commit before
a change: `git worktree add .ab/base COMMIT`), so a change is measured against its parent in one run.
Metrics per variant (ms, medians over rounds): each prompt's first token in order of answer, their mean and
max. Writes bench/results/NAME.json.

Usage: python bench/cpu_burst_ttft.py [--streams 4] [--prompt-tokens 96] [--rounds 3]
                                      [--variant LABEL[:tree=DIR]] ... [--name cpu_burst_ttft]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from engine.model_source import DEFAULT_MODEL  # noqa: E402
from report import save_report  # noqa: E402

# runs in the variant's tree (its engine): prints each prompt's first-token time, ms from the burst's start
WORKER = textwrap.dedent("""
    import asyncio, json, sys, time
    from engine.model_runner import ModelRunner, RuntimeConfig
    from engine.target_engine import TargetEngine

    model, streams, prompt_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    runner = ModelRunner(RuntimeConfig(model=model, kv_cache_tokens=16384))
    runner.batch_invariant = True  # iterations as a fused GPU target's: each prefill chunk a forward of its own

    async def main():
        engine = TargetEngine(runner)
        engine.start()
        warm, _, _ = await engine.prefill(list(range(1, prompt_tokens + 1)), 2)
        engine.release(warm)
        start = time.perf_counter()

        async def first_token(i):
            seq, _, _ = await engine.prefill([(7 * i + j) % 1000 + 1 for j in range(prompt_tokens)], 2)
            engine.release(seq)
            return (time.perf_counter() - start) * 1000

        print(json.dumps(await asyncio.gather(*(first_token(i) for i in range(streams)))))
        await engine.stop()

    asyncio.run(main())
""")


def run_variant(tree: Path, model: str, streams: int, prompt_tokens: int) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", WORKER, model, str(streams), str(prompt_tokens)], cwd=tree, env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the variant in {tree} failed:\n{done.stderr[-3000:]}")
    return sorted(json.loads(done.stdout.strip().splitlines()[-1]))


def parse_variant(spec: str) -> tuple[str, Path]:
    label, _, rest = spec.partition(":")
    if not rest:
        return label, ROOT
    key, _, value = rest.partition("=")
    if key != "tree" or not (Path(value) / "engine").is_dir():
        raise SystemExit(f"variant {spec!r}: expected LABEL or LABEL:tree=DIR (a checkout of this project)")
    return label, Path(value).resolve()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variant", action="append", default=[], help="LABEL or LABEL:tree=DIR (default: this tree)")
    parser.add_argument("--name", default="cpu_burst_ttft")
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variant or ["this"]]
    times: dict[str, list[list[float]]] = {label: [] for label, _ in variants}
    for round_ in range(args.rounds):
        for label, tree in variants:
            times[label].append(run_variant(tree, args.model, args.streams, args.prompt_tokens))
            print(f"round {round_ + 1} {label}: " + ", ".join(f"{t:.0f}" for t in times[label][-1]) + " ms",
                  flush=True)
    metrics = {}
    for label, rounds in times.items():
        by_position = [statistics.median(r[i] for r in rounds) for i in range(args.streams)]
        metrics[label] = {"first_token_ms_by_answer": by_position,
                          "first_token_ms_mean": statistics.median(statistics.fmean(r) for r in rounds),
                          "first_token_ms_max": statistics.median(max(r) for r in rounds)}
    save_report(args.name, metrics, ROOT / "bench" / "results" / f"{args.name}.json",
                config={"model": args.model, "streams": args.streams, "prompt_tokens": args.prompt_tokens,
                        "rounds": args.rounds, "variants": {label: str(tree) for label, tree in variants}})


if __name__ == "__main__":
    main()
