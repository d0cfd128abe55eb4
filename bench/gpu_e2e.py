"""End-to-end benchmark of the trio on one GPU: gateway, draft and target as separate processes.

Random-weight Llama-3.1-8B-shape target and Llama-3.2-1B-shape draft, bf16, driven over gRPC
`Generate` with 1 and 8 concurrent streams, same prompts for every configuration:
  * target_only: our trio with speculation off (k = 0);
  * spec at alpha x k: SYNTHETIC ACCEPTANCE (bench/oracle_draft.py): the draft runs its real
    forwards, then its proposals are replaced by the target's known greedy continuation at rate
    alpha - random weights would accept nothing;
  * hf_static: HF transformers generate() with its static cache (auto-compiled), same shapes; the
    fastest of HF_RUNS timed calls after a warm-up (each in `details`).
Each target-only and oracle configuration runs `--rounds` times in a row (default 3; until 2026-12-06 once):
its figures are those of its round of median throughput, every round's tok/s in `details`. Beside
throughput and each step's parts: the gateway's CPU time per request step (all its threads,
bench/process_cpu.py), target-only and alpha 0.8, k 4 at each batch - its loop serves every request.
Writes bench/results/gpu_e2e.json. `--tiny` runs the same flow with tiny models on the CPU (a check
of the script, no meaningful numbers). `--draft-ahead` has the draft draft ahead while the target
verifies (engine/model_drafter.py; the oracle also replaces the chain's guess of the target's
token at rate alpha), `--draft-gpu N` runs the draft service on GPU N alone (a machine of several).
`--draft-head-rows N` gives the draft an LM head of N vocabulary rows (engine/subset_head.py, as
the shipped distilled draft has; EAGLE-3's Llama drafts keep 32k of 128k): a smaller product each
draft forward, verification unchanged. `--draft-quantize int8` serves the draft with weight-only
int8 linears (half of bf16's bytes a draft step reads; a draft's numerics change what it proposes,
never the output; under the oracle, acceptance is the same either way). `--busy-poll` is every
service's flag (specdec/busy_poll.py; auto polls on the GPU host), and so is `--idle-poll`
(specdec/idle_cpus.py). `--idle-cpus-ab` runs the services with --idle-poll off and measures target-only
and alpha 0.8 at each batch once more with this process's own idle-CPU spinners running (the
services' mechanism, on the same processes): `*_idle_cpus` metrics. `--no-draft-pdl` runs the draft's
kernels without programmatic dependent launch (engine/pdl.py), which its service uses by default.
`--pin-services` gives each service a CPU of its own once it serves (--cpus, specdec/cpu_affinity.py);
`--pin-ab` starts them unpinned and measures target-only and alpha 0.8 at each batch once more with
every running service's threads pinned to a CPU of its own from here (the same affinity --cpus
sets, on the same processes): `*_pinned` metrics. `--mps` runs the services under a CUDA MPS daemon of
this run's own (bench/mps.py: one GPU context for the draft and the target, no context switch at each
hand-over; the HF baseline runs after it has quit). The gateways reach the model services over their
Unix sockets (--unix-socket), as `specdec-launch` wires a trio on one host; `--tcp` over loopback TCP.
Usage: python bench/gpu_e2e.py [--tiny] [--skip-hf] [--layer-kernels auto|fused|reference]
                               [--batches 1 8] [--ks 2 4] [--draft-ahead] [--draft-gpu N]
                               [--draft-head-rows N] [--draft-quantize none|int8|w8a8] [--busy-poll auto|on|off]
                               [--idle-poll auto|on|off] [--idle-cpus-ab] [--pin-services] [--pin-ab]
                               [--[no-]draft-pdl] [--mps] [--rounds N] [--out PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]  # bench/: when imported, not run

import specdec  # noqa: E402,F401 - before grpc: it picks gRPC's poller (specdec/__init__.py)
import grpc  # noqa: E402

import mps  # noqa: E402
from distill.export import export_draft  # noqa: E402
from engine.model_source import load_pretrained  # noqa: E402
from engine.subset_head import SubsetLMHead  # noqa: E402
from engine.triton_prefetch import PREFETCH_KB  # noqa: E402 - SPECDEC_PREFETCH_KB as the services read it
from process_cpu import process_cpu_s  # noqa: E402
from report import save_report  # noqa: E402
from specdec.busy_poll import MODES as BUSY_POLL_MODES  # noqa: E402
from specdec.client import collect  # noqa: E402
from specdec.cpu_affinity import cpus_from_the_last, pin_process  # noqa: E402
from specdec.idle_cpus import IdleCpus  # noqa: E402
from specdec.launch import Service, Trio, interrupt_on_sigterm  # noqa: E402
from specdec.v1 import common_pb2, draft_pb2_grpc, gateway_pb2, gateway_pb2_grpc  # noqa: E402
from step_times import decode_step_times  # noqa: E402
from tiny_models import build_tokenizer  # noqa: E402

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0)
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
                rope_theta=500000.0, tie_word_embeddings=True)
TINY = dict(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)
ALPHAS, KS, BATCHES = (0.6, 0.8, 0.9), (2, 4), (1, 8)
ROUND_KEYS = ("rounds_tok_s", "rounds_rpc_overhead_fraction", "rounds_outputs_differ")  # run_rounds' own


def write_model_dir(path: Path, shape: dict, tokenizer) -> str:
    LlamaConfig(**shape, bos_token_id=1, eos_token_id=2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return f"random:{path}"


def write_reduced_head_draft(path: Path, base: str, head_rows: int) -> str:
    """A distilled-draft directory (engine/model_source.py) over the random model `base`: all its layers,
    and an LM head of its first `head_rows` vocabulary rows (which rows is immaterial with random weights)."""
    loaded = load_pretrained(base, torch.bfloat16, torch.device("cpu"), path / "cache")
    model = loaded.hf_model
    model.lm_head = SubsetLMHead(model.lm_head.weight, torch.arange(head_rows))
    export_draft(model, loaded.tokenizer, path, base, tuple(range(model.config.num_hidden_layers)), torch.bfloat16,
                 {"benchmark": f"random weights, LM head of {head_rows} rows"})
    return str(path)


def write_continuations(path: Path, prompt_ids: list[list[int]], token_ids: list[list[int]]) -> None:
    """The target's greedy output per prompt, where bench/oracle_draft.py reads it (its Continuations)."""
    path.write_text(json.dumps([{"prompt_ids": p, "token_ids": t} for p, t in zip(prompt_ids, token_ids)]))


