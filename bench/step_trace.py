"""Where a decode step's time goes, part by part: the trio of bench/gpu_e2e.py with timing probes.

Runs target, draft (the oracle of bench/oracle_draft.py) and gateway under bench/trace_probe.py and
times one stream at a time: target-only, then speculation at alpha 0.8, k 4 (SYNTHETIC ACCEPTANCE).
From the probes' timelines it splits the median step into
  * each round trip as the gateway awaits it (gw.propose, gw.verify);
  * of that, the service's engine call (dft.propose / tgt.verify); the rest is gRPC and protobuf
    both ways, the servicer and the event loops (`*_transport_ms`);
  * of the engine call, the worker's work (`*_process_ms`); the rest is the batching loop's
    hand-offs (`*_handoff_ms`);
  * of the work, the CUDA graph's device time (`*_gpu_ms`); the rest is host work around it, input
    copies and the read back (`*_host_ms`), in three parts: before the first graph's launch
    (`*_pre_launch_ms`), from it to the read back's end less the device time (`*_launch_and_wait_ms`:
    the launches, the device's start, the read back's copy and the host's wake-up), and after the read
    back (`*_post_read_ms`);
  * the gateway's own time between the round trips (`gateway_gap_ms`).
The transport splits into its legs: the gateway's call to the engine call's start
(`*_request_leg_ms`), the engine call's end to the gateway's answer (`*_answer_leg_ms`).
Medians over the steps (a request's first step, after its prefill, falls out of them).
`--tiny`: tiny models on the CPU (a check of the script; no graphs there, so no device time).
`--busy-poll`: the three services' flag (specdec/busy_poll.py; auto polls on the GPU host, not on a
2-core one); step_trace_spin.json was measured before the flag, with every loop spinning from a
spinner the probe had then, as `--busy-poll on` does now at one stream.
`--draft-head-rows N`, `--draft-quantize int8`, `--pin-services` and `--mps` as gpu_e2e.py has them.
`--batch N` runs N streams at once; the steps of concurrent requests interleave, so instead of a
step's parts it times each batched forward's requests: how long before the forward the first and
the last were sent, and how long after it the first and the last were answered (`batch_parts`).
Usage: python bench/step_trace.py [--tiny] [--busy-poll auto|on|off] [--draft-quantize none|int8|w8a8]
                                  [--draft-head-rows N] [--pin-services] [--tcp] [--mps] [--batch N]
                                  [--keep-traces DIR] [--out PATH]
The gateways reach the model services over their Unix sockets, as bench/gpu_e2e.py's do (--tcp: over TCP).
"""
from __future__ import annotations

import argparse
import bisect
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

import specdec  # noqa: E402,F401 - before grpc: it picks gRPC's poller (specdec/__init__.py)
import grpc  # noqa: E402

from gpu_e2e import bench_models, run_config, write_continuations  # noqa: E402
import mps  # noqa: E402
from report import save_report  # noqa: E402

from specdec.cpu_affinity import cpus_from_the_last  # noqa: E402
from specdec.launch import Trio, interrupt_on_sigterm  # noqa: E402
from specdec.v1 import gateway_pb2_grpc  # noqa: E402

Interval = tuple[int, int]  # start_ns, end_ns


def load_traces(directory: Path) -> dict[str, list[Interval]]:
    """Every probe's intervals by name, sorted by start."""
    rows: dict[str, list[Interval]] = {}
    for path in directory.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            name, start, end = json.loads(line)
            rows.setdefault(name, []).append((start, end))
    return {name: sorted(intervals) for name, intervals in rows.items()}


def inside(intervals: list[Interval], outer: Interval) -> list[Interval]:
    """The intervals that start within `outer` (sorted input)."""
    lo = bisect.bisect_left(intervals, (outer[0], -1))
    hi = bisect.bisect_right(intervals, (outer[1], 2**63))
    return [iv for iv in intervals[lo:hi] if iv[1] <= outer[1] + 1]


def _span(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals) / 1e6


