"""The round trip of one verify over our gRPC stack, with no model: what a step pays outside the forwards.

A server process runs the target's Sequence RPC through specdec.serving.start_server (our
interceptors and options) with a handler that answers each verify after `--work` of one kind:
  none   answers at once;
  sleep  time.sleep (the event loop blocked, the GIL released: a forward run inline that waits in CUDA);
  spin   a busy loop (the loop blocked, the GIL held);
  async  asyncio.sleep (the loop free meanwhile: a forward on another thread);
  thread the work on a worker thread (run_in_executor) as time.sleep: the batching loop's hand-off.
The client is the gateway's own TargetStream. Reports the median round trip minus the handler's
work per mode, and a plain grpc.aio ping-pong (no interceptors, bytes messages) for scale; each
with the client's and the server's event loops left to sleep while idle, or kept spinning (a task
that yields forever: `*_spin_client`, `*_spin_server`, `*_spin_both`) - a thread that sleeps
through a step's wait pays its wake-up (and its core's idle state's exit) when the answer comes.
`--follow`: each spinning loop keeps gRPC's poller thread on its own CPU (specdec/poller_affinity.py,
what the services' busy polling does). `--idle-cpus` measures it all with a SCHED_IDLE spinner on
every CPU (specdec/idle_cpus.py, what the services' --idle-poll runs while they serve), so no CPU
halts while idle. `--pin` pins the client process (every thread of it: the event loop and gRPC's
poller) to one CPU and the server's to another, so a thread woken by an arriving message wakes on
the CPU its spinning loop keeps awake.
gRPC's poller is our processes' (specdec/__init__.py: the legacy one); `GRPC_EXPERIMENTS= python
bench/grpc_pingpong.py` measures gRPC's EventEngine (the report's `grpc_experiments` says which ran).
Usage: python bench/grpc_pingpong.py [--work-ms 4.5] [--rounds 400] [--idle-cpus] [--pin] [--follow]
                                     [--out PATH]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import specdec  # noqa: E402,F401 - before grpc: it picks gRPC's poller (specdec/__init__.py)
import grpc  # noqa: E402

from report import save_report  # noqa: E402

from gateway.backends import Proposal, TargetStream  # noqa: E402
from specdec.cpu_affinity import pin_process  # noqa: E402
from specdec.idle_cpus import IdleCpus  # noqa: E402
from specdec.poller_affinity import PollerAffinity  # noqa: E402
from specdec.serving import open_channel, serve_until_signal, start_server  # noqa: E402
from specdec.v1 import target_pb2, target_pb2_grpc  # noqa: E402

MODES = ("none", "sleep", "spin", "async", "thread")


class EchoTarget(target_pb2_grpc.TargetServiceServicer):
    """Answers a verify with its draft ids after the work its request's first draft id names."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(1)

    async def Sequence(self, request_iterator, context):
        async for request in request_iterator:
            ids = list(request.verify.draft_ids)
            mode, work_us = MODES[ids[0]], ids[1]
            started = time.perf_counter_ns()
            if mode == "sleep":
                time.sleep(work_us / 1e6)  # noqa: ASYNC251 - blocking the loop is the point
            elif mode == "spin":
                while time.perf_counter_ns() - started < work_us * 1000:
                    pass
            elif mode == "async":
                await asyncio.sleep(work_us / 1e6)
            elif mode == "thread":
                await asyncio.get_running_loop().run_in_executor(self._executor, time.sleep, work_us / 1e6)
            result = target_pb2.VerifyResult(num_accepted_draft_tokens=0, committed_ids=ids[:1])
            yield target_pb2.TargetResponse(forward_ns=time.perf_counter_ns() - started, verify=result)


async def spin(follow: bool) -> None:
    """Keeps the running event loop from sleeping: it polls with a zero timeout, never blocks. `follow`:
    gRPC's poller thread kept on the loop's CPU meanwhile, as the services' busy polling does."""
    poller = PollerAffinity()
    try:
        while True:
            await asyncio.sleep(0)
            if follow:
                poller.follow()
    finally:
        poller.release()


def serve(ready_file: Path, spinning: bool, follow: bool, cpu: int | None) -> None:
    if cpu is not None:
        pin_process(frozenset({cpu}))

    async def start():
        if spinning:
            asyncio.get_running_loop().create_task(spin(follow))
        return await start_server(lambda s: target_pb2_grpc.add_TargetServiceServicer_to_server(EchoTarget(), s),
                                  ["specdec.v1.TargetService"], "127.0.0.1", 0, ready_file)

    asyncio.run(serve_until_signal(start))