def prompts_text(tokenizer, count: int, num_tokens: int) -> list[str]:
    """Prompts of `num_tokens` tokens each (as the gateway tokenizes them), different from each other.
    Random ids decode to text that re-encodes longer (128 ids gave 203-232 tokens), so each prompt
    drops its last id while its text encodes longer, and takes a word token while shorter."""
    gen = torch.Generator().manual_seed(0)
    vocab = len(tokenizer)
    words = [i for i in range(vocab) if re.fullmatch(r" [a-z]+", tokenizer.decode([i]))]
    prompts = []
    for _ in range(count):
        ids = torch.randint(3, vocab, (num_tokens,), generator=gen).tolist()
        for _ in range(4 * num_tokens):
            length = len(tokenizer.encode(text := tokenizer.decode(ids)))
            if length == num_tokens:
                break
            ids = ids[:-1] if length > num_tokens else ids + [words[int(torch.randint(len(words), (1,), generator=gen))]]
        assert length == num_tokens, f"no prompt of {num_tokens} tokens found"
        prompts.append(text)
    return prompts


@dataclass(frozen=True)
class BenchModels:
    """What the side-by-side trio benchmarks (step_trace.py, gpu_ab.py, host_spy.py) serve: the random target
    (None where the benchmark runs the draft alone: draft_load.py, draft_memory.py) and draft directories, the
    prompts as text and as ids, and the model services' common flags."""
    target: str | None
    draft: str
    prompts: list[str]
    prompt_ids: list[list[int]]
    service_flags: list[str]


