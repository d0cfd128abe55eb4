"""gRPC plumbing shared by the three services: server start with health, reflection, request ids
and a metrics endpoint, the one interceptor that maps domain errors to status codes, and channel
options."""
from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from specdec.busy_poll import BusyPoll, make_busy_poll
from specdec.cpu_affinity import pin_process
from specdec.errors import (
    CapacityError,
    IncompatibleModelsError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    ServiceUnavailableError,
    SpecdecError,
    UnsupportedModelError,
)
from specdec.health import HealthServicer
from specdec.metrics import MetricsServer, start_metrics_server
from specdec.request_id import RequestIdInterceptor
from specdec.tls import ClientTls

log = logging.getLogger(__name__)

STATUS_OF_ERROR: dict[type[SpecdecError], grpc.StatusCode] = {
    InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    CapacityError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    IncompatibleModelsError: grpc.StatusCode.FAILED_PRECONDITION,
    UnsupportedModelError: grpc.StatusCode.FAILED_PRECONDITION,
    ServiceUnavailableError: grpc.StatusCode.UNAVAILABLE,
    NotFoundError: grpc.StatusCode.NOT_FOUND,
    PermissionDeniedError: grpc.StatusCode.PERMISSION_DENIED,
}

# How long a stopping service lets its running requests finish (--shutdown-grace-s): a generation of
# thousands of tokens, so a rolling restart or a scale-down cuts none (compose's stop_grace_period is longer).
DEFAULT_SHUTDOWN_GRACE_S = 30.0
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # tokenizer files of large vocabularies reach ~10 MB
SERVER_OPTIONS = [  # the receive limit is start_server's max_receive_bytes
    ("grpc.so_reuseport", 0),  # a stale server must not silently share our port
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Clients reconnect (and re-resolve DNS, finding replicas added since) after this age; open
    # streams are not cut: the grace period is unbounded by default.
    ("grpc.max_connection_age_ms", 60_000),
    # Ping idle clients: a gateway whose host vanished (no FIN/RST) is found within ~30 s and its
    # streams end, which frees their sequences.
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # Accept the clients' keepalive pings (below) even on streams that send no data for a while;
    # by default a server answers frequent pings with GOAWAY, killing every stream on the connection.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]
# The model services' methods: a new stream or call that fails before anything was received
# (UNAVAILABLE: the picked replica just went away) is retried by gRPC itself, on another replica.
RETRY_POLICY = {"maxAttempts": 3, "initialBackoff": "0.05s", "maxBackoff": "0.5s", "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"]}
SERVICE_CONFIG = {
    "loadBalancingConfig": [{"round_robin": {}}],  # spread new streams over every resolved address
    "methodConfig": [{"name": [{"service": "specdec.v1.TargetService"}, {"service": "specdec.v1.DraftService"}],
                      "retryPolicy": RETRY_POLICY}],
}
CHANNEL_OPTIONS = [
    ("grpc.lb_policy_name", "round_robin"),
    ("grpc.service_config", json.dumps(SERVICE_CONFIG)),
    ("grpc.enable_retries", 1),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Ping the services every 10 s while streams are open: a frozen or unreachable replica is
    # found within ~15 s (its streams fail UNAVAILABLE and the gateway moves the request on).
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    # A replica that comes back (a restarted draft) is reconnected within ~2 s, not minutes.
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


def open_channel(address: str, tls: ClientTls | None = None) -> grpc.aio.Channel:
    """An asyncio channel to a model service pool (`dns:///NAME:PORT` or `ipv4:A:P,B:Q` list every
    replica); TLS (mTLS with a client certificate) when `tls` is given."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(address, tls.credentials(), options=[*CHANNEL_OPTIONS, *tls.channel_options()])


def status_of(error: Exception) -> tuple[grpc.StatusCode, str] | None:
    """The status a failed RPC should end with, or None for an unexpected error (a bug)."""
    if isinstance(error, grpc.aio.AioRpcError):  # a backend's status passes through
        return error.code(), f"backend: {error.details()}"
    for error_type, code in STATUS_OF_ERROR.items():
        if isinstance(error, error_type):
            return code, str(error)
    return None


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Ends RPCs that raised a SpecdecError (or a backend's error) with the matching status."""

    async def intercept_service(
        self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        serializers = {"request_deserializer": handler.request_deserializer,
                       "response_serializer": handler.response_serializer}
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_wrap_unary(handler.unary_unary), **serializers)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_wrap_stream(handler.unary_stream), **serializers)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(_wrap_stream(handler.stream_stream), **serializers)
        return handler


async def _abort_on(error: Exception, context: grpc.aio.ServicerContext) -> None:
    status = status_of(error)
    if status is None:
        log.exception("unexpected error in %s", type(error).__name__, exc_info=error)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}")
    await context.abort(*status)


def _wrap_unary(behavior: Callable) -> Callable:
    async def wrapped(request, context):
        try:
            return await behavior(request, context)
        except (SpecdecError, grpc.aio.AioRpcError) as e:
            await _abort_on(e, context)

    return wrapped


