"""`specdec-launch`: start target, draft and gateway as local processes, wait until they are
healthy, then serve until Ctrl-C (or, with --demo, stream one chat answer and stop).

With the embedded default target the draft is the distilled SmolLM2 draft shipped in drafts/
(docs/distill.md); `--drafter ngram` (or SPECDEC_DRAFTER=ngram) uses prompt lookup instead. The gateway
reaches its model services over Unix sockets (they share the host), so no step's message crosses TCP."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.model_source import DEFAULT_MODEL
from specdec.client import build_request, format_stats, stream
from specdec.serving import DEFAULT_SHUTDOWN_GRACE_S

# The distilled draft for DEFAULT_MODEL, shipped with the project (python -m distill; docs/distill.md)
DEFAULT_DRAFT = Path(__file__).resolve().parent.parent / "drafts" / "smollm2-135m-instruct-6l"
# Draft tokens per verify step that measured fastest on a 2-core CPU (bench/results/cpu_default_pair.json,
# bench/results/cpu_smollm2.json)
DEFAULT_K = {"model": 1, "ngram": 4}


@dataclass
class Service:
    name: str
    process: subprocess.Popen
    ready_file: Path
    unix_socket: Path | None = None  # where it listens as well (--unix-socket)

    def address(self) -> str:
        return self.ready_file.read_text().strip()

    def local_address(self) -> str:
        """The address for callers on this host: its Unix socket if it has one, else HOST:PORT."""
        return f"unix:{self.unix_socket}" if self.unix_socket is not None else self.address()


class Trio:
    """The three services as child processes; `stop()` ends each by its PID."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.services: list[Service] = []

    def spawn(self, name: str, module: str, args: list[str], env: dict[str, str] | None = None,
              cwd: Path | None = None, unix_socket: bool = False) -> Service:
        """`env`: variables set for this service on top of ours (e.g. CUDA_VISIBLE_DEVICES); `cwd`: the
        directory it runs in, whose packages it imports first (another checkout: bench/gpu_ab.py);
        `unix_socket`: it listens on NAME.sock in the work directory as well (wait_ready then gives that)."""
        ready_file = self.workdir / f"{name}.addr"
        socket = (self.workdir / f"{name}.sock").resolve() if unix_socket else None
        command = [sys.executable, "-m", module, "--port", "0", "--ready-file", str(ready_file), *args,
                   *(["--unix-socket", str(socket)] if socket else [])]
        service = Service(name, subprocess.Popen(command, env={**os.environ, **env} if env else None, cwd=cwd),
                          ready_file, socket)
        self.services.append(service)
        return service

    def wait_ready(self, service: Service, timeout_s: float) -> str:
        """Waits until `service` serves; returns the address for callers on this host (local_address)."""
        wait_serving(service.name, service.process, service.ready_file, timeout_s)
        return service.local_address()

    def stop(self, timeout_s: float = DEFAULT_SHUTDOWN_GRACE_S + 10) -> None:
        """SIGTERM to each (a graceful stop: running requests finish within the services' shutdown grace;
        with none running they exit at once), then SIGKILL to any still running `timeout_s` later."""
        for service in reversed(self.services):
            if service.process.poll() is None:
                service.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for service in self.services:
            try:
                service.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                service.process.kill()
                service.process.wait()


def wait_serving(name: str, process: subprocess.Popen, ready_file: Path, timeout_s: float,
                 health_timeout_s: float | None = None) -> str:
    """Waits for the ready file a service writes once listening, then (at most `health_timeout_s`,
    default `timeout_s`) for grpc.health.v1 to answer SERVING; returns the service's address."""
    deadline = time.monotonic() + timeout_s
    while not ready_file.exists():
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with code {process.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} did not start within {timeout_s:.0f} s")
        time.sleep(0.1)
    address = ready_file.read_text().strip()
    with grpc.insecure_channel(address) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=health_timeout_s or timeout_s, wait_for_ready=True)
    if response.status != health_pb2.HealthCheckResponse.SERVING:
        raise RuntimeError(f"{name} at {address} is not serving")
    return address


def start_trio(args: argparse.Namespace, workdir: Path) -> tuple[Trio, str]:
    """Starts target, draft and gateway; if any fails to come up, stops those started and re-raises."""
    trio = Trio(workdir)
    try:
        return trio, _start(trio, args)
    except BaseException:
        trio.stop()
        raise


