"""Host overhead per step of the trio: the time a step takes outside the two services' forwards.

Starts target, draft and two gateways (speculation off / on) as separate processes, as
bench/gpu_e2e.py does, and drives `Generate` over gRPC with 1 and 8 concurrent streams. Per
configuration it reports the step time a request sees after its first token (bench/step_times.py:
the prefills left out), the service forward times per step (from the final stats chunk), their
difference (`overhead_ms`: gRPC, the gateway, the batching loops), and the target's mean batch size per forward (GetEngineStats: sequence
steps / forwards - 8 concurrent streams should give ~8; the draft's likewise). Speculative outputs are checked equal to
target-only outputs (greedy, lossless). Each process's CPU time (all its threads, /proc) per request step
(`*_cpu_us_per_step`: one request's verify step; 8 streams make 8 a batched step) is the host work that
does not depend on the models: the gateway's is the same on any GPU.

Default: tiny random Llama models on the CPU (the draft a perturbed copy of the target, so it
accepts some), where a forward takes ~1 ms and the host work dominates - a reproduction of the host
overhead measured on the H200 (docs/benchmarks.md, issue 4). `--gpu`: the 8B / 1B shapes of gpu_e2e.py in bf16.
Usage: python bench/rpc_overhead.py [--gpu] [--layer-kernels auto|fused|reference] [--rounds N] [--tcp] [--out PATH]
The gateways reach the model services over their Unix sockets, as specdec-launch wires them (--tcp: over TCP).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

import specdec  # noqa: E402,F401 - before grpc: it picks gRPC's poller (specdec/__init__.py)
import grpc  # noqa: E402

from gpu_e2e import LLAMA_1B, LLAMA_8B, generate, prompts_text, write_model_dir  # noqa: E402
from process_cpu import process_cpu_s  # noqa: E402
from report import save_report  # noqa: E402
from specdec.launch import Trio, interrupt_on_sigterm  # noqa: E402
from specdec.v1 import common_pb2, draft_pb2_grpc, gateway_pb2_grpc, target_pb2_grpc  # noqa: E402
from step_times import decode_step_times  # noqa: E402
from tiny_models import build_model_dir, build_tokenizer  # noqa: E402

SPEC_KS = {1: 4, 8: 2}  # draft tokens per step at each batch size (as the H200 figures)
STUBS = {"target": target_pb2_grpc.TargetServiceStub, "draft": draft_pb2_grpc.DraftServiceStub}


def run_config(gateway: str, services: dict[str, str], prompts: list[str], batch: int, max_new: int, k: int,
               pids: dict[str, int]) -> dict:
    """`batch` concurrent streams over all prompts; step and forward times per verify step.

    `services`: "target" and "draft" addresses, whose engine counters give the rows per forward;
    `pids`: the processes whose CPU time per request step is reported ("gateway", "target", "draft")."""
    with grpc.insecure_channel(gateway) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        generate(stub, prompts[0], 8, k)  # warm the path
        before = {name: engine_stats(name, address) for name, address in services.items()}
        cpu_before = {name: process_cpu_s(pid) for name, pid in pids.items()}
        completions = []
        started = time.perf_counter()
        with ThreadPoolExecutor(batch) as pool:
            for i in range(0, len(prompts), batch):
                completions += list(pool.map(lambda p: generate(stub, p, max_new, k), prompts[i:i + batch]))
        wall = time.perf_counter() - started
        cpu = {name: process_cpu_s(pid) - cpu_before[name] for name, pid in pids.items()}
        after = {name: engine_stats(name, address) for name, address in services.items()}
    stats = [c.final.stats for c in completions]
    steps = decode_step_times(stats)  # after the first token: the prefills left out (bench/step_times.py)
    rows = {f"{name}_rows_per_forward": (after[name].num_sequence_steps - before[name].num_sequence_steps)
            / max(1, after[name].num_forwards - before[name].num_forwards) for name in services}
    num_steps = sum(s.num_verify_steps for s in stats)
    rows |= {f"{name}_cpu_us_per_step": seconds / num_steps * 1e6 for name, seconds in cpu.items()}
    return {
        "tok_s": sum(s.num_completion_tokens for s in stats) / wall,
        "step_ms": steps["step_ms"],
        "target_ms_per_step": steps["target_ms_per_step"],
        "draft_ms_per_step": steps["draft_ms_per_step"],
        "overhead_ms_per_step": steps["overhead_ms_per_step"],
        "overhead_fraction": steps["rpc_overhead_fraction"],
        # the accounting before the prefills were reported apart: whole requests, per verify step
        "overhead_fraction_whole_request": 1 - sum(s.draft_forward_s + s.target_forward_s for s in stats)
        / sum(s.num_completion_tokens / s.tokens_per_s for s in stats),
        **rows,
        "acceptance_rate": sum(s.num_accepted_tokens for s in stats) / max(1, sum(s.num_draft_tokens for s in stats)),
        "token_ids": [c.token_ids for c in completions],
    }


def engine_stats(service: str, address: str) -> common_pb2.EngineStats:
    """A model service's engine counters ("target" or "draft")."""
    with grpc.insecure_channel(address) as channel:
        return STUBS[service](channel).GetEngineStats(common_pb2.EngineStatsRequest())