def bench_models(work: Path, tiny: bool, draft_head_rows: int | None, num_prompts: int, prompt_tokens: int,
                 max_new_tokens: int, with_target: bool = True) -> BenchModels:
    """The 8B / 1B shapes in bf16 on CUDA, or tiny ones on the CPU (`tiny`); the draft's LM head cut to
    `draft_head_rows` rows where given; a KV pool for the prompts' and their tokens' blocks. Without `with_target`
    no target directory is written (16 GB of random 8B weights, minutes of a GPU machine's time): `target` is None."""
    tokenizer = build_tokenizer()
    target_shape, draft_shape = (TINY, {**TINY, "num_hidden_layers": 1}) if tiny else (LLAMA_8B, LLAMA_1B)
    target = write_model_dir(work / "target", target_shape, tokenizer) if with_target else None
    draft = write_model_dir(work / "draft", draft_shape, tokenizer)
    if draft_head_rows:
        draft = write_reduced_head_draft(work / "draft-reduced-head", draft, draft_head_rows)
    prompts = prompts_text(tokenizer, num_prompts, prompt_tokens)
    device, dtype = ("cpu", "float32") if tiny else ("cuda", "bfloat16")
    flags = ["--device", device, "--dtype", dtype, "--max-model-len", "1024", "--log-level", "WARNING",
             "--kv-cache-tokens", str(16 * (prompt_tokens * 2 + max_new_tokens + 64))]
    return BenchModels(target, draft, prompts, [tokenizer.encode(p) for p in prompts], flags)


def generate(stub, prompt: str, max_new: int, k: int, draft_model: str | None = None):
    request = gateway_pb2.GenerateRequest(prompt=prompt, max_new_tokens=max_new, num_draft_tokens=k)
    if draft_model:
        request.draft_model = draft_model
    return collect(stub.Generate(request, timeout=600))


def gateway_over(trio: Trio, target: Service, draft: Service, name: str = "gateway") -> str:
    """Once `target` and `draft` serve, a gateway `name` over them (their Unix sockets, where they listen on one);
    its address."""
    target_address, draft_address = trio.wait_ready(target, 900), trio.wait_ready(draft, 900)
    return trio.wait_ready(trio.spawn(name, "gateway", [
        "--target", target_address, "--draft", draft_address, "--log-level", "WARNING"]), 60)


def target_only_outputs(stub, prompts: list[str], max_new: int) -> list[list[int]]:
    """Each prompt's greedy tokens target-only (k = 0), one request at a time: the references."""
    return [generate(stub, p, max_new, 0).token_ids for p in prompts]


