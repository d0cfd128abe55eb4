"""A live draft swap under load: how long LoadDraft takes at the 1B shape on the GPU, what it does to the
running streams' gaps between tokens and to throughput, and that no request fails or changes.

The trio as processes (bench/gpu_e2e.py's models: random Llama-3.1-8B-shape target, Llama-3.2-1B-shape draft,
bf16; `--tiny`: tiny models on the CPU, a check of the script). `--streams` clients each send one greedy request
after another (k 4, the real random draft: it accepts next to nothing, so each step commits about one token and a
gap is a step) for `--duration-s`; at a third of it the draft's default is replaced (LoadDraft with replace and
make_default, as `python -m specdec.admin load-draft --default` sends) by the same model loaded again: a full
load, build and graph capture (with `--draft-head-rows` the exported draft directory is read again, from the page
cache - a cold disk adds its read time; without, the random weights are built anew). In-flight sequences finish on
the old draft; requests that start after the answer run on the new one.

Each chunk's arrival is timed; a gap (the time since the request's previous chunk; first tokens apart) belongs to
the window it ends in: `before` (from the end of the warm-up to the swap), `during` (LoadDraft sent to answered),
`after` (to the end). Every output is checked equal to its prompt's target-only output (k = 0, the same trio).
Writes bench/results/gpu_swap.json (metrics: swap_s, requests_completed, requests_failed, outputs_differ, and per
window tok_s_*, gap_ms_p50_*, gap_ms_p99_*, gap_ms_max_*, ttft_ms_max_*; on a GPU the draft process's memory as
nvidia-smi reports it twice a second: draft_gpu_mib_before_swap, draft_gpu_mib_peak (both drafts resident) and
draft_gpu_mib_end (what the process still holds: PyTorch's caching allocator keeps what a freed draft used, for the
process to reuse, rather than give it back to the GPU).
Usage: python bench/gpu_swap.py [--tiny] [--streams 8] [--duration-s 45] [--draft-quantize none|int8|w8a8]
                                [--draft-head-rows N] [--out PATH]
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

import specdec  # noqa: E402,F401 - before grpc: it picks gRPC's poller (specdec/__init__.py)
import grpc  # noqa: E402

from gpu_e2e import bench_models, gateway_over, target_only_outputs  # noqa: E402
from report import save_report  # noqa: E402
from process_memory import Sampler, gpu_mib  # noqa: E402
from soak import ADMIN_TOKEN, load_default_draft  # noqa: E402

from specdec.launch import Trio, interrupt_on_sigterm  # noqa: E402
from specdec.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402

K = 4


@dataclass
class Timeline:
    """What the clients saw: each chunk's (arrival, token count, seconds since the request's previous chunk or, for its
    first, since it was sent, whether it is the first), the outputs, and the failures by status code."""

    chunks: list[tuple[float, int, float, bool]] = field(default_factory=list)
    outputs: list[tuple[int, list[int]]] = field(default_factory=list)  # (prompt index, token ids)
    failures: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)


def client(stub: gateway_pb2_grpc.GatewayStub, prompts: list[str], first: int, max_new: int, timeline: Timeline,
           stop: threading.Event) -> None:
    """Requests one after another, from prompt `first` on, until `stop`; every chunk's arrival into `timeline`."""
    i = first
    while not stop.is_set():
        request = gateway_pb2.GenerateRequest(prompt=prompts[i % len(prompts)], max_new_tokens=max_new,
                                              num_draft_tokens=K)
        previous, token_ids, chunks = time.perf_counter(), [], []
        try:
            for chunk in stub.Generate(request, timeout=300):
                now = time.perf_counter()
                if chunk.token_ids:
                    chunks.append((now, len(chunk.token_ids), now - previous, not token_ids))
                    token_ids += chunk.token_ids
                    previous = now
        except grpc.RpcError as e:
            with timeline.lock:
                timeline.failures[e.code().name] += 1
        else:
            with timeline.lock:
                timeline.outputs.append((i % len(prompts), token_ids))
        with timeline.lock:
            timeline.chunks += chunks
        i += 1


