"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions (SSE when `stream`),
/v1/models, mapped onto the same generation driver as gRPC Generate.

Errors come back in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with the
HTTP status of the matching gRPC status (400 invalid, 404 unknown model, 429 no capacity,
503 a model service down). `usage` carries OpenAI's token counts plus `speculation`, the
request's figures from the final Generate chunk.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from google.protobuf.json_format import MessageToDict
from starlette.exceptions import HTTPException

from gateway.driver import Delta, Driver
from gateway.metrics import OUTCOME_INVALID
from gateway.openai_protocol import ChatCompletionRequest, CompletionRequest
from gateway.output import Finish
from gateway.request import GenerationParams
from specdec.errors import InvalidRequestError, NotFoundError, SpecdecError
from specdec.request_id import REQUEST_ID_KEY, check_request_id, current_request_id, new_request_id, request_id_var
from specdec.serving import status_of

log = logging.getLogger(__name__)

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
                        429: "rate_limit_error", 503: "service_unavailable_error"}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    body = {"message": message, "type": ERROR_TYPE_OF_STATUS.get(status, "server_error"), "param": param,
            "code": code}
    return JSONResponse({"error": body}, status_code=status)


def error_of(error: Exception) -> tuple[int, str]:
    """HTTP status and message for a domain error or a model service's gRPC error."""
    status = status_of(error)
    if status is None:
        return 500, f"internal error: {type(error).__name__}: {error}"
    code, message = status
    return HTTP_STATUS_OF_GRPC.get(code, 500), message


def create_app(driver: Driver, model_name: str) -> FastAPI:
    app = FastAPI(title="specdec gateway (OpenAI-compatible)", docs_url=None, redoc_url=None)
    created = int(time.time())
    _add_error_handlers(app)
    app.middleware("http")(_request_id_middleware)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list",
                "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "specdec"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        params = _prepare(driver, model_name, body)
        render = _Renderer("text_completion", model_name, lambda text: {"text": text, "logprobs": None})
        return await _respond(driver, params, body.stream, body.include_usage, render)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        params = _prepare(driver, model_name, body)
        render = _Renderer("chat.completion", model_name, lambda text: {"message": {"role": "assistant",
                                                                                     "content": text}})
        return await _respond(driver, params, body.stream, body.include_usage, render)

    return app


def _prepare(driver: Driver, model_name: str, body: CompletionRequest | ChatCompletionRequest) -> GenerationParams:
    if body.model != model_name:
        driver.metrics.requests.labels(API, OUTCOME_INVALID).inc()
        raise NotFoundError(f"the model `{body.model}` does not exist; this gateway serves `{model_name}` "
                            "(GET /v1/models)")
    try:
        request = body.to_generate_request()
    except InvalidRequestError:
        driver.metrics.requests.labels(API, OUTCOME_INVALID).inc()
        raise
    return driver.prepare(request, API)


class _Renderer:
    """Builds OpenAI response objects for one request (whole, or as stream chunks)."""

    def __init__(self, kind: str, model_name: str, choice: Callable[[str], dict]) -> None:
        self.kind = kind
        self.model_name = model_name
        self.choice = choice
        self.id = f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{current_request_id()}"
        self.created = int(time.time())

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
                   render: _Renderer):
    if stream:
        return StreamingResponse(_sse(driver, params, include_usage, render), media_type="text/event-stream")
    text = ""
    async with aclosing(driver.generate(params, API)) as deltas:
        async for delta in deltas:
            text += delta.text
            final = delta
    return render.whole(text, final)


async def _sse(driver: Driver, params: GenerationParams, include_usage: bool,
               render: _Renderer) -> AsyncIterator[str]:
    is_first = True
    try:
        async with aclosing(driver.generate(params, API)) as deltas:
            async for delta in deltas:
                if delta.stats is None:
                    yield _event(render.chunk(delta.text, is_first=is_first))
                    is_first = False
                    continue
                yield _event(render.chunk(None, delta.finish, is_first))
                if include_usage:
                    yield _event(render.envelope(render.stream_object, [], usage(delta)))
    except (SpecdecError, grpc.aio.AioRpcError) as e:  # headers are sent: the error goes in the stream
        status, message = error_of(e)
        yield _event({"error": {"message": message, "type": ERROR_TYPE_OF_STATUS.get(status, "server_error"),
                                "param": None, "code": status}})
    yield "data: [DONE]\n\n"


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


async def _request_id_middleware(request: Request, call_next):
    given = request.headers.get(REQUEST_ID_KEY)
    if given is not None and (problem := check_request_id(given)) is not None:
        return error_response(400, problem, param=REQUEST_ID_KEY)
    request_id = given or new_request_id()
    request_id_var.set(request_id)
    response = await call_next(request)
    response.headers[REQUEST_ID_KEY] = request_id
    return response


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(location) or None
        return error_response(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param=param)

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

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, error: Exception) -> JSONResponse:
        log.exception("unexpected error in %s", request.url.path, exc_info=error)
        return error_response(*error_of(error))
