"""Builds and runs the gateway: connect to the model services, check them, serve Generate (gRPC),
and optionally the OpenAI-compatible HTTP API and Prometheus metrics."""
from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from gateway.backends import Backends, rehearse_messages
from gateway.config import GatewayConfig
from gateway.driver import Driver
from gateway.metrics import OUTCOME_INVALID, GatewayMetrics
from gateway.servicer import API as GRPC_API
from gateway.servicer import GatewayServicer
from specdec.busy_poll import busy_poll_enabled, keep_warm_enabled, make_busy_poll
from specdec.serving import RunningServer, serve_until_signal, start_server
from specdec.tls import ServerTls, server_tls_config
from specdec.v1 import gateway_pb2, gateway_pb2_grpc

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
GENERATE_METHOD = f"/{SERVICE_NAME}/Generate"
HTTP_SPARE_CONNECTIONS = 64  # beyond the requests it may hold: /v1/models, /health, keep-alive


async def start_gateway_server(
    config: GatewayConfig, host: str = "127.0.0.1", port: int = 0, ready_file: Path | None = None,
    metrics_port: int | None = None, http_port: int | None = None, tls: ServerTls | None = None,
    busy_poll: str = "off", idle_poll: str = "off", unix_socket: Path | None = None,
) -> RunningServer:
    """Raises IncompatibleModelsError / ServiceUnavailableError before serving anything.

    `metrics_port` / `http_port`: serve Prometheus metrics / the OpenAI API there (0: a free port,
    None: not at all); the bound ports are on the returned server. `tls`: serve gRPC over TLS.
    `busy_poll`: a --busy-poll mode, whether the loop polls while one generation runs (gRPC or
    HTTP; specdec/busy_poll.py); auto reads the target's device from its ModelInfo. `idle_poll`: an
    --idle-poll mode, whether the host's idle CPUs poll while any generation runs, by the same rule.
    `unix_socket`: serve gRPC there too.
    """
    backends = Backends.for_config(config)
    try:
        tokenizer = await backends.connect(config.connect_timeout_s)
    except BaseException:
        await backends.close()
        raise
    metrics = GatewayMetrics()
    # held per generation by the driver, so the OpenAI HTTP API's requests poll too
    device = backends.target_info.device
    poll = make_busy_poll(busy_poll_enabled(busy_poll, device), busy_poll_enabled(idle_poll, device),
                          rehearse_messages if keep_warm_enabled() else None)
    driver = Driver(config, backends, tokenizer, metrics, poll)
    servicer = GatewayServicer(driver, config.stream_stall_timeout_s)
    http = None
    if http_port is not None:  # bound before the gRPC server starts: a busy port fails the start cleanly
        from gateway.http_server import HttpServer  # the HTTP stack only where it is served
        from gateway.openai_api import create_app

        model_name = config.served_model_name or backends.target_info.model_id
        try:
            app = create_app(driver, model_name, config.max_request_bytes, config.stream_stall_timeout_s)
            http = HttpServer(app, host, http_port,
                              config.max_concurrent_requests + config.max_queued_requests + HTTP_SPARE_CONNECTIONS)
        except BaseException:
            await backends.close()
            raise

    try:
        server = await start_server(
            lambda server: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server),
            [SERVICE_NAME], host, port, ready_file, cleanup=backends.close,
            metrics_registry=metrics.registry, metrics_port=metrics_port, max_receive_bytes=config.max_request_bytes,
            credentials=tls.credentials() if tls else None, unix_socket=unix_socket,
            on_malformed_request_id=lambda method: _count_refused(metrics, method),
        )
    except BaseException:  # a busy port, a bad socket path: let go of what was opened for it
        if http is not None:
            http.close()
        await backends.close()
        raise
    server.busy_poll = poll
    if http is not None:
        try:
            await http.start()
        except BaseException:
            http.close()
            await server.stop(0)
            raise
        server.http = http  # drained beside the gRPC streams when the server stops
    return server


def _count_refused(metrics: GatewayMetrics, method: str) -> None:
    """A Generate refused for its malformed x-request-id counts as an invalid request, as the HTTP API's does."""
    if method == GENERATE_METHOD:
        metrics.requests.labels(GRPC_API, OUTCOME_INVALID).inc()


def run(args: argparse.Namespace, config: GatewayConfig) -> None:
    asyncio.run(serve_until_signal(lambda: start_gateway_server(
        config, args.host, args.port, args.ready_file, args.metrics_port, args.http_port, server_tls_config(args),
        args.busy_poll, args.idle_poll, args.unix_socket), args.cpus, args.shutdown_grace_s))
