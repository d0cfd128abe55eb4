"""Where the services' host time goes, function by function: py-spy samples every process of the trio
while it serves (no probes in the services: bench/step_trace.py times a step's parts, this says which code
fills them).

Starts target, draft (the oracle of bench/oracle_draft.py: SYNTHETIC ACCEPTANCE) and two gateways as
gpu_e2e.py does, and for each batch size serves target-only streams, then speculative ones (alpha 0.8,
k 4), over and over for `--seconds` while `py-spy record --nonblocking` samples each process serving them
(every thread that is not idle; native code counts for the Python frame that called it). Per process
and configuration it reports:
  * `*_busy_fraction`: the samples a second over the sampling rate - how many of the process's threads
    are busy on average (1.0: one thread all the time);
  * `*_loop_fraction`: of those, the samples on the event loop's thread (the rest: torch's worker thread,
    gRPC's poller thread);
  * in `details`, the functions with the most samples of their own (`self`) and with them on the stack
    (`inclusive`), each as a fraction of the process's samples.
The raw stacks (py-spy's collapsed format, a file per process and configuration) are kept in one gzipped tar
at `--raw-archive` when given (one file: the device tool brings back at most 8). `--tiny` runs tiny models on
the CPU (a check of the script). py-spy must be able to read the services' memory (ptrace): the report says
`spy_failed` with py-spy's message where it cannot.
Usage: python bench/host_spy.py [--tiny] [--batches 1 8] [--seconds 20] [--rate 500]
                                [--draft-quantize none|int8|w8a8] [--draft-head-rows N] [--raw-archive PATH.tar.gz]
                                [--out PATH]
"""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

import specdec  # noqa: E402,F401 - before grpc: it picks gRPC's poller (specdec/__init__.py)
import grpc  # noqa: E402

from gpu_e2e import bench_models, run_config, write_continuations  # noqa: E402
from report import save_report  # noqa: E402
from specdec.launch import Service, Trio, interrupt_on_sigterm  # noqa: E402
from specdec.v1 import gateway_pb2_grpc  # noqa: E402

TOP = 25  # functions listed per process and configuration
LOOP_FRAME = "BaseEventLoop.run_forever (asyncio/base_events.py)"  # on the stack of the event loop's thread only


def frame_name(frame: str) -> str:
    """py-spy's `function (path/to/file.py:line)` as `function (dir/file.py)`: lines apart are one function."""
    function, _, where = frame.partition(" (")
    path = where.rsplit(":", 1)[0]
    return f"{function} ({'/'.join(Path(path).parts[-2:])})"


def summarize(raw: Path, seconds: float, rate: int) -> dict:
    """The figures of one process's collapsed stacks (`frame;frame;... count` lines)."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = on_loop = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():  # a frame name with a line break in it splits its line
            continue
        n = int(count)
        frames = [frame_name(f) for f in stack.split(";")]
        total += n
        on_loop += n * (LOOP_FRAME in frames)
        own[frames[-1]] += n
        for name in set(frames):
            inclusive[name] += n
    share = lambda counter: {name: round(n / total, 4) for name, n in counter.most_common(TOP)}  # noqa: E731
    return {"busy_fraction": total / (seconds * rate), "loop_fraction": on_loop / max(1, total),
            "samples": total, "self": share(own) if total else {}, "inclusive": share(inclusive) if total else {}}


def spy(pid: int, out: Path, seconds: float, rate: int) -> subprocess.Popen:
    """py-spy sampling `pid` into `out`; its messages go to `out` + ".log" (a pipe nobody reads while it runs
    could fill and stall it)."""
    with out.with_suffix(".log").open("w") as log:
        return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate",
                                 str(rate), "--format", "raw", "--nonblocking", "--output", str(out)],
                                stdout=subprocess.DEVNULL, stderr=log)


def serve_while_sampled(stub, prompts: list[str], batch: int, max_new: int, k: int, draft_model: str | None,
                        spies: dict[str, subprocess.Popen]) -> dict:
    """Serves the configuration again and again until every sampler has finished; its last round's figures."""
    result = run_config(stub, prompts, batch, max_new, k, draft_model)
    while any(p.poll() is None for p in spies.values()):
        result = run_config(stub, prompts, batch, max_new, k, draft_model)
    return result