def _wrap_stream(behavior: Callable) -> Callable:
    if not inspect.isasyncgenfunction(behavior):  # it writes its responses itself (context.write): health's Watch
        return _wrap_unary(behavior)

    async def wrapped(request, context):
        try:
            async for response in behavior(request, context):
                yield response
        except (SpecdecError, grpc.aio.AioRpcError) as e:
            await _abort_on(e, context)

    return wrapped


class BusyPollInterceptor(grpc.aio.ServerInterceptor):
    """Holds the server's busy poll (specdec/busy_poll.py) for as long as each streaming RPC of
    `service_names` runs (the model services' Sequence streams); not a health Watch or a reflection
    stream, which may stay open on an idle server. The gateway holds its own per generation
    (gateway/driver.py), for its HTTP API as well."""

    def __init__(self, busy_poll: BusyPoll, service_names: Sequence[str]) -> None:
        self._busy_poll = busy_poll
        self._service_names = frozenset(service_names)

    async def intercept_service(
        self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        service = handler_call_details.method.split("/")[1] if handler_call_details.method else ""
        if handler is None or not (handler.unary_stream or handler.stream_stream) or service not in self._service_names:
            return handler
        serializers = {"request_deserializer": handler.request_deserializer,
                       "response_serializer": handler.response_serializer}
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(self._held(handler.unary_stream), **serializers)
        return grpc.stream_stream_rpc_method_handler(self._held(handler.stream_stream), **serializers)

    def _held(self, behavior: Callable) -> Callable:
        async def wrapped(request, context):
            with self._busy_poll.held():
                async for response in behavior(request, context):
                    yield response

        return wrapped


class Drainable(Protocol):
    """A server beside the gRPC one that stops with it (the gateway's HTTP API)."""

    port: int

    async def stop(self, grace_s: float) -> None: ...

    def stop_now(self) -> None: ...


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: HealthServicer
    cleanup: Callable[[], Awaitable[None]] | None = None  # stops what the servicers use, once no RPC runs
    metrics: MetricsServer | None = None
    http: Drainable | None = None  # the gateway's OpenAI-compatible HTTP API, when served
    busy_poll: BusyPoll | None = None  # polls while streams are open; None: the loop and CPUs sleep when idle
    unix_socket: Path | None = None  # also listening here; removed on stop

    @property
    def metrics_port(self) -> int | None:
        return self.metrics.port if self.metrics is not None else None

    @property
    def http_port(self) -> int | None:
        return self.http.port if self.http is not None else None

    async def stop(self, grace_s: float = 2.0) -> None:
        """Reports NOT_SERVING and refuses new RPCs (and HTTP requests); lets those running finish for up to
        `grace_s` (stop_now cuts that short), then ends what is left and cleans up."""
        await self.health.enter_graceful_shutdown()
        await asyncio.gather(self.server.stop(grace_s), *([self.http.stop(grace_s)] if self.http else []))
        if self.cleanup is not None:
            await self.cleanup()
        if self.metrics is not None:
            self.metrics.stop()
        if self.busy_poll is not None:
            self.busy_poll.close()
        if self.unix_socket is not None:
            self.unix_socket.unlink(missing_ok=True)

    async def stop_now(self) -> None:
        """During a `stop`: ends the RPCs and requests still running at once (gRPC keeps the smallest grace)."""
        if self.http is not None:
            self.http.stop_now()
        await self.server.stop(0)


async def start_server(
    register: Callable[[grpc.aio.Server], None],
    service_names: list[str],
    host: str,
    port: int,
    ready_file: Path | None = None,
    cleanup: Callable[[], Awaitable[None]] | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    metrics_registry: CollectorRegistry | None = None,
    metrics_port: int | None = None,
    max_receive_bytes: int = MAX_MESSAGE_BYTES,
    credentials: grpc.ServerCredentials | None = None,
    busy_poll: bool = False,
    idle_poll: bool = False,
    rehearse: Callable[[], None] | None = None,
    unix_socket: Path | None = None,
    on_malformed_request_id: Callable[[str], None] | None = None,
) -> RunningServer:
    """Starts an asyncio gRPC server with our services, grpc.health.v1 and reflection.

    Every RPC runs with its request id (the caller's x-request-id metadata, or a new one) in
    `specdec.request_id.request_id_var`. `interceptors` run inside the request-id interceptor and
    outside the error interceptor (e.g. auth). With a `metrics_port` (0: a free one), the
    `metrics_registry` is served at http://HOST:PORT/metrics. A request message over
    `max_receive_bytes` is refused by gRPC with RESOURCE_EXHAUSTED. With `credentials` the port
    speaks TLS (specdec.tls), otherwise plaintext. `busy_poll`: the event loop polls instead of
    sleeping while one streaming RPC of `service_names` runs (specdec/busy_poll.py); `idle_poll`: the
    host's idle CPUs poll while any does (specdec/idle_cpus.py); `rehearse`: run now and then while the
    loop polls (specdec/busy_poll.py's keeping warm). `unix_socket`: listen on this Unix socket as well
    (a stale socket file there is replaced; the file is removed on stop), for callers on the same host:
    `unix:PATH` skips the TCP stack on every message of a step. `on_malformed_request_id(method)`: called for
    each RPC refused for its x-request-id (a gateway counts the refused requests).
    """
    options = [*SERVER_OPTIONS, ("grpc.max_receive_message_length", max_receive_bytes)]
    poll = make_busy_poll(busy_poll, idle_poll, rehearse)
    polling = [BusyPollInterceptor(poll, service_names)] if poll else []
    server = grpc.aio.server(interceptors=[*polling, RequestIdInterceptor(on_malformed_request_id), *interceptors,
                                           ErrorInterceptor()],
                             options=options)
    register(server)
    health_servicer = HealthServicer()  # its Watch streams end at a graceful stop
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    metrics, listening, started = None, False, False
    try:
        bound = _add_port(server, f"{host}:{port}", credentials,
                          " (is the port in use, or the --host not this machine's?)")
        if unix_socket is not None:
            _bind_unix_socket(server, unix_socket, credentials)
            listening = True
        if metrics_port is not None:  # started before serving, so a busy metrics port fails the start cleanly
            metrics = start_metrics_server(metrics_registry or CollectorRegistry(), host, metrics_port)
        await server.start()
        started = True
        for name in ["", *service_names]:
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        if ready_file is not None:  # launchers wait for this file to learn the port
            tmp = ready_file.with_name(ready_file.name + ".tmp")
            tmp.write_text(f"{host}:{bound}\n")
            os.replace(tmp, ready_file)
    except BaseException:  # a failed start lets go of every port and file it took
        if metrics is not None:
            metrics.stop()
        await (server.stop(None) if started else _unbind(server))
        if listening:
            unix_socket.unlink(missing_ok=True)
        if poll is not None:
            poll.close()
        raise
    log.info("serving %s on %s:%d%s", ", ".join(service_names), host, bound,
             f" and unix:{unix_socket}" if unix_socket is not None else "")
    return RunningServer(server, bound, health_servicer, cleanup, metrics, busy_poll=poll, unix_socket=unix_socket)


async def _unbind(server: grpc.aio.Server) -> None:
    """Lets go of the ports an unstarted server has bound: gRPC closes a listener only when its server
    stops, and stopping one never started leaves it open (until the server object is collected)."""
    try:
        await server.start()
    except Exception:  # nothing bound: nothing to let go of
        return
    await server.stop(None)


def _bind_unix_socket(server: grpc.aio.Server, path: Path, credentials: grpc.ServerCredentials | None) -> None:
    """Listens on `path` too; a socket left there by a killed server is replaced; one a live server listens
    on, or any other file, is refused."""
    if path.is_socket():
        with socket.socket(socket.AF_UNIX) as probe:
            if probe.connect_ex(str(path)) == 0:
                raise OSError(f"cannot listen on unix:{path}: another server is listening there")
        path.unlink()
    elif path.exists():
        raise OSError(f"cannot listen on unix:{path}: a file that is not a socket is there")
    _add_port(server, f"unix:{path}", credentials)


def _add_port(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None,
              hint: str = "") -> int:
    """Binds `address`, over TLS when `credentials` are given; returns the port bound. An address it cannot
    bind is an OSError naming it (and `hint`, what to check)."""
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as e:  # gRPC's "Failed to bind": in use, no such address here, a missing directory
        raise OSError(f"cannot listen on {address}: {e}{hint}") from None
    if not bound:
        raise OSError(f"cannot listen on {address}{hint}")
    return bound


async def serve_until_signal(start: Callable[[], Awaitable[RunningServer]], cpus: frozenset[int] | None = None,
                             grace_s: float = DEFAULT_SHUTDOWN_GRACE_S) -> None:
    """Runs a server made by `start()` until SIGINT/SIGTERM, then stops it gracefully: new RPCs are refused
    and those running get up to `grace_s` (--shutdown-grace-s) to finish; a second signal ends them at
    once. `cpus` (--cpus): once it serves, the process's threads run on these alone
    (specdec/cpu_affinity.py); its model loaded and compiled on every CPU."""
    server = await start()
    if cpus is not None:
        pin_process(cpus)
    signals: asyncio.Queue[int] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    await signals.get()
    log.info("stopping: running requests have up to %g s to finish (signal again to end them now)", grace_s)
    stopping = asyncio.ensure_future(server.stop(grace_s))
    again = asyncio.ensure_future(signals.get())
    await asyncio.wait([stopping, again], return_when=asyncio.FIRST_COMPLETED)
    if not stopping.done():
        log.warning("second signal: ending the running requests now")
        await server.stop_now()
    again.cancel()
    await stopping