def run_config(stub, prompts: list[str], batch: int, max_new: int, k: int, draft_model: str | None = None,
               gateway_pid: int | None = None) -> dict:
    """`batch` concurrent streams at a time over all prompts; aggregate throughput and stats; with
    `gateway_pid`, the gateway's CPU time per request step (`gateway_cpu_us_per_step`: all its threads)."""
    generate(stub, prompts[0], 8, k, draft_model)  # warm the path
    completions = []
    cpu_before = process_cpu_s(gateway_pid) if gateway_pid is not None else 0.0
    started = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        for i in range(0, len(prompts), batch):
            completions += list(pool.map(lambda p: generate(stub, p, max_new, k, draft_model), prompts[i:i + batch]))
    wall = time.perf_counter() - started
    gateway_cpu_s = process_cpu_s(gateway_pid) - cpu_before if gateway_pid is not None else None
    stats = [c.final.stats for c in completions]
    tokens = sum(s.num_completion_tokens for s in stats)
    elapsed = [s.num_completion_tokens / s.tokens_per_s for s in stats if s.tokens_per_s]
    steps = sum(s.num_verify_steps for s in stats)
    return {
        "tok_s": tokens / wall,
        "acceptance_rate": sum(s.num_accepted_tokens for s in stats) / max(1, sum(s.num_draft_tokens for s in stats)),
        "mean_accepted_len": sum(s.num_completion_tokens - 1 for s in stats) / max(1, steps),
        # a step after the first token: its proposal, its verify, the time outside them (bench/step_times.py)
        **decode_step_times(stats),
        # as measured before the prefill forwards were reported apart: over each whole request, the
        # prefill's time included (the target's prefill counted as a forward)
        # a request's fixed cost, outside its steps: to the first token, and the two prefill forwards in it
        "ttft_ms": 1e3 * statistics.mean(s.time_to_first_token_s for s in stats),
        "ttft_max_ms": 1e3 * max(s.time_to_first_token_s for s in stats),  # a batch's last first token
        "target_prefill_ms": 1e3 * statistics.mean(s.target_prefill_forward_s for s in stats),
        "draft_prefill_ms": 1e3 * statistics.mean(s.draft_prefill_forward_s for s in stats),
        "request_ms": 1e3 * statistics.mean(elapsed),
        "rpc_overhead_fraction_whole_request": statistics.mean(
            max(0.0, e - s.draft_forward_s - s.target_forward_s) / e for s, e in zip(stats, elapsed)),
        **({"gateway_cpu_us_per_step": gateway_cpu_s / max(1, steps) * 1e6} if gateway_cpu_s is not None else {}),
        "token_ids": [c.token_ids for c in completions],
    }


def run_rounds(rounds: int, stub, prompts: list[str], batch: int, max_new: int, k: int, draft_model: str | None = None,
               gateway_pid: int | None = None) -> dict:
    """run_config `rounds` times over the same processes: the round of median throughput, whole (its step's parts
    are that round's), with every round's tok/s and fraction outside the forwards beside it, and how many of the
    later rounds' outputs differ from the first's (greedy: none should)."""
    results = [run_config(stub, prompts, batch, max_new, k, draft_model, gateway_pid) for _ in range(rounds)]
    median = sorted(results, key=lambda r: r["tok_s"])[(rounds - 1) // 2]  # of an even count, the lower one
    return {**median, "rounds_tok_s": [r["tok_s"] for r in results],
            "rounds_rpc_overhead_fraction": [r["rpc_overhead_fraction"] for r in results],
            "rounds_outputs_differ": sum(r["token_ids"] != results[0]["token_ids"] for r in results[1:])}


HF_RUNS = 3  # timed generate() calls after the warm-up; HF's figure is the fastest (the ratios to it the least)


def hf_static_tok_s(shape: dict, prompts_ids: list[list[int]], batch: int, max_new: int, device: str) -> list[float]:
    """tok/s of each of HF_RUNS timed generate() calls, after one that compiles and warms up."""
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=torch.bfloat16).eval()
    length = min(len(p) for p in prompts_ids[:batch])  # one batch needs one length
    ids = torch.tensor([p[:length] for p in prompts_ids[:batch]], device=device)
    gen = dict(do_sample=False, cache_implementation="static", min_new_tokens=max_new, max_new_tokens=max_new)
    model.generate(ids, **gen)  # compile + warm-up
    runs = []
    for _ in range(HF_RUNS):
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        model.generate(ids, **gen)
        if device == "cuda":
            torch.cuda.synchronize()
        runs.append(batch * max_new / (time.perf_counter() - started))
    del model
    return runs