def round_trip_parts(traces: dict[str, list[Interval]], rpc: Interval, service: str) -> dict[str, float]:
    """One round trip split into its parts (ms): `service` is "tgt" (verify) or "dft" (propose)."""
    call = "verify" if service == "tgt" else "propose"
    engine = inside(traces.get(f"{service}.{call}", []), rpc)
    work = [w for e in engine for w in inside(traces.get(f"{service}.process", []), e)]
    # every graph replayed during the work (the draft's loop replays one a step); a replay's interval is
    # its host call time plus its device time, so it may end after the work does
    gpu = [g for w in work for g in inside(traces.get("gpu.replay", []), (w[0], w[1] + 50_000_000)) if g[0] <= w[1]]
    wall, engine_ms, work_ms = _span([rpc]), _span(engine), _span(work)
    parts = {f"{service}_rpc_ms": wall, f"{service}_transport_ms": wall - engine_ms,
             f"{service}_handoff_ms": engine_ms - work_ms, f"{service}_process_ms": work_ms}
    if engine:  # the two legs of the transport (one clock for every process on the machine)
        parts[f"{service}_request_leg_ms"] = (engine[0][0] - rpc[0]) / 1e6
        parts[f"{service}_answer_leg_ms"] = (rpc[1] - engine[-1][1]) / 1e6
    if gpu:
        parts[f"{service}_gpu_ms"] = _span(gpu)
        parts[f"{service}_host_ms"] = work_ms - _span(gpu)
        readback = [r for w in work for r in inside(traces.get(f"{service}.readback", []), w)]
        if readback and len(work) == 1:
            parts[f"{service}_pre_launch_ms"] = (gpu[0][0] - work[0][0]) / 1e6
            parts[f"{service}_launch_and_wait_ms"] = (readback[-1][1] - gpu[0][0]) / 1e6 - _span(gpu)
            parts[f"{service}_post_read_ms"] = (work[0][1] - readback[-1][1]) / 1e6
    return parts


def step_parts(traces: dict[str, list[Interval]], window: Interval) -> dict[str, float]:
    """Median step and median parts of the steps whose verify ended inside `window`."""
    verifies = [v for v in traces.get("gw.verify", []) if window[0] <= v[0] and v[1] <= window[1]]
    proposes = traces.get("gw.propose", [])
    steps: list[dict[str, float]] = []
    for before, verify in itertools.pairwise(verifies):
        parts = {"step_ms": (verify[1] - before[1]) / 1e6, **round_trip_parts(traces, verify, "tgt")}
        proposal = inside(proposes, (before[1], verify[0]))
        gap = parts["step_ms"] - parts["tgt_rpc_ms"]
        if proposal:
            parts.update(round_trip_parts(traces, proposal[0], "dft"))
            gap -= parts["dft_rpc_ms"]
        parts["gateway_gap_ms"] = gap
        steps.append(parts)
    if not steps:
        return {}
    names = dict.fromkeys(name for s in steps for name in s)  # a step without a proposal has no dft parts
    medians = {name: statistics.median(s[name] for s in steps if name in s) for name in names}
    medians["num_steps"] = len(steps)
    return medians


def batch_parts(traces: dict[str, list[Interval]], window: Interval) -> dict[str, float]:
    """With several streams: how each batched forward's requests arrive and are answered (ms, medians
    over the forwards inside `window`). A gateway round trip belongs to the forward it encloses (its
    batch); for each forward, how long before its start the first and the last of them were sent
    (`*_first_sent_ms`, `*_last_sent_ms`: the batching loop waits from the one to the other) and how
    long after its end the first and the last were answered (`*_first_answered_ms`,
    `*_last_answered_ms`), and how many it served (`*_rpcs_per_forward`). A round trip enclosing several
    forwards is counted with the first (a request sent before a batch began but left to the next one)."""
    parts: dict[str, float] = {}
    for service, rpc_name in (("tgt", "gw.verify"), ("dft", "gw.propose")):
        rpcs = [r for r in traces.get(rpc_name, []) if window[0] <= r[0] and r[1] <= window[1]]
        rows: list[dict[str, float]] = []
        for forward in traces.get(f"{service}.process", []):
            if not (window[0] <= forward[0] and forward[1] <= window[1]):
                continue
            served = [r for r in rpcs if r[0] <= forward[0] and forward[1] <= r[1]
                      and not any(r[0] <= f[0] < forward[0] for f in inside(traces[f"{service}.process"], r))]
            if not served:
                continue
            rows.append({"first_sent_ms": (forward[0] - min(r[0] for r in served)) / 1e6,
                         "last_sent_ms": (forward[0] - max(r[0] for r in served)) / 1e6,
                         "first_answered_ms": (min(r[1] for r in served) - forward[1]) / 1e6,
                         "last_answered_ms": (max(r[1] for r in served) - forward[1]) / 1e6,
                         "forward_ms": (forward[1] - forward[0]) / 1e6, "rpcs_per_forward": len(served)})
        for name in rows[0] if rows else ():
            parts[f"{service}_{name}"] = statistics.median(row[name] for row in rows)
        parts[f"{service}_num_forwards"] = len(rows)
    return parts


def _stats_figures(name: str, result: dict) -> dict[str, float]:
    """What the gateway's final stats say of the same run (bench/step_times.py), beside the probes'."""
    keys = ("tok_s", "step_ms", "draft_ms_per_step", "target_ms_per_step", "rpc_overhead_fraction")
    return {f"{name}_stats_{key}": result[key] for key in keys}