def main() -> None:
    interrupt_on_sigterm()  # a timeout's SIGTERM still stops the services
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU: checks the script only")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--seconds", type=float, default=20, help="sampling time per configuration")
    parser.add_argument("--rate", type=int, default=500, help="samples a second")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--draft-quantize", choices=["none", "int8", "w8a8"], default="none")
    parser.add_argument("--draft-head-rows", type=int, default=None, help="the draft's LM head keeps this many rows")
    parser.add_argument("--raw-archive", type=Path, default=None, help="keep py-spy's collapsed stacks in this .tar.gz")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if shutil.which("py-spy") is None:
        parser.error("py-spy is not on PATH (pip install py-spy)")
    out = args.out or ROOT / "bench" / "results" / ("host_spy_tiny.json" if args.tiny else "host_spy.json")
    metrics: dict[str, float] = {}
    details: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="specdec-spy-") as tmp:
        work = Path(tmp)
        raw_dir = work / "raw"
        raw_dir.mkdir()
        models = bench_models(work, args.tiny, args.draft_head_rows, args.num_prompts, args.prompt_tokens,
                              args.max_new_tokens)
        prompts, common = models.prompts, models.service_flags
        trio = Trio(work)
        with ExitStack() as stack:
            stack.callback(trio.stop)
            services: dict[str, Service] = {}

            def spawn(name: str, module: str, service_args: list[str]) -> str:
                services[name] = trio.spawn(name, module, service_args)
                return trio.wait_ready(services[name], 900)

            target = spawn("target", "target_service", ["--model", models.target, *common])
            plain = spawn("gateway-plain", "gateway", ["--target", target, "--draft", "none", "--log-level", "WARNING"])
            continuations = work / "continuations.json"
            continuations.write_text("[]")
            draft = spawn("draft", "bench.oracle_draft", ["--model", models.draft, "--continuations", str(continuations),
                                                         "--alphas", "0.8", "--quantize", args.draft_quantize, *common])
            gateway = spawn("gateway", "gateway", ["--target", target, "--draft", draft, "--log-level", "WARNING"])
            channels = {name: stack.enter_context(grpc.insecure_channel(address))
                        for name, address in (("plain", plain), ("spec", gateway))}
            stubs = {name: gateway_pb2_grpc.GatewayStub(channel) for name, channel in channels.items()}
            for batch in args.batches:
                # the target's greedy output at this batch size, which the oracle proposes from
                reference = run_config(stubs["spec"], prompts, batch, args.max_new_tokens, 4, "plain")["token_ids"]
                write_continuations(continuations, models.prompt_ids, reference)
                for config, stub, k, processes in (("target_only", stubs["plain"], 0, ("target", "gateway-plain")),
                                                   ("spec", stubs["spec"], 4, ("target", "draft", "gateway"))):
                    run_config(stub, prompts[:batch], batch, 16, k, "oracle-0.8" if k else None)  # warm
                    label = f"bs{batch}_{config}"
                    raws = {name: raw_dir / f"{label}_{name}.txt" for name in processes}
                    spies = {name: spy(services[name].process.pid, raws[name], args.seconds, args.rate)
                             for name in processes}
                    started = time.perf_counter()
                    served = serve_while_sampled(stub, prompts, batch, args.max_new_tokens, k,
                                                 "oracle-0.8" if k else None, spies)
                    metrics[f"{label}_tok_s"] = served["tok_s"]
                    if k:
                        metrics[f"{label}_outputs_differ"] = sum(a != b for a, b in zip(served["token_ids"], reference))
                    for name, process in spies.items():
                        process.wait()
                        key = f"{label}_{name.replace('-', '_')}"
                        if process.returncode != 0 or not raws[name].exists():
                            metrics[f"{key}_spy_failed"] = 1.0
                            details[key] = {"error": raws[name].with_suffix(".log").read_text().strip()[-2000:]}
                            continue
                        summary = summarize(raws[name], args.seconds, args.rate)
                        metrics[f"{key}_busy_fraction"] = summary.pop("busy_fraction")
                        metrics[f"{key}_loop_fraction"] = summary.pop("loop_fraction")
                        details[key] = summary
                    print(label, f"{time.perf_counter() - started:.0f} s", flush=True)
        if args.raw_archive:
            args.raw_archive.parent.mkdir(parents=True, exist_ok=True)
            with tarfile.open(args.raw_archive, "w:gz") as archive:
                archive.add(raw_dir, arcname="host_spy_raw")
    save_report("host_spy", metrics, out, details=details,
                note="spec: SYNTHETIC acceptance (oracle draft, alpha 0.8, k 4); random weights; py-spy samples, "
                     "native time counted to the calling Python frame")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