async def measure(address: str, mode: str, work_us: int, rounds: int, spinning: bool, follow: bool) -> float:
    """Median of (round trip - the handler's time), microseconds."""
    spinner = asyncio.get_running_loop().create_task(spin(follow)) if spinning else None
    channel = open_channel(address)
    stub = target_pb2_grpc.TargetServiceStub(channel)
    stream = TargetStream(stub.Sequence(), "target")
    extra = []
    try:
        for i in range(rounds + 20):
            before = stream.forward_ns
            started = time.perf_counter_ns()
            await stream.verify(Proposal([MODES.index(mode), work_us, 7, 8], []))
            if i >= 20:
                extra.append((time.perf_counter_ns() - started - (stream.forward_ns - before)) / 1e3)
    finally:
        await stream.close()
        await channel.close()
        if spinner is not None:
            spinner.cancel()
    return statistics.median(extra)


async def plain_pingpong_us(rounds: int) -> float:
    """A bare grpc.aio bidi ping-pong (generic handler, bytes in and out), median microseconds."""
    async def echo(request_iterator, context):
        async for message in request_iterator:
            yield message

    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(echo)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("Echo", {"Echo": handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream("/Echo/Echo")()
            times = []
            for i in range(rounds + 20):
                started = time.perf_counter_ns()
                await call.write(b"x" * 32)
                await call.read()
                if i >= 20:
                    times.append((time.perf_counter_ns() - started) / 1e3)
            call.cancel()
    finally:
        await server.stop(0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-ms", type=float, default=4.5)
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)  # the server process
    parser.add_argument("--spin", action="store_true", help=argparse.SUPPRESS)  # its loop spins
    parser.add_argument("--cpu", type=int, help=argparse.SUPPRESS)  # the server's CPU (--pin)
    parser.add_argument("--pin", action="store_true", help="the client on one CPU, the server on another")
    parser.add_argument("--idle-cpus", action="store_true", help="a SCHED_IDLE spinner on every CPU throughout")
    parser.add_argument("--follow", action="store_true",
                        help="a spinning loop keeps gRPC's poller thread on its CPU (specdec/poller_affinity.py)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "grpc_pingpong.json")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.spin, args.follow, args.cpu)
        return
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin and len(cpus) < 2:
        parser.error(f"--pin needs two CPUs, this process may run on {cpus}")
    if args.pin:
        pin_process(frozenset({cpus[-2]}))
    idle_cpus = IdleCpus() if args.idle_cpus else None
    try:
        if idle_cpus is not None:
            idle_cpus.resume()
        metrics = measure_all(args, cpus[-1] if args.pin else None)
    finally:
        if idle_cpus is not None:
            idle_cpus.close()
    metrics["idle_cpus"] = float(args.idle_cpus)
    metrics["pinned"] = float(args.pin)
    metrics["poller_follows_loop"] = float(args.follow)
    metrics["grpc_experiments"] = os.environ["GRPC_EXPERIMENTS"]
    save_report("grpc_pingpong", metrics, args.out)


def measure_all(args: argparse.Namespace, server_cpu: int | None) -> dict[str, float]:
    work_us = int(args.work_ms * 1000)
    metrics = {"work_ms": args.work_ms, "plain_pingpong_us": asyncio.run(plain_pingpong_us(args.rounds))}
    with tempfile.TemporaryDirectory() as tmp:
        for server_spins in (False, True):
            ready = Path(tmp) / f"addr-{server_spins}"
            server = subprocess.Popen([sys.executable, __file__, "--serve", str(ready),
                                       *(["--spin"] if server_spins else []), *(["--follow"] if args.follow else []),
                                       *(["--cpu", str(server_cpu)] if server_cpu is not None else [])])
            try:
                while not ready.exists():
                    if server.poll() is not None:
                        raise RuntimeError("the echo server exited")
                    time.sleep(0.05)
                address = ready.read_text().strip()
                for client_spins in (False, True):
                    suffix = {(False, False): "", (True, False): "_spin_client", (False, True): "_spin_server",
                              (True, True): "_spin_both"}[(client_spins, server_spins)]
                    for mode in MODES:
                        metrics[f"overhead_us_{mode}{suffix}"] = asyncio.run(measure(
                            address, mode, 0 if mode == "none" else work_us, args.rounds, client_spins, args.follow))
            finally:
                server.terminate()
                server.wait(10)
    return metrics


if __name__ == "__main__":
    main()
