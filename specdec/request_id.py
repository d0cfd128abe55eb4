"""Request ids: made (or taken from the client) at the gateway, carried in gRPC metadata to the
model services, held in a contextvar for the life of an RPC, and stamped on every log record."""
from __future__ import annotations

import contextvars
import functools
import inspect
import json
import logging
import re
import uuid
from collections.abc import Callable

import grpc

REQUEST_ID_KEY = "x-request-id"  # gRPC metadata key and HTTP header
NO_REQUEST_ID = "-"
MAX_REQUEST_ID_CHARS = 128
log = logging.getLogger(__name__)
_VALID = re.compile(r"[A-Za-z0-9._:/=+-]+")

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default=NO_REQUEST_ID)


def new_request_id() -> str:
    return uuid.uuid4().hex


def check_request_id(value: str) -> str | None:
    """None if `value` is fit to be a request id, else why not (safe to show to the client)."""
    if not 0 < len(value) <= MAX_REQUEST_ID_CHARS or not _VALID.fullmatch(value):
        return (f"{REQUEST_ID_KEY} must be 1 to {MAX_REQUEST_ID_CHARS} characters of letters, digits and "
                "._:/=+-; leave it out and the gateway makes one")
    return None


def current_request_id() -> str:
    return request_id_var.get()


def request_id_metadata() -> tuple[tuple[str, str], ...]:
    """Metadata for a call to a model service on behalf of the current request."""
    return ((REQUEST_ID_KEY, request_id_var.get()),)


class RequestIdInterceptor(grpc.aio.ServerInterceptor):
    """Puts the caller's x-request-id (or a new one) into `request_id_var` for the RPC's handler; a malformed
    one ends the RPC with INVALID_ARGUMENT, after `on_malformed(method)` if given (a gateway counts it).

    grpc.aio runs each RPC in its own task, so the value set here is private to that RPC.
    """

    def __init__(self, on_malformed: Callable[[str], None] | None = None) -> None:
        self._on_malformed = on_malformed

    async def intercept_service(
        self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        serializers = {"request_deserializer": handler.request_deserializer,
                       "response_serializer": handler.response_serializer}
        enter = functools.partial(_enter, method=method, on_malformed=self._on_malformed)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_wrap_unary(handler.unary_unary, enter), **serializers)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_wrap_stream(handler.unary_stream, enter, method), **serializers)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(_wrap_stream(handler.stream_stream, enter, method), **serializers)
        return handler


async def _enter(context: grpc.aio.ServicerContext, method: str, on_malformed: Callable[[str], None] | None) -> None:
    given = dict(context.invocation_metadata() or ()).get(REQUEST_ID_KEY)
    if given is not None and (problem := check_request_id(given)) is not None:
        if on_malformed is not None:
            on_malformed(method)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
    request_id_var.set(given or new_request_id())
    log.debug("%s started", method)


def _wrap_unary(behavior: Callable, enter: Callable) -> Callable:
    async def wrapped(request, context):
        await enter(context)
        return await behavior(request, context)

    return wrapped


def _wrap_stream(behavior: Callable, enter: Callable, method: str) -> Callable:
    if not inspect.isasyncgenfunction(behavior):  # it writes its responses itself (context.write): health's Watch
        return _wrap_unary(behavior, enter)

    async def wrapped(request, context):
        await enter(context)
        try:
            async for response in behavior(request, context):
                yield response
        finally:
            log.debug("%s ended", method)

    return wrapped


class RequestIdFilter(logging.Filter):
    """Adds `record.request_id` (the current request's, or "-") to every record a handler sees."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, request_id, message (and the traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
                 "request_id": getattr(record, "request_id", NO_REQUEST_ID), "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)