def main() -> None:
    interrupt_on_sigterm()  # a timeout's SIGTERM still stops the services
    os.environ.setdefault("TQDM_DISABLE", "1")  # the services' capture progress bars: they drown a log's tail
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU: checks the script only")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--layer-kernels", choices=["auto", "fused", "reference"], default=None,
                        help="both model services' layer kernels (default: theirs: fused for the target, auto for the draft)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES), help="concurrent streams")
    parser.add_argument("--ks", type=int, nargs="+", default=list(KS), help="draft tokens per step (4 is the headline)")
    parser.add_argument("--draft-ahead", action="store_true", help="the draft drafts ahead while the target verifies")
    parser.add_argument("--draft-gpu", type=int, default=None, help="the draft service on this GPU alone")
    parser.add_argument("--draft-head-rows", type=int, default=None,
                        help="the draft's LM head keeps this many vocabulary rows (default: all)")
    parser.add_argument("--draft-quantize", choices=["none", "int8", "w8a8"], default="none",
                        help="the draft's weights: int8 halves the bytes a draft step reads (engine/linear.py)")
    parser.add_argument("--draft-pdl", action=argparse.BooleanOptionalAction, default=True,
                        help="the draft's kernels with programmatic dependent launch (engine/pdl.py; the draft "
                             "service's default): SPECDEC_PDL=1 or 0 for the draft")
    parser.add_argument("--busy-poll", choices=BUSY_POLL_MODES, default="auto",
                        help="every service's event loop polls while streams are open (specdec/busy_poll.py)")
    parser.add_argument("--idle-poll", choices=BUSY_POLL_MODES, default="off",
                        help="every service keeps the host's idle CPUs polling while streams are open (specdec/idle_cpus.py)")
    parser.add_argument("--pin-services", action="store_true",
                        help="each service on a CPU of its own once serving (--cpus; specdec/cpu_affinity.py)")
    parser.add_argument("--tcp", action="store_true",
                        help="the gateways reach the model services over loopback TCP, not their Unix sockets "
                             "(--unix-socket, as specdec-launch wires them; until 2026-12-05 every run did)")
    parser.add_argument("--idle-cpus-ab", action="store_true",
                        help="services with --idle-poll off; measure again with this process's idle-CPU spinners")
    parser.add_argument("--pin-ab", action="store_true",
                        help="measure target-only and alpha 0.8 again with each service pinned to a CPU of its own")
    parser.add_argument("--mps", action="store_true",
                        help="the services share one GPU context through a CUDA MPS daemon of this run's own (bench/mps.py)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="each target-only and oracle configuration measured this many times in a row; its "
                             "figures are the round of median throughput (every round's in details)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_e2e.json")
    args = parser.parse_args()
    batches, ks = args.batches, args.ks
    if args.mps and (why := mps.check_available()):
        parser.error(f"--mps: {why}")
    if args.pin_ab and (args.idle_cpus_ab or args.pin_services):
        parser.error("--pin-ab starts the services unpinned and measures one variant: not with --idle-cpus-ab or --pin-services")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if 4 not in ks or 1 not in batches:  # the headline figures (metrics without a _bs suffix)
        parser.error("--ks must include 4 and --batches 1: the headline is alpha 0.8, k 4, batch 1")
    device = "cpu" if args.tiny else "cuda"
    dtype = "float32" if args.tiny else "bfloat16"
    target_shape, draft_shape = (TINY, TINY) if args.tiny else (LLAMA_8B, LLAMA_1B)
    metrics: dict[str, float] = {}
    details: dict[str, dict] = {"links": {"gateway_to_models": "tcp" if args.tcp else "unix_socket"}}
    with tempfile.TemporaryDirectory(prefix="specdec-e2e-") as tmp:
        work = Path(tmp)
        tokenizer = build_tokenizer()
        target_model = write_model_dir(work / "target", target_shape, tokenizer)
        draft_model = write_model_dir(work / "draft", {**draft_shape, "num_hidden_layers": 1} if args.tiny else draft_shape,
                                      tokenizer)
        metrics["draft_head_rows"] = args.draft_head_rows or draft_shape["vocab_size"]
        metrics["draft_int8"] = float(args.draft_quantize == "int8")
        metrics["draft_w8a8"] = float(args.draft_quantize == "w8a8")
        metrics["busy_poll"] = args.busy_poll
        idle_poll = "off" if args.idle_cpus_ab else args.idle_poll
        metrics["idle_poll"] = idle_poll
        metrics["draft_pdl"] = float(args.draft_pdl)
        metrics["draft_prefetch_kb"] = PREFETCH_KB if args.draft_pdl else 0  # engine/triton_prefetch.py: with PDL only
        metrics["pinned_services"] = float(args.pin_services)
        metrics["mps"] = float(args.mps)
        if args.draft_head_rows:
            draft_model = write_reduced_head_draft(work / "draft-reduced-head", draft_model, args.draft_head_rows)
        prompts = prompts_text(tokenizer, args.num_prompts, args.prompt_tokens)
        prompt_ids = [tokenizer.encode(p) for p in prompts]
        polling = ["--busy-poll", args.busy_poll, "--idle-poll", idle_poll]
        idle_cpus = IdleCpus() if args.idle_cpus_ab else None
        common = ["--device", device, "--dtype", dtype, "--max-model-len", "1024", "--log-level", "WARNING", *polling,
                  "--max-batch-size", str(max(args.batches)),  # graphs of no larger batch bucket
                  *(["--layer-kernels", args.layer_kernels] if args.layer_kernels else []),
                  "--kv-cache-tokens", str(16 * (args.prompt_tokens * 2 + args.max_new_tokens + 64))]
        # a service's --cpus: a CPU of its own from the last ones (shared round-robin where there are
        # fewer CPUs than services: the CPU tests' --tiny)
        service_cpus = cpus_from_the_last()
        pin = (lambda: ["--cpus", str(next(service_cpus))]) if args.pin_services else (lambda: [])  # noqa: E731
        trio = Trio(work)
        # the A/B variant: (metric suffix, context manager factory) measured again on the same processes
        variant = (("_idle_cpus", lambda: spinning(idle_cpus)) if idle_cpus is not None
                   else ("_pinned", lambda: pinned(trio.services)) if args.pin_ab else None)
        with ExitStack() as stack:
            if args.mps:  # entered first, so left last: the daemon quits once the services have stopped
                stack.enter_context(mps.mps_daemon(work))
            stack.callback(trio.stop)
            if idle_cpus is not None:
                stack.callback(idle_cpus.close)
            started = time.perf_counter()
            # the gateways' link to it: its Unix socket unless --tcp
            target = trio.wait_ready(trio.spawn("target", "target_service", ["--model", target_model, *common, *pin()],
                                                unix_socket=not args.tcp), 900)
            metrics["target_start_s"] = time.perf_counter() - started
            plain_gateway = trio.spawn("gateway-plain", "gateway", ["--target", target, "--draft", "none", "--log-level", "WARNING", *polling, *pin()])
            plain = trio.wait_ready(plain_gateway, 60)
            references = {}  # bf16 greedy output depends on the batch and verify shapes (see the oracle's reference)
            with grpc.insecure_channel(plain) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                for batch in batches:
                    result = run_rounds(args.rounds, stub, prompts, batch, args.max_new_tokens, 0,
                                        gateway_pid=plain_gateway.process.pid)
                    details[f"target_only_bs{batch}"] = {key: result[key] for key in ROUND_KEYS}
                    metrics[f"target_only_tok_s_bs{batch}"] = result["tok_s"]
                    metrics[f"target_only_step_ms_bs{batch}"] = result["step_ms"]
                    metrics[f"target_only_gateway_cpu_us_per_step_bs{batch}"] = result["gateway_cpu_us_per_step"]
                    references[batch] = result["token_ids"]
                    if variant is not None:
                        suffix, entered = variant
                        with entered():
                            result = run_config(stub, prompts, batch, args.max_new_tokens, 0)
                        metrics[f"target_only_tok_s_bs{batch}{suffix}"] = result["tok_s"]
                        metrics[f"target_only_step_ms_bs{batch}{suffix}"] = result["step_ms"]
                        metrics[f"target_only_outputs_differ_bs{batch}{suffix}"] = sum(
                            a != b for a, b in zip(result["token_ids"], references[batch]))
            if len(references) == 2:
                metrics["target_only_outputs_differ_bs1_vs_bs8"] = sum(a != b for a, b in zip(*references.values()))
            draft_env = {"CUDA_VISIBLE_DEVICES": str(args.draft_gpu)} if args.draft_gpu is not None else {}
            draft_env["SPECDEC_PDL"] = "1" if args.draft_pdl else "0"
            continuations = work / "continuations.json"
            continuations.write_text("[]")
            started = time.perf_counter()
            draft = trio.wait_ready(trio.spawn("draft", "bench.oracle_draft", [
                "--model", draft_model, "--continuations", str(continuations),
                "--alphas", *map(str, ALPHAS), *(["--draft-ahead"] if args.draft_ahead else []),
                "--quantize", args.draft_quantize, *common, *pin()],
                env=draft_env, unix_socket=not args.tcp), 900)
            metrics["draft_start_s"] = time.perf_counter() - started
            spec_gateway = trio.spawn("gateway", "gateway", ["--target", target, "--draft", draft, "--log-level", "WARNING", *polling, *pin()])
            gateway = trio.wait_ready(spec_gateway, 60)
            with grpc.insecure_channel(gateway) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                for batch in batches:
                    for k in ks:
                        # the reference: the target's greedy output with the same verify shapes (q = k + 1),
                        # from the real random-weight draft (every proposal rejected)
                        result = run_config(stub, prompts, batch, args.max_new_tokens, k, "plain")
                        reference = result.pop("token_ids")
                        result["outputs_differ_from_target_only"] = sum(
                            a != b for a, b in zip(reference, references[batch]))
                        details[f"real_random_draft_k{k}_bs{batch}"] = result
                        write_continuations(continuations, prompt_ids, reference)
                        for alpha in ALPHAS:
                            ahead_before = ahead_counts(draft)
                            result = run_rounds(args.rounds, stub, prompts, batch, args.max_new_tokens, k,
                                                f"oracle-{alpha:g}", gateway_pid=spec_gateway.process.pid)
                            name = f"alpha{alpha:g}_k{k}_bs{batch}"
                            if args.draft_ahead:
                                hits, misses = (a - b for a, b in zip(ahead_counts(draft), ahead_before))
                                result["ahead_hit_rate"] = hits / max(1, hits + misses)
                            metrics[f"spec_tok_s_{name}"] = result["tok_s"]
                            ids = result.pop("token_ids")
                            result["outputs_differ_from_reference"] = sum(a != b for a, b in zip(ids, reference))
                            details[name] = result
                            if variant is not None and alpha == 0.8:
                                suffix, entered = variant
                                with entered():
                                    result = run_config(stub, prompts, batch, args.max_new_tokens, k, f"oracle-{alpha:g}")
                                metrics[f"spec_tok_s_{name}{suffix}"] = result["tok_s"]
                                ids = result.pop("token_ids")
                                result["outputs_differ_from_reference"] = sum(a != b for a, b in zip(ids, reference))
                                details[f"{name}{suffix}"] = result
    if variant is not None and f"alpha0.8_k4_bs1{variant[0]}" in details:
        suffix = variant[0]
        fast = details[f"alpha0.8_k4_bs1{suffix}"]
        metrics[f"draft_propose_ms_k4{suffix}"] = fast["draft_ms_per_step"]
        metrics[f"target_verify_ms_k4{suffix}"] = fast["target_ms_per_step"]
        metrics[f"rpc_overhead_fraction{suffix}"] = fast["rpc_overhead_fraction"]
        for batch in batches:
            metrics[f"spec_over_target_only_alpha0.8_k4_bs{batch}{suffix}"] = (
                metrics[f"spec_tok_s_alpha0.8_k4_bs{batch}{suffix}"] / metrics[f"target_only_tok_s_bs{batch}{suffix}"])
    best = details["alpha0.8_k4_bs1"]
    metrics["draft_propose_ms_k4"] = best["draft_ms_per_step"]
    metrics["target_verify_ms_k4"] = best["target_ms_per_step"]
    metrics["rpc_overhead_fraction"] = best["rpc_overhead_fraction"]
    metrics["acceptance_alpha0.8_k4_bs1"] = best["acceptance_rate"]
    metrics["mean_accepted_len_alpha0.8_k4_bs1"] = best["mean_accepted_len"]
    if args.draft_ahead:
        metrics["ahead_hit_rate_alpha0.8_k4_bs1"] = best["ahead_hit_rate"]
    for batch in batches:
        if f"alpha0.8_k4_bs{batch}" in details:
            metrics[f"spec_gateway_cpu_us_per_step_alpha0.8_k4_bs{batch}"] = (
                details[f"alpha0.8_k4_bs{batch}"]["gateway_cpu_us_per_step"])
        metrics[f"spec_over_target_only_alpha0.8_k4_bs{batch}"] = (
            metrics[f"spec_tok_s_alpha0.8_k4_bs{batch}"] / metrics[f"target_only_tok_s_bs{batch}"])
    metrics["target_only_tok_s"] = metrics["target_only_tok_s_bs1"]
    for alpha in ALPHAS:
        for k in ks:
            metrics[f"spec_tok_s_alpha{alpha:g}_k{k}"] = metrics[f"spec_tok_s_alpha{alpha:g}_k{k}_bs1"]
    write_report(args.out, metrics, details)  # HF's compile takes minutes: keep what we have
    if not args.skip_hf:
        for batch in batches:
            runs = hf_static_tok_s(target_shape, prompt_ids, batch, args.max_new_tokens, device)
            metrics[f"hf_static_tok_s_bs{batch}"] = max(runs)
            details[f"hf_static_bs{batch}"] = {"tok_s_runs": runs}
        metrics["hf_static_tok_s"] = metrics["hf_static_tok_s_bs1"]
        metrics["spec_over_hf_static_alpha0.8_k4_bs1"] = metrics["spec_tok_s_alpha0.8_k4"] / metrics["hf_static_tok_s"]
        write_report(args.out, metrics, details)


