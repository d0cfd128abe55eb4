"""Builds and runs the target service: load the model, start the engine and the gRPC server."""
from __future__ import annotations

import argparse
import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine.batching_loop import torch_thread
from engine.model_runner import ModelRunner, RuntimeConfig
from engine.target_engine import TargetEngine, TargetEngineConfig
from specdec.busy_poll import busy_poll_enabled, keep_warm_enabled
from specdec.metrics import EngineSource, engine_registry
from specdec.serving import RunningServer, serve_until_signal, start_server
from specdec.tls import ServerTls, server_tls_config
from specdec.v1 import target_pb2, target_pb2_grpc
from target_service.servicer import TargetServicer

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


async def start_target_server(
    runner: ModelRunner, host: str = "127.0.0.1", port: int = 0,
    config: TargetEngineConfig = TargetEngineConfig(),
    ready_file: Path | None = None, executor: ThreadPoolExecutor | None = None,
    metrics_port: int | None = None, tls: ServerTls | None = None, busy_poll: bool = False,
    idle_poll: bool = False, unix_socket: Path | None = None,
) -> RunningServer:
    """`metrics_port`: serve Prometheus metrics there (0: a free port; None: not at all); `tls`:
    serve over TLS (mTLS when it names a client CA); `busy_poll`, `idle_poll`: specdec/busy_poll.py;
    `unix_socket`: listen there too."""
    engine = TargetEngine(runner, config, executor)
    registry, forward_metrics = engine_registry(
        "target", lambda: [EngineSource({}, engine.stats(), runner.description, runner)])
    engine.observe_forwards(forward_metrics)
    engine.start()
    servicer = TargetServicer(engine)
    return await start_server(
        lambda server: target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server),
        [SERVICE_NAME], host, port, ready_file, cleanup=engine.stop,
        metrics_registry=registry, metrics_port=metrics_port, credentials=tls.credentials() if tls else None,
        busy_poll=busy_poll, idle_poll=idle_poll, rehearse=servicer.rehearse if keep_warm_enabled() else None,
        unix_socket=unix_socket,
    )


def engine_config(args: argparse.Namespace) -> TargetEngineConfig:
    """The engine's flags (target_service/cli.py); raises ValueError on a bad value."""
    return TargetEngineConfig(int(args.max_num_batched_tokens), int(args.max_prefills_per_iteration))


def run(args: argparse.Namespace, config: RuntimeConfig) -> None:
    executor = torch_thread()
    runner = executor.submit(ModelRunner, config).result()  # load on its torch thread (on a CPU the one that runs it: batching_loop)
    busy_poll = busy_poll_enabled(args.busy_poll, runner.device.type)
    idle_poll = busy_poll_enabled(args.idle_poll, runner.device.type)
    asyncio.run(serve_until_signal(
        lambda: start_target_server(runner, args.host, args.port, engine_config(args), args.ready_file, executor,
                                    args.metrics_port, server_tls_config(args), busy_poll, idle_poll,
                                    args.unix_socket),
        args.cpus, args.shutdown_grace_s,
    ))