def _start(trio: Trio, args: argparse.Namespace) -> str:
    common = ["--log-level", args.log_level]
    dtype = ["--dtype", args.dtype] if args.dtype else []
    target = trio.spawn("target", "target_service", ["--model", args.target_model, *dtype, *common], unix_socket=True)
    draft_dtype = args.draft_dtype or args.dtype
    draft_args = ["--drafter", args.drafter, *(["--dtype", draft_dtype] if draft_dtype else []), *common]
    if args.draft_model:
        draft_args += ["--model", args.draft_model]
    draft = trio.spawn("draft", "draft_service", draft_args, unix_socket=True)
    draft_name = args.draft_model if args.drafter == "model" else "ngram (prompt lookup)"
    print(f"specdec-launch: loading models (target {args.target_model}, draft {draft_name}, "
          f"k={args.num_draft_tokens}) ...", file=sys.stderr)
    target_address = trio.wait_ready(target, args.timeout_s)
    draft_address = trio.wait_ready(draft, args.timeout_s)
    gateway = trio.spawn("gateway", "gateway", [
        "--target", target_address, "--draft", draft_address,
        "--num-draft-tokens", str(args.num_draft_tokens), *common,
    ])
    return trio.wait_ready(gateway, args.timeout_s)


def launch_parser() -> argparse.ArgumentParser:
    """The launcher's flags (benchmarks start the trio with them too; then call choose_draft)."""
    parser = argparse.ArgumentParser(prog="specdec-launch", description=__doc__)
    parser.add_argument("--target-model", default=os.environ.get("SPECDEC_TARGET_MODEL", DEFAULT_MODEL))
    parser.add_argument("--drafter", choices=["ngram", "model"], default=os.environ.get("SPECDEC_DRAFTER"),
                        help="default: 'model' with the shipped distilled draft for the default target, else 'ngram'")
    parser.add_argument("--draft-model", default=os.environ.get("SPECDEC_DRAFT_MODEL"),
                        help=f"the draft model spec (default for the default target: {DEFAULT_DRAFT})")
    parser.add_argument("--dtype", default=os.environ.get("SPECDEC_DTYPE"),
                        help="float32 / bfloat16 for both models (default: each service's own)")
    parser.add_argument("--draft-dtype", default=os.environ.get("SPECDEC_DRAFT_DTYPE"),
                        help="the draft's dtype, if not --dtype (a draft's numerics never change the output)")
    parser.add_argument("-k", "--num-draft-tokens", type=int, default=os.environ.get("SPECDEC_NUM_DRAFT_TOKENS"),
                        help=f"draft tokens per step (default per drafter: {DEFAULT_K})")
    parser.add_argument("--demo", metavar="PROMPT", help="stream one chat answer, print its stats, stop")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--log-level", default="WARNING")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = launch_parser()
    args = parser.parse_args(argv)
    choose_draft(args, parser)
    interrupt_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="specdec-") as tmp:
        trio, gateway_address = None, None
        try:
            trio, gateway_address = start_trio(args, Path(tmp))
            print(f"specdec-launch: gateway ready at {gateway_address}", file=sys.stderr)
            if args.demo:
                run_demo(gateway_address, args)
            else:
                while True:
                    time.sleep(3600)
        except KeyboardInterrupt:
            pass
        finally:
            if trio is not None:
                trio.stop()
                print("specdec-launch: stopped all services", file=sys.stderr)


def choose_draft(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Fills in the drafter, the draft model and k: the shipped distilled draft for the default target."""
    has_shipped = args.target_model == DEFAULT_MODEL and DEFAULT_DRAFT.is_dir()
    if args.drafter is None:
        args.drafter = "model" if args.draft_model or has_shipped else "ngram"
    if args.drafter == "model" and not args.draft_model:
        if not has_shipped:
            parser.error("--drafter model needs --draft-model (a distilled draft ships only for the default target)")
        args.draft_model = str(DEFAULT_DRAFT)
    if args.num_draft_tokens is None:
        args.num_draft_tokens = DEFAULT_K[args.drafter]
    args.num_draft_tokens = int(args.num_draft_tokens)


def interrupt_on_sigterm() -> None:
    """SIGTERM (`kill`'s, `timeout`'s) raises KeyboardInterrupt as Ctrl-C does, so the `finally` that
    stops a Trio runs: without it the parent dies at once and its services live on."""
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_demo(address: str, args: argparse.Namespace) -> None:
    print(f"\n>>> {args.demo}\n", file=sys.stderr)
    request = build_request(args.demo, chat=True, max_new_tokens=args.max_new_tokens, num_draft_tokens=None, stop=[])
    completion = stream(address, request, lambda chunk: print(chunk.text, end="", flush=True))
    print("\n\n" + format_stats(completion.final), file=sys.stderr)


if __name__ == "__main__":
    main()