def main() -> None:
    interrupt_on_sigterm()  # a timeout's SIGTERM still stops the services
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU: checks the script only")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--draft-quantize", choices=["none", "int8", "w8a8"], default="none")
    parser.add_argument("--busy-poll", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--draft-head-rows", type=int, default=None, help="the draft's LM head keeps this many rows")
    parser.add_argument("--pin-services", action="store_true", help="each service on a CPU of its own (--cpus)")
    parser.add_argument("--tcp", action="store_true",
                        help="the gateways reach the model services over loopback TCP, not their Unix sockets")
    parser.add_argument("--mps", action="store_true", help="the services under a CUDA MPS daemon of this run's own (bench/mps.py)")
    parser.add_argument("--keep-traces", type=Path, default=None, help="copy the probes' files here")
    parser.add_argument("--batch", type=int, default=1,
                        help="concurrent streams; above 1 each batched forward's requests are timed (batch_parts)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.mps and (why := mps.check_available()):
        parser.error(f"--mps: {why}")
    out = args.out or ROOT / "bench" / "results" / ("step_trace_tiny.json" if args.tiny else "step_trace.json")
    metrics: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="specdec-trace-") as tmp:
        work = Path(tmp)
        traces_dir = work / "traces"
        models = bench_models(work, args.tiny, args.draft_head_rows, args.num_prompts, args.prompt_tokens,
                              args.max_new_tokens)
        prompts, prompt_ids, common = models.prompts, models.prompt_ids, models.service_flags
        target_model, draft_model = models.target, models.draft
        cpus = cpus_from_the_last()  # --pin-services
        trio = Trio(work)

        def spawn(name: str, module: str, service_args: list[str], model: bool = False) -> str:
            """Its address for this host's callers: a model service's Unix socket (unless --tcp)."""
            env = {"SPECDEC_TRACE_RUN": module, "SPECDEC_TRACE_DIR": str(traces_dir)}
            pin = ["--cpus", str(next(cpus))] if args.pin_services else []
            return trio.wait_ready(trio.spawn(name, "bench.trace_probe", [*service_args, "--busy-poll", args.busy_poll,
                                                                          *pin], env=env, unix_socket=model and not args.tcp), 900)

        windows: dict[str, Interval] = {}
        with ExitStack() as stack:
            if args.mps:  # entered first, so left last: the daemon quits once the services have stopped
                stack.enter_context(mps.mps_daemon(work))
            stack.callback(trio.stop)
            target = spawn("target", "target_service", ["--model", target_model, *common], model=True)
            plain = spawn("gateway-plain", "gateway", ["--target", target, "--draft", "none", "--log-level", "WARNING"])
            with grpc.insecure_channel(plain) as channel:
                started = time.perf_counter_ns()
                result = run_config(gateway_pb2_grpc.GatewayStub(channel), prompts, args.batch, args.max_new_tokens, 0)
                windows["target_only"] = (started, time.perf_counter_ns())
            metrics.update(_stats_figures("target_only", result))
            continuations = work / "continuations.json"
            continuations.write_text("[]")
            draft = spawn("draft", "bench.oracle_draft", [
                "--model", draft_model, "--continuations", str(continuations), "--alphas", "0.8",
                "--quantize", args.draft_quantize, *common], model=True)
            gateway = spawn("gateway", "gateway", ["--target", target, "--draft", draft, "--log-level", "WARNING"])
            with grpc.insecure_channel(gateway) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                reference = run_config(stub, prompts, args.batch, args.max_new_tokens, 4, "plain")["token_ids"]
                write_continuations(continuations, prompt_ids, reference)
                started = time.perf_counter_ns()
                result = run_config(stub, prompts, args.batch, args.max_new_tokens, 4, "oracle-0.8")
                windows["spec"] = (started, time.perf_counter_ns())
            metrics.update(_stats_figures("spec", result))
            metrics["outputs_differ_from_reference"] = sum(a != b for a, b in zip(result["token_ids"], reference))
        traces = load_traces(traces_dir)
        if args.keep_traces:
            shutil.copytree(traces_dir, args.keep_traces, dirs_exist_ok=True)
            (args.keep_traces / "windows.json").write_text(json.dumps(windows))
    parts = step_parts if args.batch == 1 else batch_parts  # a step's parts only when steps do not interleave
    for name, window in windows.items():
        metrics.update({f"{name}_{part}": value for part, value in parts(traces, window).items()})
    metrics["batch"] = args.batch
    metrics["mps"] = float(args.mps)
    save_report("step_trace", metrics, out,
                note="spec: SYNTHETIC acceptance (oracle draft, alpha 0.8, k 4); random weights; "
                     f"{args.batch} stream(s) at a time")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