@contextmanager
def spinning(idle_cpus: IdleCpus):
    idle_cpus.resume()
    try:
        yield
    finally:
        idle_cpus.pause()


@contextmanager
def pinned(services: list[Service]):
    """Each running service's threads on a CPU of its own, from the last CPUs (as --pin-services
    gives them), then back on every CPU."""
    everywhere = frozenset(os.sched_getaffinity(0))
    running = [s for s in services if s.process.poll() is None]
    for service, cpu in zip(running, cpus_from_the_last()):
        pin_process(frozenset({cpu}), service.process.pid)
    try:
        yield
    finally:
        for service in running:
            if service.process.poll() is None:
                pin_process(everywhere, service.process.pid)


def ahead_counts(draft: str) -> tuple[int, int]:
    """The draft service's draft-ahead hits and misses so far."""
    with grpc.insecure_channel(draft) as channel:
        stats = draft_pb2_grpc.DraftServiceStub(channel).GetEngineStats(common_pb2.EngineStatsRequest())
    return stats.num_ahead_hits, stats.num_ahead_misses


def write_report(out: Path, metrics: dict[str, float], details: dict[str, dict]) -> None:
    save_report("gpu_e2e", metrics, out, details=details,
                note="spec_* figures use SYNTHETIC acceptance (oracle draft at rate alpha; real draft forwards); "
                     "random weights; bs1 = one stream at a time, bs8 = 8 concurrent streams")


if __name__ == "__main__":
    main()