def model_dirs(work: Path, gpu: bool) -> tuple[str, str]:
    tokenizer = build_tokenizer()
    if gpu:
        return (write_model_dir(work / "target", LLAMA_8B, tokenizer),
                write_model_dir(work / "draft", LLAMA_1B, tokenizer))
    target = build_model_dir(work / "target", tokenizer, seed=0)
    draft = build_model_dir(work / "draft", tokenizer, seed=1, perturb_from=target, perturb_scale=0.05)
    return str(target), str(draft)


def main() -> None:
    interrupt_on_sigterm()  # a timeout's SIGTERM still stops the services
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true", help="8B / 1B shapes in bf16 on CUDA")
    parser.add_argument("--layer-kernels", choices=["auto", "fused", "reference"], default=None,
                        help="both model services' layer kernels (default: theirs: fused for the target, auto for the draft)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="each configuration's median over rounds is reported")
    parser.add_argument("--tcp", action="store_true",
                        help="the gateways reach the model services over loopback TCP, not their Unix sockets")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "rpc_overhead.json")
    args = parser.parse_args()
    device, dtype = ("cuda", "bfloat16") if args.gpu else ("cpu", "float32")
    metrics: dict[str, float] = {}
    details: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="specdec-overhead-") as tmp:
        work = Path(tmp)
        target_model, draft_model = model_dirs(work, args.gpu)
        prompts = prompts_text(build_tokenizer(), args.num_prompts, args.prompt_tokens)
        # one torch thread per service on the CPU: idle OpenMP workers spinning after a forward
        # would take the cores the host work being measured runs on
        threads = [] if args.gpu else ["--num-threads", "1"]
        common = [*threads, "--device", device, "--dtype", dtype, "--max-model-len", "1024", "--log-level", "WARNING",
                  *(["--layer-kernels", args.layer_kernels] if args.layer_kernels else []),
                  "--kv-cache-tokens", str(16 * (args.prompt_tokens * 2 + args.max_new_tokens + 64))]
        trio = Trio(work)
        try:
            unix = not args.tcp  # the gateways' links, as specdec-launch wires them
            target_service = trio.spawn("target", "target_service", ["--model", target_model, *common], unix_socket=unix)
            draft_service = trio.spawn("draft", "draft_service", [
                "--drafter", "model", "--model", draft_model, "--quantize", "none", *common], unix_socket=unix)
            target, draft = trio.wait_ready(target_service, 900), trio.wait_ready(draft_service, 900)
            plain_gateway = trio.spawn("gateway-plain", "gateway", [
                "--target", target, "--draft", "none", "--log-level", "WARNING"])
            spec_gateway = trio.spawn("gateway", "gateway", [
                "--target", target, "--draft", draft, "--log-level", "WARNING"])
            plain, gateway = trio.wait_ready(plain_gateway, 60), trio.wait_ready(spec_gateway, 60)
            services = {"target": target, "draft": draft}
            models = {"target": target_service.process.pid, "draft": draft_service.process.pid}
            configs = {f"target_only_bs{b}": (plain, b, 0, plain_gateway.process.pid) for b in SPEC_KS}
            configs |= {f"spec_k{k}_bs{b}": (gateway, b, k, spec_gateway.process.pid) for b, k in SPEC_KS.items()}
            runs: dict[str, list[dict]] = {name: [] for name in configs}
            for _ in range(args.rounds):  # rounds interleave configurations, so drift hits all alike
                for name, (address, batch, k, gateway_pid) in configs.items():
                    runs[name].append(run_config(address, services, prompts, batch, args.max_new_tokens, k,
                                                 {"gateway": gateway_pid, **models}))
        finally:
            trio.stop()
    reference = runs["target_only_bs1"][0]["token_ids"]
    for name, results in runs.items():
        differ = sum(sum(a != b for a, b in zip(r.pop("token_ids"), reference)) for r in results)
        median = {key: statistics.median(r[key] for r in results) for key in results[0]}
        details[name] = {**median, "outputs_differ_from_target_only_bs1": differ}
        for key in ("step_ms", "overhead_ms_per_step", "target_ms_per_step", "tok_s", "gateway_cpu_us_per_step",
                    "target_cpu_us_per_step", "draft_cpu_us_per_step"):
            metrics[f"{name}_{key}"] = median[key]
    metrics["spec_k4_bs1_overhead_fraction"] = details["spec_k4_bs1"]["overhead_fraction"]
    metrics["spec_k4_bs1_overhead_fraction_whole_request"] = details["spec_k4_bs1"]["overhead_fraction_whole_request"]
    metrics["outputs_differ"] = sum(d["outputs_differ_from_target_only_bs1"] for d in details.values())
    save_report("rpc_overhead", metrics, args.out, details=details,
                note="step_ms: a request's time per verify step; overhead: step minus the services' forwards; "
                     "medians over rounds; tiny random models on the CPU unless --gpu")


if __name__ == "__main__":
    main()