def window_metrics(chunks: list[tuple[float, int, float, bool]], bounds: dict[str, tuple[float, float]]) -> dict:
    """Per window (name -> [start, end) on the chunks' clock): tokens per second, the gaps' p50, p99 and max in ms
    (first chunks apart), and the slowest first token of the requests whose first chunk came in it."""
    metrics = {}
    for name, (start, end) in bounds.items():
        inside = [c for c in chunks if start <= c[0] < end]
        gaps = sorted(gap for _, _, gap, first in inside if not first)
        first_tokens = [gap for _, _, gap, first in inside if first]
        metrics[f"tok_s_{name}"] = sum(n for _, n, _, _ in inside) / (end - start) if end > start else 0.0
        metrics[f"gap_ms_p50_{name}"] = 1e3 * statistics.median(gaps) if gaps else None
        metrics[f"gap_ms_p99_{name}"] = 1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else None
        metrics[f"gap_ms_max_{name}"] = 1e3 * gaps[-1] if gaps else None
        metrics[f"num_gaps_{name}"] = len(gaps)
        metrics[f"ttft_ms_max_{name}"] = 1e3 * max(first_tokens) if first_tokens else None
    return metrics


def gpu_memory_figures(samples: list[tuple[float, float]], swap_start: float) -> dict[str, float | None]:
    """Of the draft's (time, MiB) samples: the last before the swap, the most of any, the last (None without a GPU)."""
    before = [mib for t, mib in samples if t < swap_start]
    return {"draft_gpu_mib_before_swap": before[-1] if before else None,
            "draft_gpu_mib_peak": max((mib for _, mib in samples), default=None),
            "draft_gpu_mib_end": samples[-1][1] if samples else None}


def run(stub: gateway_pb2_grpc.GatewayStub, prompts: list[str], references: list[list[int]],
        args: argparse.Namespace, do_swap: Callable[[], None], draft_pid: int) -> dict:
    """The clients for `args.duration_s`, the swap at a third of it; the windows' figures, the draft's GPU memory
    and the checks."""
    timeline, stop, memory = Timeline(), threading.Event(), Sampler(lambda: gpu_mib(draft_pid), period_s=0.5)
    threads = [threading.Thread(target=client, args=(stub, prompts, i, args.max_new_tokens, timeline, stop))
               for i in range(args.streams)]
    started = time.perf_counter()
    memory.start()
    for t in threads:
        t.start()
    try:
        time.sleep(args.duration_s / 6)  # warm-up: every stream running, batch sizes seen
        measured_from = time.perf_counter()
        time.sleep(args.duration_s / 3 - args.duration_s / 6)
        swap_start = time.perf_counter()
        do_swap()
        swap_end = time.perf_counter()
        time.sleep(max(0.0, started + args.duration_s - swap_end))
    finally:  # a failed swap too: the clients stop, each after its request
        stop.set()  # the streams finish their requests: the windows end here, before fewer streams run
        stopped = time.perf_counter()
        for t in threads:
            t.join(600)
        memory.stop()
    bounds = {"before": (measured_from, swap_start), "during": (swap_start, swap_end), "after": (swap_end, stopped)}
    differ = sum(tokens != references[i] for i, tokens in timeline.outputs)
    return {"swap_s": swap_end - swap_start, "requests_completed": len(timeline.outputs),
            "requests_failed": sum(timeline.failures.values()), "failures_by_code": dict(timeline.failures),
            "outputs_differ": differ, "streams": args.streams, "duration_s": args.duration_s,
            **window_metrics(timeline.chunks, bounds), **gpu_memory_figures(memory.samples, swap_start)}


def main() -> None:
    interrupt_on_sigterm()  # a timeout's SIGTERM still stops the services
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU: checks the script only")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--duration-s", type=float, default=45)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-quantize", choices=["none", "int8", "w8a8"], default="none")
    parser.add_argument("--draft-head-rows", type=int, default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_swap.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="specdec-swap-") as tmp:
        work = Path(tmp)
        models = bench_models(work, args.tiny, args.draft_head_rows, args.streams, args.prompt_tokens,
                              args.max_new_tokens)
        flags = [*models.service_flags, "--max-batch-size", str(args.streams)]
        trio = Trio(work)
        try:
            target = trio.spawn("target", "target_service", ["--model", models.target, *flags], unix_socket=True)
            draft = trio.spawn("draft", "draft_service", [
                "--drafter", "model", "--model", models.draft, "--admin-token", ADMIN_TOKEN,
                "--quantize", args.draft_quantize, *flags], unix_socket=True)
            with grpc.insecure_channel(gateway_over(trio, target, draft)) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                references = target_only_outputs(stub, models.prompts, args.max_new_tokens)
                swap = functools.partial(load_default_draft, draft.address(), "default", models.draft, timeout_s=600)
                metrics = run(stub, models.prompts, references, args, swap, draft.process.pid)
        finally:
            trio.stop()
    save_report("gpu_swap", metrics, args.out, notes="the real random draft (acceptance ~0): a gap is about one step")


if __name__ == "__main__":
    main()
