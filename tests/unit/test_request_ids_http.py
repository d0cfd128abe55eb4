"""The OpenAI API's request-id middleware through uvicorn on a real socket: every answer carries an id (the
caller's, or a new one for a malformed or missing one), a malformed one is a counted 400, and a bug in a route
is still a 500 in OpenAI's shape."""
from __future__ import annotations

import asyncio

import requests
from fastapi import FastAPI

from gateway.http_server import HttpServer
from gateway.openai_api import RequestIds
from specdec.request_id import REQUEST_ID_KEY, current_request_id


def _serve_and_get(app: FastAPI, path: str, headers: dict[str, str]) -> requests.Response:
    async def run() -> requests.Response:
        server = HttpServer(app, "127.0.0.1", 0)
        await server.start()
        try:
            return await asyncio.to_thread(requests.get, f"http://127.0.0.1:{server.port}{path}", headers=headers,
                                           timeout=30)
        finally:
            await server.stop(1.0)

    return asyncio.run(run())


def _app(invalid: list[int]) -> FastAPI:
    app = FastAPI()
    app.add_middleware(RequestIds, count_invalid=lambda: invalid.append(1))

    @app.get("/id")
    async def echo() -> dict:
        return {"seen": current_request_id()}

    @app.get("/bug")
    async def bug() -> dict:
        raise RuntimeError("a bug")

    return app


def test_the_callers_request_id_reaches_the_handler_and_comes_back():
    invalid: list[int] = []
    response = _serve_and_get(_app(invalid), "/id", {REQUEST_ID_KEY: "req-1"})
    assert response.status_code == 200 and response.json() == {"seen": "req-1"}
    assert response.headers[REQUEST_ID_KEY] == "req-1" and invalid == []


def test_a_missing_request_id_is_made():
    response = _serve_and_get(_app([]), "/id", {})
    made = response.headers[REQUEST_ID_KEY]
    assert len(made) == 32 and response.json() == {"seen": made}


def test_a_malformed_request_id_is_a_counted_400_under_a_new_id():
    invalid: list[int] = []
    response = _serve_and_get(_app(invalid), "/id", {REQUEST_ID_KEY: "has spaces"})
    assert response.status_code == 400 and invalid == [1]
    error = response.json()["error"]
    assert error["param"] == REQUEST_ID_KEY and error["type"] == "invalid_request_error"
    assert len(response.headers[REQUEST_ID_KEY]) == 32


def test_a_bug_in_a_route_is_a_500_in_openais_shape_with_the_request_id(caplog):
    response = _serve_and_get(_app([]), "/bug", {REQUEST_ID_KEY: "req-2"})
    assert response.status_code == 500 and response.headers[REQUEST_ID_KEY] == "req-2"
    error = response.json()["error"]
    assert error["type"] == "server_error" and "RuntimeError: a bug" in error["message"]
    assert any("unexpected error in /bug" in r.getMessage() for r in caplog.records)
