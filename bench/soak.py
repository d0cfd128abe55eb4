"""Soak: the trio as processes (two target and two draft replicas, tiny random models, CPU,
loopback), N concurrent client streams for a while, random cancellations, one draft and one target
replica killed and restarted in the middle. Every completed output is checked against the
undisturbed greedy output; at the end every KV pool must be empty and memory flat.

Writes bench/results/soak.json (metrics: requests_completed, wrong_outputs, unexpected_errors,
leaked_kv_blocks, ttft_p50_ms, ttft_p99_ms, rss_mb_before, rss_mb_after, ...).
Usage: python bench/soak.py [--duration-s 120] [--streams 32] [--out bench/results/soak.json]
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

import specdec  # noqa: E402,F401 - before grpc: it picks gRPC's poller (specdec/__init__.py)
import grpc  # noqa: E402

from report import save_report  # noqa: E402
from tiny_models import build_model_dir, build_tokenizer  # noqa: E402

from specdec.processes import Replica  # noqa: E402
from specdec.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402

PROMPTS = ["The quick brown fox", "def add(a, b):\n    return", "Speculative decoding: a draft proposes,",
           "Große Straße 🙂", "Numbers 0123456789 and", "x"]
MAX_NEW_TOKENS = 64
CANCEL_PROBABILITY = 0.1
EXPECTED_CODES = {grpc.StatusCode.CANCELLED}  # our own cancellations


@dataclass
class Tally:
    completed: int = 0
    cancelled: int = 0
    wrong: int = 0
    errors: Counter = field(default_factory=Counter)
    ttft_s: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class SoakCluster:
    """Two target and two draft replica processes, and a gateway process over both pools."""

    def __init__(self, workdir: Path, target_dir: Path, draft_dir: Path) -> None:
        kv = ["--kv-cache-tokens", "32768", "--num-threads", "1"]
        self.targets = [Replica(f"target{i}", "target_service", ["--model", str(target_dir), *kv], workdir)
                        for i in range(2)]
        self.drafts = [Replica(f"draft{i}", "draft_service", ["--drafter", "model", "--model", str(draft_dir), *kv],
                               workdir) for i in range(2)]
        self.gateway: Replica | None = None
        self.workdir = workdir

    @property
    def model_replicas(self) -> list[Replica]:
        return [*self.targets, *self.drafts]

    def start(self) -> str:
        for replica in self.model_replicas:
            replica.spawn()
        for replica in self.model_replicas:
            replica.wait_ready()
        self.gateway = Replica("gateway", "gateway", [
            "--target", "ipv4:" + ",".join(t.address for t in self.targets),
            "--draft", "ipv4:" + ",".join(d.address for d in self.drafts),
            "--num-draft-tokens", "3", "--target-failover-timeout-s", "60", "--draft-step-timeout-s", "5",
        ], self.workdir)
        self.gateway.start()
        return self.gateway.address

    def restart(self, replica: Replica) -> None:
        replica.kill()
        replica.start()

    def leaked_kv_blocks(self, timeout_s: float = 30) -> int:
        deadline = time.monotonic() + timeout_s
        while True:
            used = sum(r.engine_stats().num_kv_blocks_used for r in self.model_replicas)
            if used == 0 or time.monotonic() > deadline:
                return used
            time.sleep(0.2)

    def rss_mb(self) -> dict[str, float]:
        replicas = [*self.model_replicas, self.gateway]
        return {r.name: _rss_mb(r.process.pid) for r in replicas}

    def stop(self) -> None:
        for replica in [self.gateway, *self.model_replicas]:
            if replica is not None:
                replica.stop()


def _rss_mb(pid: int) -> float:
    """Resident memory of a process (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def references(stub: gateway_pb2_grpc.GatewayStub) -> dict[str, list[int]]:
    """The undisturbed greedy output of each prompt (target-only); shorter runs are its prefixes."""
    out = {}
    for prompt in PROMPTS:
        request = gateway_pb2.GenerateRequest(prompt=prompt, max_new_tokens=MAX_NEW_TOKENS, num_draft_tokens=0)
        out[prompt] = [t for chunk in stub.Generate(request, timeout=120) for t in chunk.token_ids]
    return out


def client(stub, expected: dict[str, list[int]], tally: Tally, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        prompt = rng.choice(PROMPTS)
        max_new = rng.randint(4, MAX_NEW_TOKENS)
        request = gateway_pb2.GenerateRequest(prompt=prompt, max_new_tokens=max_new, num_draft_tokens=rng.randint(0, 4))
        cancel_after = rng.randint(1, 5) if rng.random() < CANCEL_PROBABILITY else None
        started = time.monotonic()
        token_ids: list[int] = []
        call = stub.Generate(request, timeout=300)
        try:
            for i, chunk in enumerate(call):
                if not token_ids and chunk.token_ids:
                    with tally.lock:
                        tally.ttft_s.append(time.monotonic() - started)
                token_ids += chunk.token_ids
                if cancel_after is not None and i + 1 >= cancel_after:
                    call.cancel()
        except grpc.RpcError as e:
            with tally.lock:
                if e.code() in EXPECTED_CODES and cancel_after is not None:
                    tally.cancelled += 1
                else:
                    tally.errors[f"{e.code().name}: {e.details()}"] += 1
                if token_ids != expected[prompt][:len(token_ids)]:
                    tally.wrong += 1  # even a cut-short stream must be a prefix of the right output
            continue
        with tally.lock:
            tally.completed += 1
            if token_ids != expected[prompt][:max_new]:
                tally.wrong += 1


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run_soak(workdir: Path, duration_s: float, num_streams: int) -> dict:
    tokenizer = build_tokenizer()
    target_dir = build_model_dir(workdir / "target", tokenizer, seed=0)
    draft_dir = build_model_dir(workdir / "draft", tokenizer, seed=1, perturb_from=target_dir, perturb_scale=0.05)
    cluster = SoakCluster(workdir, target_dir, draft_dir)
    try:
        address = cluster.start()
        with grpc.insecure_channel(address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            expected = references(stub)
            tally, stop = Tally(), threading.Event()
            clients = [threading.Thread(target=client, args=(stub, expected, tally, stop, i)) for i in range(num_streams)]
            for t in clients:
                t.start()
            time.sleep(min(10.0, duration_s / 6))  # warmed up: allocator pools and caches are filled
            rss_before = cluster.rss_mb()
            started = time.monotonic()
            events = [(duration_s / 3, cluster.drafts[0]), (2 * duration_s / 3, cluster.targets[0])]
            for at_s, replica in events:
                time.sleep(max(0.0, started + at_s - time.monotonic()))
                print(f"soak: restarting {replica.name} at {time.monotonic() - started:.0f} s", file=sys.stderr)
                cluster.restart(replica)
            time.sleep(max(0.0, started + duration_s - time.monotonic()))
            stop.set()
            for t in clients:
                t.join(300)
        leaked = cluster.leaked_kv_blocks()
        rss_after = cluster.rss_mb()
    finally:
        cluster.stop()
    survivors = ["gateway", "target1", "draft1"]  # restarted replicas start fresh, so compare these
    return {
        "requests_completed": tally.completed,
        "requests_cancelled": tally.cancelled,
        "wrong_outputs": tally.wrong,
        "unexpected_errors": sum(tally.errors.values()),
        "leaked_kv_blocks": leaked,
        "ttft_p50_ms": percentile(tally.ttft_s, 0.5) * 1e3,
        "ttft_p99_ms": percentile(tally.ttft_s, 0.99) * 1e3,
        "rss_mb_before": rss_before["gateway"],
        "rss_mb_after": rss_after["gateway"],
        "rss_mb_before_by_process": {name: round(rss_before[name], 1) for name in survivors},
        "rss_mb_after_by_process": {name: round(rss_after[name], 1) for name in survivors},
        "errors_by_kind": dict(tally.errors),
        "duration_s": duration_s,
        "streams": num_streams,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=120)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "soak.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="specdec-soak-") as tmp:
        metrics = run_soak(Path(tmp), args.duration_s, args.streams)
    save_report("soak", metrics, args.out, notes="gateway RSS in rss_mb_*; model services per process in *_by_process")


if __name__ == "__main__":
    main()
