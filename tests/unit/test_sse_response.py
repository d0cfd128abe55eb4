"""The OpenAI API's event stream gives up on a client that takes none of its events: the events' generator
(in the gateway, the generation holding model sequences) is closed once a write has waited the stall timeout."""
from __future__ import annotations

import asyncio
import time

from gateway.openai_api import SseResponse


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
