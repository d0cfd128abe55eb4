"""The OpenAI API's event stream gives up on a client that takes none of its events: the events' generator
(in the gateway, the generation holding model sequences) is closed once a write has waited the stall timeout."""
from __future__ import annotations

import asyncio
import logging
import socket
import time

from fastapi import FastAPI

from gateway.http_server import HttpServer
from gateway.openai_api import DROPPED_STREAM_FILTER, RequestIds, SseResponse


def test_a_write_the_client_never_takes_closes_the_events_after_the_stall_timeout():
    closed = asyncio.Event()
    sent: list[dict] = []

    async def events():
        try:
            for i in range(100):
                yield f"data: {i}\n\n"
        finally:
            closed.set()

    async def send(message: dict) -> None:  # the client's buffers are full after two events
        if len([m for m in sent if m["type"] == "http.response.body"]) == 2:
            await asyncio.sleep(3600)
        sent.append(message)

    async def run() -> float:
        started = time.monotonic()
        await SseResponse(events(), stall_timeout_s=0.2).stream_response(send)
        return time.monotonic() - started

    waited = asyncio.run(run())
    assert closed.is_set()
    assert 0.2 <= waited < 2.0
    assert [m.get("body") for m in sent] == [None, b"data: 0\n\n", b"data: 1\n\n"]


def test_a_client_that_reads_gets_every_event_and_the_end_of_the_stream():
    async def events():
        for i in range(3):
            yield f"data: {i}\n\n"

    sent: list[dict] = []

    async def send(message: dict) -> None:
        await asyncio.sleep(0.01)  # slower than the events, never stalled for the timeout
        sent.append(message)

    asyncio.run(SseResponse(events(), stall_timeout_s=0.5).stream_response(send))
    assert [m.get("body") for m in sent[1:]] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
    assert sent[-1]["more_body"] is False


def test_a_stream_dropped_for_a_stalled_client_logs_its_warning_and_no_server_error(caplog):
    """Through uvicorn on a real socket, behind the OpenAI app's middleware and log filter (create_app): a client
    that sends its request and never reads. The gateway closes the connection, and the dropped stream is the
    WARNING that says why; uvicorn's ERROR for an answer left incomplete is not logged for it."""
    closed = asyncio.Event()

    async def events():
        try:
            while True:
                yield "data: " + "x" * 65536 + "\n\n"
        finally:
            closed.set()

    app = FastAPI()
    app.add_middleware(RequestIds, count_invalid=lambda: None)
    logging.getLogger("uvicorn.error").addFilter(DROPPED_STREAM_FILTER)

    @app.get("/events")
    async def stream():
        return SseResponse(events(), stall_timeout_s=0.3)

    async def run() -> None:
        server = HttpServer(app, "127.0.0.1", 0)
        await server.start()
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", server.port))
        client.sendall(b"GET /events HTTP/1.1\r\nHost: test\r\n\r\n")
        try:
            await asyncio.wait_for(closed.wait(), 10)
            client.setblocking(False)
            received, deadline = b"", time.monotonic() + 10
            while True:  # what was buffered, then the end of the connection
                try:
                    chunk = client.recv(1 << 20)
                except BlockingIOError:
                    assert time.monotonic() < deadline, f"the connection still open, {len(received)} bytes read"
                    await asyncio.sleep(0.01)
                    continue
                if not chunk:
                    break
                received += chunk
            assert received.startswith(b"HTTP/1.1 200") and b"x-request-id: " in received
            assert not received.endswith(b"0\r\n\r\n")  # dropped: no end of the chunked answer
        finally:
            client.close()
            await server.stop(1.0)

    with caplog.at_level(logging.INFO):
        asyncio.run(run())
    assert any("stopped reading its stream" in r.getMessage() for r in caplog.records)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
