"""A serving benchmark of the trio, as `vllm bench serve` measures one: requests arrive as a Poisson process at a
given rate, and each one's latency is taken apart into time to first token, time per output token and the gaps
between its chunks, as users compare serving systems.

The trio as processes (bench/gpu_e2e.py's models: random Llama-3.1-8B-shape target, Llama-3.2-1B-shape draft, bf16;
`--tiny`: tiny models on the CPU, a check of the script, no meaningful numbers), started once. The draft is
bench/oracle_draft.py: SYNTHETIC ACCEPTANCE - the draft runs its real forwards, then its proposals are replaced by
the target's known greedy continuation at rate `--alpha` (random weights would accept nothing). The model services
run with `--max-batch-size`. `--variant LABEL[:--FLAG=VALUE,...]` (repeatable; default one, `base`) runs a target
service and a gateway of its own for each variant, the flags appended to its target's command line, beside the
others and sharing the one draft service: an A/B of a target option side by side in one run (e.g. `--variant base
--variant one_prefill:--max-prefills-per-iteration=1`), each rate's runs in turn, the variants' order rotated from
one rate to the next.

First each prompt's reference: its greedy output target-only (k = 0) on the first variant, one request at a time,
which the oracle proposes from. Then for each rate of `--rates` (requests/s; `inf` sends them all at once), each mode,
target_only (k = 0) and spec (k = `--k`, the oracle at alpha), and each variant, after a short warm-up request: `--num-requests` greedy requests
whose start times follow a Poisson process (exponential gaps of mean 1/rate, drawn from `--seed`: the same schedule
for both modes), prompts cycled, each in a thread of its own over the streaming Generate RPC; every chunk's arrival
(time.perf_counter) and token count are kept. Per request, over the requests that completed:
  * TTFT: from sending it to its first chunk;
  * TPOT: (last chunk - first chunk) / (tokens - 1), the time per token after the first;
  * ITL: each gap between consecutive chunks of the request. In spec mode a chunk carries every token a step
    committed (1 to k + 1), so an ITL is a step's time, not a token's - as vLLM's bench reports ITL for
    speculative decoding too; TPOT is the per-token figure.
Percentiles by linear interpolation between the closest ranks (numpy's default, which vLLM's bench uses).
Every output is checked equal to its prompt's reference; failures (gRPC errors) are counted by status code.

Writes bench/results/gpu_serving.json (`--out`); metrics per `{label}_{mode}_rate{rate:g}_`: ttft_ms_p50, ttft_ms_p99,
tpot_ms_p50, tpot_ms_p99, itl_ms_p50, itl_ms_p99, itl_ms_max, tok_s (generated tokens / (last finish - first
send)), req_s (completed requests / the same span), requests_completed, requests_failed, failures_by_code,
outputs_differ, tokens_per_chunk, acceptance_rate (spec: accepted / drafted tokens); for each variant after the
first `{label}_over_{first}_{mode}_rate{rate:g}_` + ttft_ms_p50, ttft_ms_p99, tpot_ms_p50, itl_ms_p99, tok_s (its
figure / the first's); and alpha, k, variants (label: target flags), max_batch_size, num_requests, max_new_tokens,
seed.
Usage: python bench/gpu_serving.py [--tiny] [--rates 4 8 16] [--num-requests 64] [--max-new-tokens 128]
                                   [--alpha 0.8] [--k 4] [--max-batch-size 8] [--seed 0]
                                   [--variant LABEL[:--FLAG=VALUE,...] ...] [--draft-quantize none|int8|w8a8]
                                   [--draft-head-rows N] [--out PATH]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

import specdec  # noqa: E402,F401 - before grpc: it picks gRPC's poller (specdec/__init__.py)
import grpc  # noqa: E402

from gpu_e2e import bench_models, gateway_over, generate, target_only_outputs, write_continuations  # noqa: E402
from report import save_report  # noqa: E402

from specdec.client import build_request  # noqa: E402
from specdec.launch import Trio, interrupt_on_sigterm  # noqa: E402
from specdec.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402

MODES = ("target_only", "spec")
RATIO_FIGURES = ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "itl_ms_p99", "tok_s")
REQUEST_TIMEOUT_S = 600


@dataclass
class RequestRecord:
    """What one request's client saw: its prompt's index, when it was sent, each chunk's (arrival, token count),
    when its stream ended, its output, the failure's status code name (None: it completed), its step counts."""

    prompt: int
    sent: float
    chunks: list[tuple[float, int]]
    finished: float
    token_ids: list[int]
    error: str | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


