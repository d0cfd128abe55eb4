"""Memory across live draft swaps: one target, one draft and one gateway process (tiny random models,
the machine's default device), the draft's default swapped back and forth between two model directories
`--swaps` times (LoadDraft with replace, as bench/soak.py does), a burst of greedy requests after each.
After every swap it records the draft process's resident memory (VmRSS) and, on a GPU, the GPU memory
nvidia-smi charges to it, so a leak shows as a line that keeps rising and warm-up as one that levels off.

Writes bench/results/swap_memory.json (metrics: rss_mb_by_swap, gpu_mib_by_swap, threads_by_swap,
rss_mb_growth_last_half, gpu_mib_growth_last_half, swaps, requests).
Usage: python bench/swap_memory.py [--swaps 24] [--out bench/results/swap_memory.json]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

import specdec  # noqa: E402,F401 - before grpc: it picks gRPC's poller (specdec/__init__.py)
import grpc  # noqa: E402

from report import save_report  # noqa: E402
from process_memory import gpu_mib, process_rss_mb  # noqa: E402
from soak import ADMIN_TOKEN, load_default_draft  # noqa: E402
from tiny_models import build_model_dir, build_tokenizer  # noqa: E402

from specdec.client import collect  # noqa: E402
from specdec.processes import Replica  # noqa: E402
from specdec.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402

PROMPTS = ["The quick brown fox", "def add(a, b):\n    return", "Numbers 0123456789 and", "x"]
REQUESTS_PER_SWAP = 16


def num_threads(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/task").iterdir()))


def burst(stub: gateway_pb2_grpc.GatewayStub, pool: ThreadPoolExecutor) -> None:
    requests = [gateway_pb2.GenerateRequest(prompt=PROMPTS[i % len(PROMPTS)], max_new_tokens=48, num_draft_tokens=3)
                for i in range(REQUESTS_PER_SWAP)]
    for completion in pool.map(lambda r: collect(stub.Generate(r, timeout=120)), requests):
        assert completion.token_ids, "a request came back empty"


def growth(values: list[float | None]) -> float | None:
    """How much the second half of the run added: warm-up sits in the first half."""
    half = len(values) // 2
    return None if None in values[half:] else values[-1] - values[half]


def run(workdir: Path, swaps: int) -> dict:
    tokenizer = build_tokenizer()
    target_dir = build_model_dir(workdir / "target", tokenizer, seed=0)
    drafts = [build_model_dir(workdir / f"draft{i}", tokenizer, seed=1 + i, perturb_from=target_dir,
                              perturb_scale=0.05 * (i + 1)) for i in range(2)]
    target = Replica("target", "target_service", ["--model", str(target_dir), "--kv-cache-tokens", "8192"], workdir)
    draft = Replica("draft", "draft_service", ["--drafter", "model", "--model", str(drafts[0]),
                                               "--kv-cache-tokens", "8192", "--admin-token", ADMIN_TOKEN], workdir)
    gateway = Replica("gateway", "gateway", [], workdir)
    rss, gpu, threads = [], [], []
    try:
        target.spawn()
        draft.spawn()
        target.wait_ready()
        draft.wait_ready()
        gateway.args = ["--target", target.address, "--draft", draft.address]
        gateway.start()
        with grpc.insecure_channel(gateway.address) as channel, ThreadPoolExecutor(8) as pool:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            burst(stub, pool)
            for i in range(swaps):
                started = time.monotonic()
                load_default_draft(draft.address, "default", str(drafts[(i + 1) % 2]), timeout_s=120)
                burst(stub, pool)
                rss.append(round(process_rss_mb(draft.process.pid), 1))
                gpu.append(gpu_mib(draft.process.pid))
                threads.append(num_threads(draft.process.pid))
                print(f"swap {i + 1}/{swaps}: draft RSS {rss[-1]:.1f} MB, GPU {gpu[-1]} MiB, {threads[-1]} threads "
                      f"({time.monotonic() - started:.1f} s)", flush=True)
    finally:
        for replica in (gateway, draft, target):
            replica.stop()
    return {"rss_mb_by_swap": rss, "gpu_mib_by_swap": gpu, "threads_by_swap": threads,
            "rss_mb_growth_last_half": growth(rss),
            "gpu_mib_growth_last_half": growth(gpu), "swaps": swaps, "requests": REQUESTS_PER_SWAP * (swaps + 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--swaps", type=int, default=24)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "swap_memory.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        metrics = run(Path(workdir), args.swaps)
    save_report("swap_memory", metrics, args.out)


if __name__ == "__main__":
    main()
