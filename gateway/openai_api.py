"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions (SSE when `stream`),
/v1/models, mapped onto the same generation driver as gRPC Generate.

Errors come back in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with the
HTTP status of the matching gRPC status (400 invalid, 404 unknown model, 429 no capacity,
503 a model service down). `usage` carries OpenAI's token counts plus `speculation`, the
request's figures from the final Generate chunk.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from google.protobuf.json_format import MessageToDict
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.driver import Delta, Driver, warn_stalled_client
from gateway.metrics import OUTCOME_INVALID
from gateway.openai_protocol import ChatCompletionRequest, CompletionRequest
from gateway.output import Finish
from gateway.request import GenerationParams
from specdec.errors import InvalidRequestError, NotFoundError, SpecdecError
from specdec.request_id import REQUEST_ID_KEY, check_request_id, current_request_id, new_request_id, request_id_var
from specdec.serving import status_of

log = logging.getLogger(__name__)
T = TypeVar("T")

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request its client abandoned (nobody reads it)

API = "openai"
FINISH_REASON = {Finish.LENGTH: "length", Finish.EOS: "stop", Finish.STOP: "stop"}
HTTP_STATUS_OF_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPE_OF_STATUS = {400: "invalid_request_error", 403: "permission_error", 404: "not_found_error",
                        405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                        503: "service_unavailable_error", 504: "timeout_error"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    # a message may quote what the client sent, which need not encode (a lone surrogate)
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": ERROR_TYPE_OF_STATUS.get(status, "server_error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def error_of(error: Exception) -> tuple[int, str]:
    """HTTP status and message for a domain error or a model service's gRPC error."""
    status = status_of(error)
    if status is None:
        return 500, f"internal error: {type(error).__name__}: {error}"
    code, message = status
    return HTTP_STATUS_OF_GRPC.get(code, 500), message


def create_app(driver: Driver, model_name: str, max_request_bytes: int, stall_timeout_s: float = 60.0) -> FastAPI:
    """`max_request_bytes`: the largest body accepted (413 beyond it), as gRPC's limit for Generate;
    `stall_timeout_s`: a streamed request whose client takes none of its events this long ends (SseResponse)."""
    app = FastAPI(title="specdec gateway (OpenAI-compatible)", docs_url=None, redoc_url=None)
    created = int(time.time())
    count_invalid = driver.metrics.requests.labels(API, OUTCOME_INVALID).inc
    _add_error_handlers(app, count_invalid)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    app.add_middleware(RequestIds, count_invalid=count_invalid)  # the outermost: every answer carries its id
    logging.getLogger("uvicorn.error").addFilter(DROPPED_STREAM_FILTER)

    @app.get("/health")
    async def health() -> dict:
        """200 while this gateway serves (load balancers' probe; gRPC's grpc.health.v1 says the same)."""
        return {}

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list",
                "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "specdec"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        params = await _prepare(driver, model_name, body)
        render = _Renderer("text_completion", model_name, lambda text: {"text": text, "logprobs": None})
        return await _respond(driver, params, body.stream, body.include_usage, render, request, stall_timeout_s)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        params = await _prepare(driver, model_name, body)
        render = _Renderer("chat.completion", model_name, lambda text: {"message": {"role": "assistant",
                                                                                     "content": text}})
        return await _respond(driver, params, body.stream, body.include_usage, render, request, stall_timeout_s)

    return app


async def _prepare(driver: Driver, model_name: str, body: CompletionRequest | ChatCompletionRequest
                   ) -> GenerationParams:
    if body.model != model_name:
        driver.metrics.requests.labels(API, OUTCOME_INVALID).inc()
        raise NotFoundError(f"the model `{body.model}` does not exist; this gateway serves `{model_name}` "
                            "(GET /v1/models)")
    try:
        request = body.to_generate_request()
    except InvalidRequestError:
        driver.metrics.requests.labels(API, OUTCOME_INVALID).inc()
        raise
    try:
        return await driver.prepare(request, API)
    except InvalidRequestError as e:  # the checks both front doors share name GenerateRequest's fields
        raise InvalidRequestError(str(e).replace("max_new_tokens", "max_tokens")) from None


class _Renderer:
    """Builds OpenAI response objects for one request (whole, or as stream chunks)."""

    def __init__(self, kind: str, model_name: str, choice: Callable[[str], dict]) -> None:
        self.kind = kind
        self.model_name = model_name
        self.choice = choice
        self.id = f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{current_request_id()}"
        self.created = int(time.time())
        self._streamed = False  # a chunk was rendered: the chat role went with the first

    def envelope(self, object_name: str, choices: list[dict], usage: dict | None = None) -> dict:
        body = {"id": self.id, "object": object_name, "created": self.created, "model": self.model_name,
                "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def whole(self, text: str, final: Delta) -> dict:
        choice = {"index": 0, **self.choice(text), "finish_reason": FINISH_REASON[final.finish]}
        return self.envelope(self.kind, [choice], usage(final))

    def chunk(self, text: str | None, finish: Finish | None = None, is_first: bool = False) -> dict:
        if self.kind == "text_completion":
            choice = {"index": 0, "text": text or "", "logprobs": None}
        else:
            delta = {"role": "assistant", "content": text or ""} if is_first else (
                {"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None}
        choice["finish_reason"] = FINISH_REASON[finish] if finish is not None else None
        return self.envelope(self.stream_object, [choice])

    def events(self, delta: Delta, include_usage: bool) -> list[str]:
        """The server-sent events of one delta of a stream."""
        if delta.stats is None:
            events = [_event(self.chunk(delta.text, is_first=not self._streamed))]
        else:
            events = [_event(self.chunk(None, delta.finish, not self._streamed))]
            if include_usage:
                events.append(_event(self.envelope(self.stream_object, [], usage(delta))))
        self._streamed = True
        return events

    @property
    def stream_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat.completion" else "text_completion"


def usage(final: Delta) -> dict:
    """OpenAI's token counts plus the request's speculation figures (GenerationStats fields)."""
    stats = final.stats
    speculation = MessageToDict(stats.to_pb(final.num_completion_tokens), preserving_proto_field_name=True,
                                always_print_fields_with_no_presence=True)
    for key in ("num_prompt_tokens", "num_completion_tokens", "request_id"):
        speculation.pop(key)
    return {"prompt_tokens": stats.num_prompt_tokens, "completion_tokens": final.num_completion_tokens,
            "total_tokens": stats.num_prompt_tokens + final.num_completion_tokens, "speculation": speculation}


async def _respond(driver: Driver, params: GenerationParams, stream: bool, include_usage: bool,
                   render: _Renderer, request: Request, stall_timeout_s: float):
    """Waits for the first tokens before answering, so what fails before them (no capacity, a model
    service down, an unknown draft) gets its own HTTP status, streamed or not."""
    deltas = driver.generate(params, API)
    try:
        first = await _until_disconnected(anext(deltas), request)
    except BaseException:
        await deltas.aclose()
        raise
    if first is None:  # the client left while waiting
        await deltas.aclose()
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if stream:
        return SseResponse(_sse(first, deltas, include_usage, render), stall_timeout_s)
    whole = await _until_disconnected(_collect(first, deltas, render), request)
    return whole if whole is not None else Response(status_code=CLIENT_CLOSED_REQUEST)


class SseResponse(StreamingResponse):
    """Server-sent events whose writes wait at most `stall_timeout_s` for a client that takes none of them
    (connected, not reading: the socket's buffers and the server's write buffer full). Past it the events'
    generator is closed, which ends the generation and frees its model sequences and slot, and the answer is
    left incomplete, on which uvicorn closes the connection; before, such a client held them until it went (the
    gRPC API's --stream-stall-timeout-s)."""

    def __init__(self, events: AsyncIterator[str], stall_timeout_s: float) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._stall_timeout_s = stall_timeout_s
        self.dropped = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().__call__(scope, receive, send)
        # set in the request's own task (stream_response may run in a child), which uvicorn logs from
        _STREAM_DROPPED.set(self.dropped)

    async def stream_response(self, send: Send) -> None:
        async def bounded(message: Message) -> None:
            async with asyncio.timeout(self._stall_timeout_s):
                await send(message)

        try:
            await super().stream_response(bounded)
        except TimeoutError:
            self.dropped = True
            await self.body_iterator.aclose()
            warn_stalled_client(self._stall_timeout_s)


# whether this request's stream was dropped for a stalled client (SseResponse): what uvicorn then logs as an
# ERROR, an answer its app left incomplete, is that drop, which the WARNING above has said
_STREAM_DROPPED: contextvars.ContextVar[bool] = contextvars.ContextVar("stream_dropped", default=False)
INCOMPLETE_ANSWER = "ASGI callable returned without completing response."


class _DroppedStreamFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == INCOMPLETE_ANSWER and _STREAM_DROPPED.get())


DROPPED_STREAM_FILTER = _DroppedStreamFilter()


async def _until_disconnected(work: Awaitable[T], request: Request) -> T | None:
    """`work`'s result, or None (and `work` cancelled) if the client disconnects first: a non-streamed
    request stops generating, as a streamed one does, when nobody waits for it."""
    working = asyncio.ensure_future(work)
    watching = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait([working, watching], return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled: the work ends before the caller closes what it used
        watching.cancel()
        gone = not working.done()
        if gone:
            working.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await working
    return None if gone else working.result()


async def _disconnect(request: Request) -> None:
    """Returns when the client has gone (the body was read already: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(first: Delta, deltas: AsyncIterator[Delta], render: _Renderer) -> dict:
    async with aclosing(deltas):
        text, final = first.text, first
        async for delta in deltas:
            text += delta.text
            final = delta
    return render.whole(text, final)


async def _sse(first: Delta, deltas: AsyncIterator[Delta], include_usage: bool,
               render: _Renderer) -> AsyncIterator[str]:
    try:
        async with aclosing(deltas):
            for event in render.events(first, include_usage):
                yield event
            async for delta in deltas:
                for event in render.events(delta, include_usage):
                    yield event
    except (SpecdecError, grpc.aio.AioRpcError) as e:  # after the first tokens: the error goes in the stream
        yield _event(error_body(*error_of(e)))
    yield "data: [DONE]\n\n"


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


class RequestIds:
    """Every answer carries its request's x-request-id, the caller's or a new one (also on the 400 for a
    malformed one, which is counted invalid), set in `request_id_var` for the request's logs; an unexpected error
    before the answer starts is still answered in OpenAI's shape. Plain ASGI, not Starlette's BaseHTTPMiddleware:
    that runs the app in a task of its own and relays a streamed answer, so a stream SseResponse dropped stayed
    open, the relay waiting on the stalled client, and ended as if complete once the client read again."""

    def __init__(self, app: ASGIApp, count_invalid: Callable[[], None]) -> None:
        self.app = app
        self.count_invalid = count_invalid

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get(REQUEST_ID_KEY)
        problem = None if given is None else check_request_id(given)
        request_id = given if given is not None and problem is None else new_request_id()
        request_id_var.set(request_id)
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                MutableHeaders(scope=message)[REQUEST_ID_KEY] = request_id
            await send(message)

        if problem is not None:  # answered under an id of its own
            self.count_invalid()
            await error_response(400, problem, param=REQUEST_ID_KEY)(scope, receive, send_with_id)
            return
        try:
            await self.app(scope, receive, send_with_id)
        except Exception as e:  # a bug: still answered in OpenAI's shape, with the request's id
            if started:
                raise
            log.exception("unexpected error in %s", scope.get("path"))
            await error_response(*error_of(e))(scope, receive, send_with_id)


class BodyLimit:
    """Refuses a body over `max_bytes` with 413 before it is parsed: parsing and tokenizing an unbounded
    body would hold the event loop that every request and gRPC stream of the gateway shares."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await error_response(413, self._message(int(length)))(scope, receive, send)
            return
        received = 0

        async def receive_within_limit() -> Message:  # a body sent in chunks, of no declared length
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise HTTPException(413, self._message(received))
            return message

        await self.app(scope, receive_within_limit, send)

    def _message(self, size: int) -> str:
        return (f"the request body is {size} bytes or more; this gateway accepts at most {self.max_bytes} "
                "(--max-request-bytes)")


def _add_error_handlers(app: FastAPI, count_invalid: Callable[[], None]) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
        count_invalid()
        message, param = validation_message(error.errors())
        return error_response(400, message, param=param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return error_response(error.status_code, str(error.detail))

    @app.exception_handler(SpecdecError)
    async def domain_error(request: Request, error: SpecdecError) -> JSONResponse:
        status, message = error_of(error)
        code = "model_not_found" if isinstance(error, NotFoundError) else None
        return error_response(status, message, code=code)

    @app.exception_handler(grpc.aio.AioRpcError)
    async def backend_error(request: Request, error: grpc.aio.AioRpcError) -> JSONResponse:
        return error_response(*error_of(error))


UNION_BRANCHES = {"str", "int", "float", "bool", "dict", "list"}  # pydantic names a union's branch in an error's loc


def validation_message(errors: Sequence[dict]) -> tuple[str, str | None]:
    """A message and the offending parameter for pydantic's errors: the deepest field that failed (for a
    union, the branch the value's shape chose) with everything it was told it should be."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        where = f" at character {first['loc'][-1]}" if len(first.get("loc", ())) > 1 else ""
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'malformed')}{where}", None
    by_field: dict[tuple, list[str]] = {}
    for error in errors:
        field = tuple(part for part in error.get("loc", ()) if part != "body" and not _is_branch(part))
        text = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        by_field.setdefault(field, [])
        if text not in by_field[field]:
            by_field[field].append(text)
    field = max(by_field, key=len)
    param = ".".join(str(part) for part in field) or None
    return f"{param + ': ' if param else ''}{'; or '.join(by_field[field])}", param


def _is_branch(part: object) -> bool:
    return isinstance(part, str) and (part in UNION_BRANCHES or "[" in part or part[:1].isupper())