def poisson_schedule(num_requests: int, rate: float, seed: int) -> list[float]:
    """Start times (s after the first) of `num_requests` requests arriving as a Poisson process of `rate` per second:
    0, then exponential gaps of mean 1 / rate drawn from `seed` (all 0 at an infinite rate)."""
    rng = random.Random(seed)
    times, at = [], 0.0
    for i in range(num_requests):
        if i:
            at += rng.expovariate(rate)
        times.append(at)
    return times


def percentile(values: list[float], q: float) -> float | None:
    """The `q`th percentile (0-100) of `values` by linear interpolation between the closest ranks (numpy's default,
    as vLLM's bench computes them): rank q / 100 * (n - 1) of the sorted values; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def request_figures(sent: float, chunks: list[tuple[float, int]]) -> tuple[float | None, float | None, list[float]]:
    """A request's TTFT (s, sent to first chunk), TPOT (s, (last chunk - first chunk) / (tokens - 1); None for fewer
    than 2 tokens) and ITLs (s, the gaps between consecutive chunks) from its chunks' (arrival, token count)."""
    if not chunks:
        return None, None, []
    arrivals = [at for at, _ in chunks]
    tokens = sum(n for _, n in chunks)
    tpot = (arrivals[-1] - arrivals[0]) / (tokens - 1) if tokens > 1 else None
    return arrivals[0] - sent, tpot, [b - a for a, b in zip(arrivals, arrivals[1:])]


def _ms(seconds: float | None) -> float | None:
    """Seconds to milliseconds, None kept."""
    return None if seconds is None else 1e3 * seconds


def aggregate(records: list[RequestRecord], references: list[list[int]], prefix: str) -> dict:
    """One run's metrics, each name `prefix` + figure: latency percentiles over the completed requests, throughput
    over the span from the first send to the last finish, failures by code, outputs unlike their reference."""
    done = [r for r in records if r.error is None]
    figures = [request_figures(r.sent, r.chunks) for r in done]
    ttfts = [ttft for ttft, _, _ in figures if ttft is not None]
    tpots = [tpot for _, tpot, _ in figures if tpot is not None]
    itls = [gap for _, _, gaps in figures for gap in gaps]
    span = max(r.finished for r in records) - min(r.sent for r in records) if records else 0.0
    tokens = sum(len(r.token_ids) for r in done)
    chunks = sum(len(r.chunks) for r in done)
    drafted = sum(r.num_draft_tokens for r in done)
    failures = Counter(r.error for r in records if r.error is not None)
    figures_by_name = {
        "ttft_ms_p50": _ms(percentile(ttfts, 50)), "ttft_ms_p99": _ms(percentile(ttfts, 99)),
        "tpot_ms_p50": _ms(percentile(tpots, 50)), "tpot_ms_p99": _ms(percentile(tpots, 99)),
        "itl_ms_p50": _ms(percentile(itls, 50)), "itl_ms_p99": _ms(percentile(itls, 99)),
        "itl_ms_max": _ms(max(itls, default=None)),
        "tok_s": tokens / span if span > 0 else 0.0, "req_s": len(done) / span if span > 0 else 0.0,
        "requests_completed": len(done), "requests_failed": sum(failures.values()),
        "failures_by_code": dict(failures),
        "outputs_differ": sum(r.token_ids != references[r.prompt] for r in done),
        "tokens_per_chunk": tokens / chunks if chunks else None,
        "acceptance_rate": sum(r.num_accepted_tokens for r in done) / drafted if drafted else None,
    }
    return {f"{prefix}{name}": value for name, value in figures_by_name.items()}


