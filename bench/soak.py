"""Soak: the trio as processes (two target and two draft replicas, tiny random models, CPU,
loopback), N concurrent client streams for a while, a mix of requests, and the things that go wrong
in service: random cancellations and deadlines, bad requests, a target KV pool too small for every
stream at once (requests wait for room), live draft swaps on both draft replicas (model drafts and
the n-gram drafter), one draft and one target replica killed and restarted in the middle, and a
target replica stopped gracefully (SIGTERM, a rolling restart) and started again.

Each request is one of (weights in REQUEST_MIX):
  greedy    k 0-4 or the gateway's adaptive k; must equal the undisturbed greedy output
            (target-only), or be a prefix of it when cancelled;
  sampled   seeded sampling with k 0 or 3 pinned on the draft "default"; must equal the same request
            run undisturbed, unless a replica kill overlapped it (a graceful stop must change nothing:
            its running requests finish on it, new ones go to the other): a lost draft turns a request
            target-only, and a lost target's successor samples the next token from its prefill, where
            the verify may have accepted a draft token; each draws from the target's distribution, but
            not the same sample;
  stop      greedy with a stop string cut from the reference text; must end just before it, as STOP;
  deadline  greedy with a 0.05-3 s deadline; DEADLINE_EXCEEDED or complete, a prefix either way;
  invalid   a request the gateway must refuse with its status code (gRPC: INVALID_REQUESTS; the OpenAI
            API: INVALID_OPENAI_REQUESTS);
  openai    greedy through the OpenAI-compatible HTTP API, whole or streamed (SSE; a streamed one sometimes
            dropped after a few events); its text must equal the reference text, or begin it.
At the end every KV pool must be empty and memory flat.

Writes bench/results/soak.json (metrics: requests_completed, wrong_outputs, unexpected_errors,
leaked_kv_blocks, ttft_p50_ms, ttft_p99_ms, rss_mb_before, rss_mb_after, completed_by_kind,
draft_swaps, graceful_drain_s, max_waiting_sequences, rss_mb_timeline (the never-restarted replicas, about
once a second), examples (the first wrong outputs, and samples a restart changed), ...). The request mix is
bench/soak_clients.py.
Usage: python bench/soak.py [--duration-s 120] [--streams 32] [--target-kv-tokens 1024]
                            [--out bench/results/soak.json]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

import specdec  # noqa: E402,F401 - before grpc: it picks gRPC's poller (specdec/__init__.py)
import grpc  # noqa: E402

from harness import free_port  # noqa: E402
from process_memory import Sampler, process_rss_mb  # noqa: E402
from report import save_report  # noqa: E402
from soak_clients import SERVED_MODEL_NAME, Client, Disturbances, Tally, references  # noqa: E402
from tiny_models import build_model_dir, build_tokenizer  # noqa: E402

from draft_service.registry import NGRAM  # noqa: E402
from specdec.processes import Replica  # noqa: E402
from specdec.v1 import draft_pb2, draft_pb2_grpc, gateway_pb2_grpc  # noqa: E402

ADMIN_TOKEN = "soak-admin"
SWAPS_PER_RUN = 8
SURVIVORS = ("gateway", "target1", "draft1")  # the replicas never restarted: their memory is compared


def load_default_draft(address: str, name: str, model: str, timeout_s: float) -> None:
    """LoadDraft `model` as `name`, replacing a draft of that name, and make it the default, as an operator would
    (`python -m specdec.admin load-draft --default`); the draft service runs with --admin-token ADMIN_TOKEN."""
    request = draft_pb2.LoadDraftRequest(name=name, model=model, make_default=True, replace=True)
    with grpc.insecure_channel(address) as channel:
        draft_pb2_grpc.DraftServiceStub(channel).LoadDraft(
            request, metadata=(("authorization", f"Bearer {ADMIN_TOKEN}"),), timeout=timeout_s)


class SoakCluster:
    """Two target and two draft replica processes, and a gateway process over both pools."""

    def __init__(self, workdir: Path, target_dir: Path, draft_dir: Path, target_kv_tokens: int) -> None:
        common = ["--num-threads", "1"]
        self.targets = [Replica(f"target{i}", "target_service",
                                ["--model", str(target_dir), "--kv-cache-tokens", str(target_kv_tokens), *common],
                                workdir) for i in range(2)]
        self.drafts = [Replica(f"draft{i}", "draft_service",
                               ["--drafter", "model", "--model", str(draft_dir), "--kv-cache-tokens", "32768",
                                "--admin-token", ADMIN_TOKEN, *common], workdir) for i in range(2)]
        self.gateway: Replica | None = None
        self.http_port = free_port()
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
            "--http-port", str(self.http_port), "--served-model-name", SERVED_MODEL_NAME,
        ], self.workdir)
        self.gateway.start()
        return self.gateway.address

    def restart(self, replica: Replica, disturbances: Disturbances) -> None:
        window = disturbances.begin()
        replica.kill()
        replica.start()
        disturbances.end(window)

    def restart_gracefully(self, replica: Replica) -> float:
        """SIGTERM, as a rolling restart sends: the replica refuses new requests, finishes its running ones
        and exits; then it starts again. No disturbance window: no request may change. Returns how long
        it took to exit."""
        started = time.monotonic()
        replica.stop()
        drained_s = time.monotonic() - started
        replica.start()
        return drained_s

    def swap_default_draft(self, name: str, model: str) -> Counter:
        """Loads `model` as `name` on every draft replica and makes it their default; counts the
        outcomes (a replica being restarted just then refuses: UNAVAILABLE)."""
        outcomes = Counter()
        for replica in self.drafts:
            try:
                load_default_draft(replica.address, name, model, timeout_s=60)
                outcomes["ok"] += 1
            except grpc.RpcError as e:
                outcomes[e.code().name] += 1
        return outcomes

    def num_waiting(self) -> int:
        total = 0
        for replica in self.targets:
            try:
                total += replica.engine_stats().num_waiting_sequences
            except grpc.RpcError:
                pass  # being restarted
        return total

    def leaked_kv_blocks(self, timeout_s: float = 30) -> int:
        deadline = time.monotonic() + timeout_s
        while True:
            used = sum(r.engine_stats().num_kv_blocks_used for r in self.model_replicas)
            if used == 0 or time.monotonic() > deadline:
                return used
            time.sleep(0.2)

    def rss_mb(self, names: tuple[str, ...] = ()) -> dict[str, float]:
        """Resident memory (MB) by replica name: of `names`, or of every replica."""
        replicas = [r for r in [*self.model_replicas, self.gateway] if not names or r.name in names]
        return {r.name: round(process_rss_mb(r.process.pid), 1) for r in replicas}

    def stop(self) -> None:
        for replica in [self.gateway, *self.model_replicas]:
            if replica is not None:
                replica.stop()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run_soak(workdir: Path, duration_s: float, num_streams: int, target_kv_tokens: int = 1024) -> dict:
    tokenizer = build_tokenizer()
    target_dir = build_model_dir(workdir / "target", tokenizer, seed=0)
    drafts = (build_model_dir(workdir / "draft", tokenizer, seed=1, perturb_from=target_dir, perturb_scale=0.05),
              build_model_dir(workdir / "draft2", tokenizer, seed=2, perturb_from=target_dir, perturb_scale=0.2))
    cluster = SoakCluster(workdir, target_dir, drafts[0], target_kv_tokens)
    disturbances, swaps = Disturbances(), Counter()
    try:
        address = cluster.start()
        with grpc.insecure_channel(address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            refs = references(stub)
            tally, stop = Tally(), threading.Event()
            clients = [Client(stub, cluster.http_port, refs, tally, disturbances, seed=i) for i in range(num_streams)]
            threads = [threading.Thread(target=c.run, args=(stop,)) for c in clients]
            for t in threads:
                t.start()
            # warm-up: allocator pools and caches fill; the other draft is loaded, then the default reloaded
            # while requests still run on the one it replaces: three drafts resident at once, as during each
            # later swap, so the draft processes reach their high-water mark before the baseline (on an H100
            # the first swap after it added 115 MB to draft1, which then stayed flat through seven more)
            swaps.update(cluster.swap_default_draft("alt", str(drafts[1])))
            swaps.update(cluster.swap_default_draft("default", str(drafts[0])))
            time.sleep(min(10.0, duration_s / 6))
            rss_before = cluster.rss_mb()
            timeline = Sampler(lambda: cluster.rss_mb(SURVIVORS))  # about once a second
            timeline.start()
            try:
                max_waiting, drained_s = _disturb(cluster, duration_s, drafts, disturbances, swaps)
            finally:
                timeline.stop()
            stop.set()
            for t in threads:
                t.join(300)
        leaked = cluster.leaked_kv_blocks()
        rss_after = cluster.rss_mb()
    finally:
        cluster.stop()
    return {
        "requests_completed": tally.completed.total(),
        "requests_cancelled": tally.cut_short["cancelled"],
        "requests_refused": tally.refused,
        "requests_past_deadline": tally.cut_short["deadline_exceeded"],
        "completed_by_kind": dict(tally.completed),
        "wrong_outputs": tally.wrong.total(),
        "wrong_by_kind": dict(tally.wrong),
        "samples_changed_by_a_restart": tally.disturbed_samples,
        "unexpected_errors": tally.errors.total(),
        "errors_by_kind": dict(tally.errors),
        "draft_swaps": dict(swaps),
        "graceful_drain_s": drained_s,
        "max_waiting_sequences": max_waiting,
        "leaked_kv_blocks": leaked,
        "ttft_p50_ms": percentile(tally.ttft_s, 0.5) * 1e3,
        "ttft_p99_ms": percentile(tally.ttft_s, 0.99) * 1e3,
        "rss_mb_before": rss_before["gateway"],
        "rss_mb_after": rss_after["gateway"],
        "rss_mb_before_by_process": {name: round(rss_before[name], 1) for name in SURVIVORS},
        "rss_mb_after_by_process": {name: round(rss_after[name], 1) for name in SURVIVORS},
        "rss_mb_timeline": [{"t_s": round(t - timeline.started, 1), **rss} for t, rss in timeline.samples],
        "examples": tally.examples,
        "duration_s": duration_s,
        "streams": num_streams,
        "target_kv_tokens": target_kv_tokens,
    }


def _disturb(cluster: SoakCluster, duration_s: float, drafts: tuple[Path, Path], disturbances: Disturbances,
             swaps: Counter) -> tuple[int, float]:
    """The run's events: the default draft swapped SWAPS_PER_RUN times (to the first draft, reloaded, then
    to the other draft or the weightless n-gram drafter under its name), draft0 killed and restarted at
    1/3, target0 stopped gracefully and restarted at 1/2, killed and restarted at 2/3; returns the most
    requests seen waiting for target KV room at once, and how long the graceful stop took."""
    started, max_waiting, drained_s = time.monotonic(), 0, float("nan")
    kills = {duration_s / 3: cluster.drafts[0], 2 * duration_s / 3: cluster.targets[0]}
    graceful = {duration_s / 2: cluster.targets[0]}
    swap_times = [duration_s / SWAPS_PER_RUN * (i + 0.5) for i in range(SWAPS_PER_RUN)]

    def wait_until(at_s: float) -> None:
        nonlocal max_waiting
        while time.monotonic() < started + at_s:
            max_waiting = max(max_waiting, cluster.num_waiting())
            time.sleep(0.25)

    for at_s in sorted([*kills, *graceful, *swap_times]):
        wait_until(at_s)
        if at_s in kills:
            print(f"soak: killing and restarting {kills[at_s].name} at {at_s:.0f} s", file=sys.stderr)
            cluster.restart(kills[at_s], disturbances)
        elif at_s in graceful:
            print(f"soak: stopping {graceful[at_s].name} gracefully and restarting it at {at_s:.0f} s", file=sys.stderr)
            drained_s = cluster.restart_gracefully(graceful[at_s])
        else:
            name, model = [("default", drafts[0]), ("alt", drafts[1]), ("default", drafts[0]),
                           ("alt", NGRAM)][swap_times.index(at_s) % 4]
            print(f"soak: default draft -> {name} at {at_s:.0f} s", file=sys.stderr)
            swaps.update(cluster.swap_default_draft(name, str(model)))
    wait_until(duration_s)
    return max_waiting, drained_s


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=120)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--target-kv-tokens", type=int, default=1024,
                        help="each target replica's KV pool: too small for every stream at once, so requests wait")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "soak.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="specdec-soak-") as tmp:
        metrics = run_soak(Path(tmp), args.duration_s, args.streams, args.target_kv_tokens)
    save_report("soak", metrics, args.out, notes="gateway RSS in rss_mb_*; model services per process in *_by_process")


if __name__ == "__main__":
    main()
