"""Do two replicas of the same target give the same greedy output? Separate processes, each building the
random-weight Llama-3.1-8B shape as a target service does (`random:DIR` through engine/model_source.py, seed 0;
bf16, the target's fused kernels, CUDA graphs), each fed the same prompts as a prefill and then greedy batch-1
decodes.

Why: on an H100 (bench/results/gpu_ab_draft_open_known_names.json) two target services of the same code and
flags, started side by side, gave different target-only greedy output on 8 of 8 prompts, while in one process
the target's steps are the same bits from runner to runner (bench/results/gpu_max_batch.json). What this found
(docs/benchmarks.md): the processes part at the prefill, with the same weights, and only where the PyTorch stages
are compiled by inductor (`nocompile`: every replica the same bits); inductor's deterministic mode does not help.

Per mode, runs `--replicas` child processes side by side (as bench/gpu_ab.py starts its targets), each with an
inductor cache of its own (empty, as a fresh replica's): `tuned` (as the services run), `deterministic`
(TORCHINDUCTOR_DETERMINISTIC=1: inductor picks its reductions' launch configurations without timing),
`kernels` (engine/kernel_stages.py: Triton norms and rotary of fixed launch around cuBLAS), `nocompile` (the
PyTorch stages eager: no inductor kernels) and `nographs` (every forward eager: no CUDA graphs).
Per mode and replica against the mode's first: `MODE_rN_same_weights`, `MODE_rN_prompts_differing` (greedy
tokens), `MODE_rN_first_differing_step` (over the prompts: 0 the prefill, i the i-th decode; -1 none),
`MODE_rN_prefill_same_bits` (every prompt's last prefill logits), `MODE_rN_sources_only_in_one` (generated kernel
sources one of the two replicas' inductor caches holds and the other not), `MODE_rN_picks_differing` (autotune
picks that differ for one source; the first few of both in the report's `details`); `MODE_prefill_ms` (the median
prefill over replicas and prompts, host sync included, the replicas contending). `--tiny` runs a tiny model on
the CPU (checks the script; nothing is compiled there).
Usage: python bench/gpu_replicas.py [--tiny] [--modes tuned deterministic kernels nocompile nographs] [--replicas 3]
                                    [--prompts 4] [--prompt-tokens 128] [--steps 64] [--out PATH]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch._inductor.config

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

from engine.batch import StepInput  # noqa: E402
from engine.model_runner import ModelRunner, RuntimeConfig  # noqa: E402
from gpu_e2e import LLAMA_8B, TINY, write_model_dir  # noqa: E402
from report import save_report  # noqa: E402
from tiny_models import build_tokenizer  # noqa: E402


MODES = ("tuned", "deterministic", "kernels", "nocompile", "nographs")


def weights_digest(model: torch.nn.Module, chunk: int = 1 << 26) -> str:
    """A digest of every parameter's bits, in the module's order: per parameter a plain and a position-weighted
    sum of its 16-bit words, computed on the device a chunk at a time, then hashed."""
    digest = hashlib.sha256()
    for name, p in model.state_dict().items():
        words = p.detach().contiguous().view(-1).view(torch.int16)
        plain = weighted = 0
        for start in range(0, words.numel(), chunk):
            part = words[start:start + chunk].to(torch.int64)
            position = torch.arange(start, start + part.numel(), device=part.device, dtype=torch.int64) % 65521 + 1
            plain += int(part.sum())
            weighted += int((part * position).sum())
        digest.update(f"{name}:{plain}:{weighted};".encode())
    return digest.hexdigest()


def replica(model: str, device: str, prompts: list[list[int]], steps: int, out: Path, mode: str) -> None:
    """One replica: the weights' digest, then per prompt each step's logits digest and greedy token."""
    runner = ModelRunner(RuntimeConfig(
        model=model, device=device, dtype="bfloat16" if device == "cuda" else "float32", max_model_len=1024,
        kv_cache_tokens=4096, max_batch_size=1, layer_kernels="fused" if device == "cuda" else "reference",
        stages={"nocompile": "eager", "kernels": "kernels"}.get(mode, "compiled"), use_cuda_graphs=mode != "nographs"))
    runs, prefill_s = [], []
    warm_up = runner.kv.new_sequence()
    runner.forward([StepInput(warm_up, prompts[0], 1)])  # the first launches: compiling, timing picks
    warm_up.release()
    for prompt in prompts:
        kv = runner.kv.new_sequence()
        logits, tokens = [], []
        token_ids = prompt
        for step in range(steps + 1):
            start = time.perf_counter()
            [step_logits] = runner.forward([StepInput(kv, token_ids, 1)])
            row = step_logits[-1].float().cpu()
            if step == 0:
                prefill_s.append(time.perf_counter() - start)
            logits.append(hashlib.sha256(row.numpy().tobytes()).hexdigest())
            tokens.append(int(row.argmax()))
            token_ids = [tokens[-1]]
        kv.release()
        runs.append({"logits": logits, "tokens": tokens})
    out.write_text(json.dumps({"weights": weights_digest(runner.model), "runs": runs, "prefill_s": prefill_s}))


def spawn(model: str, device: str, prompts_file: Path, steps: int, out: Path, mode: str,
          env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--child", model, "--device", device, "--prompts-file",
                             str(prompts_file), "--steps", str(steps), "--child-out", str(out), "--modes", mode],
                            env={**os.environ, **env})


def compare(first: dict, other: dict, label: str) -> dict[str, float]:
    steps = [next((i for i, (a, b) in enumerate(zip(r0["logits"], r1["logits"])) if a != b), -1)
             for r0, r1 in zip(first["runs"], other["runs"])]
    differing = [s for s in steps if s >= 0]
    return {
        f"{label}_same_weights": float(first["weights"] == other["weights"]),
        f"{label}_prompts_differing": float(sum(r0["tokens"] != r1["tokens"] for r0, r1 in zip(first["runs"], other["runs"]))),
        f"{label}_first_differing_step": float(min(differing) if differing else -1),
        f"{label}_prefill_same_bits": float(all(r0["logits"][0] == r1["logits"][0]
                                                for r0, r1 in zip(first["runs"], other["runs"]))),
    }


def generated_code(cache_dir: Path) -> dict[str, str]:
    """An inductor cache's generated kernels and autotune picks: {content digest: text} of its .py sources,
    and {source digest + ".best_config": the pick} where a pick sits beside its source. The cache's own
    directory, which the sources name in comments, is replaced by CACHE first, so replicas' equal sources
    compare equal."""
    found: dict[str, str] = {}
    for path in sorted(cache_dir.rglob("*.py")):
        text = path.read_text(errors="replace").replace(str(cache_dir), "CACHE")
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        found[digest] = text
        pick = path.with_suffix(".best_config")
        if pick.exists():
            found[digest + ".best_config"] = pick.read_text(errors="replace")
    return found


def compare_code(first: dict[str, str], other: dict[str, str], label: str, details: dict) -> dict[str, float]:
    """How two replicas' inductor caches differ: sources only one of them generated, and picks that differ for
    the same source; the first few of each kept in `details` (truncated) for reading."""
    only = {"first": sorted(set(first) - set(other)), "other": sorted(set(other) - set(first))}
    picks = [k for k in first if k.endswith(".best_config") and k in other and first[k] != other[k]]
    details[f"{label}_code"] = {
        "only_in_first": {k: first[k][:6000] for k in only["first"][:8]},
        "only_in_this": {k: other[k][:6000] for k in only["other"][:8]},
        "picks_differing": {k: [first[k], other[k]] for k in picks[:8]},
    }
    return {f"{label}_sources_only_in_one": float(len(only["first"]) + len(only["other"])),
            f"{label}_picks_differing": float(len(picks))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: checks the script only")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["tuned", "deterministic"])
    parser.add_argument("--replicas", type=int, default=3, help="started side by side, per mode")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_replicas.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    parser.add_argument("--prompts-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        replica(args.child, args.device, json.loads(args.prompts_file.read_text()), args.steps, args.child_out,
                args.modes[0])
        return
    device, shape = ("cpu", TINY) if args.tiny else ("cuda", LLAMA_8B)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = write_model_dir(work / "target", shape, build_tokenizer())
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, shape["vocab_size"] - 1, (args.prompt_tokens,), generator=gen).tolist()
                   for _ in range(args.prompts)]
        (prompts_file := work / "prompts.json").write_text(json.dumps(prompts))
        metrics: dict[str, float] = {}
        details: dict = {}
        for mode in args.modes:
            env = {"TORCHINDUCTOR_DETERMINISTIC": "1" if mode == "deterministic" else "0"}
            outs = [work / f"{mode}{i}.json" for i in range(args.replicas)]
            children = [spawn(model, device, prompts_file, args.steps, out, mode,
                              {**env, "TORCHINDUCTOR_CACHE_DIR": str(work / f"{mode}{i}-inductor")})
                        for i, out in enumerate(outs)]
            codes = [p.wait() for p in children]
            if any(codes):
                raise SystemExit(f"a {mode} replica failed: exit codes {codes}")
            results = [json.loads(out.read_text()) for out in outs]
            code = [generated_code(work / f"{mode}{i}-inductor") for i in range(args.replicas)]
            for i, result in enumerate(results[1:], start=1):
                metrics.update(compare(results[0], result, f"{mode}_r{i}"))
                metrics.update(compare_code(code[0], code[i], f"{mode}_r{i}", details))
            metrics[f"{mode}_prefill_ms"] = 1e3 * statistics.median(s for r in results for s in r["prefill_s"])
            print(mode, {k: v for k, v in metrics.items() if k.startswith(mode)}, flush=True)
    save_report("gpu_replicas", metrics, args.out, replicas_side_by_side=args.replicas,
                inductor_has_deterministic_mode=hasattr(torch._inductor.config, "deterministic"), prompts=args.prompts,
                prompt_tokens=args.prompt_tokens, decode_steps=args.steps, details=details)


if __name__ == "__main__":
    main()