def send(stub: gateway_pb2_grpc.GatewayStub, request: gateway_pb2.GenerateRequest, prompt: int,
         records: list[RequestRecord | None], index: int) -> None:
    """One streamed Generate: every chunk's arrival and token count, the output or the failure's code, into
    `records[index]`."""
    chunks, token_ids, error, final = [], [], None, None
    sent = time.perf_counter()
    try:
        for chunk in stub.Generate(request, timeout=REQUEST_TIMEOUT_S):
            now = time.perf_counter()
            if chunk.token_ids:
                chunks.append((now, len(chunk.token_ids)))
                token_ids += chunk.token_ids
            final = chunk
    except grpc.RpcError as e:
        error = e.code().name
    stats = final.stats if final is not None else None
    records[index] = RequestRecord(prompt, sent, chunks, time.perf_counter(), token_ids, error,
                                   stats.num_draft_tokens if stats else 0, stats.num_accepted_tokens if stats else 0)


def run_load(stub: gateway_pb2_grpc.GatewayStub, requests: list[tuple[int, gateway_pb2.GenerateRequest]],
             schedule: list[float]) -> list[RequestRecord]:
    """Sends request i (prompt index, request) `schedule[i]` s from now, each in a thread of its own; returns their
    records once every one has finished."""
    records: list[RequestRecord | None] = [None] * len(requests)
    threads = []
    started = time.perf_counter()
    for i, ((prompt, request), at) in enumerate(zip(requests, schedule)):
        time.sleep(max(0.0, started + at - time.perf_counter()))
        thread = threading.Thread(target=send, args=(stub, request, prompt, records, i), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    lost = [i for i, record in enumerate(records) if record is None]
    if lost:  # a thread raised something other than a gRPC error: its traceback is printed above
        raise RuntimeError(f"requests {lost} ended without a record: their client threads raised")
    return records


def mode_settings(mode: str, args: argparse.Namespace) -> tuple[int, str | None]:
    """A mode's draft tokens per step and draft name: target_only k 0; spec k `args.k` on the oracle at alpha."""
    return (0, None) if mode == "target_only" else (args.k, f"oracle-{args.alpha:g}")


def parse_variant(spec: str) -> tuple[str, list[str]]:
    """`LABEL[:--FLAG=VALUE,...]` -> (label, the target's extra flags)."""
    label, _, flags = spec.partition(":")
    if not label.isidentifier():
        raise argparse.ArgumentTypeError(f"a variant's label must be a name (letters, digits, _), got {label!r}")
    return label, [flag for flag in flags.split(",") if flag]


def rotated(items: list, by: int) -> list:
    """`items` starting at index `by` (modulo their number), then wrapping round."""
    by %= len(items)
    return items[by:] + items[:by]


def ratios(metrics: dict, labels: list[str], prefixes: list[str]) -> dict:
    """Each variant after the first: its ratio to the first's of the headline figures, at every mode and rate."""
    out = {}
    for label in labels[1:]:
        for prefix in prefixes:
            for name in RATIO_FIGURES:
                ours, base = metrics[f"{label}_{prefix}{name}"], metrics[f"{labels[0]}_{prefix}{name}"]
                if ours is not None and base:
                    out[f"{label}_over_{labels[0]}_{prefix}{name}"] = round(ours / base, 4)
    return out


def serve_rates(stubs: dict[str, gateway_pb2_grpc.GatewayStub], prompts: list[str], references: list[list[int]],
                args: argparse.Namespace) -> dict:
    """Every rate in both modes on every variant's gateway (in turn, their order rotated from rate to rate), each
    run after a warm-up request; the metrics of every run, and the later variants' ratios to the first's."""
    metrics, prefixes = {}, []
    for r, rate in enumerate(args.rates):
        schedule = poisson_schedule(args.num_requests, rate, args.seed)
        for mode in MODES:
            k, draft = mode_settings(mode, args)
            prefixes.append(f"{mode}_rate{rate:g}_")
            requests = [(i % len(prompts), build_request(prompts[i % len(prompts)], chat=False,
                                                         max_new_tokens=args.max_new_tokens, num_draft_tokens=k,
                                                         stop=[], draft_model=draft))
                        for i in range(args.num_requests)]
            for label in rotated(list(stubs), r):
                generate(stubs[label], prompts[0], 8, k, draft)  # warm the path
                started = time.perf_counter()
                run = aggregate(run_load(stubs[label], requests, schedule), references, f"{label}_{prefixes[-1]}")
                print(f"gpu_serving: {label} {mode} at {rate:g} req/s: {args.num_requests} requests in "
                      f"{time.perf_counter() - started:.1f} s, {run[f'{label}_{prefixes[-1]}requests_failed']} failed",
                      file=sys.stderr, flush=True)
                metrics.update(run)
    return {**metrics, **ratios(metrics, list(stubs), prefixes)}


def parse_args() -> argparse.Namespace:
    """The command line (module doc)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU: checks the script only")
    parser.add_argument("--rates", type=float, nargs="+", default=[4.0, 8.0, 16.0],
                        help="request arrival rates (requests/s; inf: all at once)")
    parser.add_argument("--num-requests", type=int, default=64, help="requests per rate and mode")
    parser.add_argument("--num-prompts", type=int, default=8, help="distinct prompts, cycled over the requests")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--alpha", type=float, default=0.8, help="the oracle draft's synthetic acceptance rate")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per step in spec mode")
    parser.add_argument("--max-batch-size", type=int, default=8, help="the model services' --max-batch-size")
    parser.add_argument("--seed", type=int, default=0, help="of the Poisson arrival times")
    parser.add_argument("--variant", type=parse_variant, action="append", metavar="LABEL[:--FLAG=VALUE,...]",
                        help="a target service (and gateway) of its own with these flags (repeatable; default: base)")
    parser.add_argument("--draft-quantize", choices=["none", "int8", "w8a8"], default="none")
    parser.add_argument("--draft-head-rows", type=int, default=None,
                        help="the draft's LM head keeps this many vocabulary rows (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_serving.json")
    args = parser.parse_args()
    if args.num_requests < 1 or args.k < 1 or args.max_batch_size < 1:
        parser.error("--num-requests, --k and --max-batch-size must be at least 1")
    if any(not rate > 0 for rate in args.rates):
        parser.error("--rates must be positive")
    pairs = args.variant or [("base", [])]
    args.variants = dict(pairs)
    if len(args.variants) < len(pairs):
        parser.error("each --variant needs a label of its own")
    return args


def main() -> None:
    interrupt_on_sigterm()  # a timeout's SIGTERM still stops the services
    os.environ.setdefault("TQDM_DISABLE", "1")  # the services' capture progress bars: they drown a log's tail
    args = parse_args()
    metrics = {"alpha": args.alpha, "k": args.k, "variants": args.variants, "max_batch_size": args.max_batch_size,
               "num_requests": args.num_requests, "max_new_tokens": args.max_new_tokens, "seed": args.seed}
    with tempfile.TemporaryDirectory(prefix="specdec-serving-") as tmp:
        work = Path(tmp)
        models = bench_models(work, args.tiny, args.draft_head_rows, args.num_prompts, args.prompt_tokens,
                              args.max_new_tokens)
        flags = [*models.service_flags, "--max-batch-size", str(args.max_batch_size)]
        continuations = work / "continuations.json"
        continuations.write_text("[]")
        trio = Trio(work)
        try:
            targets = {label: trio.spawn(f"target-{label}", "target_service",
                                         ["--model", models.target, *flags, *target_flags], unix_socket=True)
                       for label, target_flags in args.variants.items()}
            draft = trio.spawn("draft", "bench.oracle_draft", [
                "--model", models.draft, "--continuations", str(continuations), "--alphas", f"{args.alpha:g}",
                "--quantize", args.draft_quantize, *flags], unix_socket=True)
            with ExitStack() as channels:
                stubs = {label: gateway_pb2_grpc.GatewayStub(channels.enter_context(grpc.insecure_channel(
                    gateway_over(trio, target, draft, f"gateway-{label}")))) for label, target in targets.items()}
                references = target_only_outputs(next(iter(stubs.values())), models.prompts, args.max_new_tokens)
                write_continuations(continuations, models.prompt_ids, references)
                metrics.update(serve_rates(stubs, models.prompts, references, args))
        finally:
            trio.stop()
    save_report("gpu_serving", metrics, args.out,
                note=f"spec: SYNTHETIC acceptance (oracle draft, alpha {args.alpha:g}, k {args.k}); random weights; "
                     f"Poisson arrivals; ITL is per chunk (a spec chunk carries a step's tokens)")


if __name__ == "__main__":
    main()
