"""Runs the OpenAI-compatible ASGI app with uvicorn on the gateway's own event loop, next to the
grpc.aio server (one process, one loop, one set of backend channels)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

log = logging.getLogger(__name__)


class _InLoopServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the gateway's serve_until_signal owns SIGINT/SIGTERM


class HttpServer:
    def __init__(self, app: FastAPI, host: str, port: int, max_connections: int | None = None) -> None:
        """Binds now (a busy port fails here); `port` 0 picks a free one (see `.port`). Beyond `max_connections`
        open connections (idle ones included: a client that never finishes its request holds one) a new
        one gets 503 at once, so such clients cannot take every file descriptor of the process."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.port: int = self._socket.getsockname()[1]
        self._host = host
        config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False,
                                limit_concurrency=max_connections)
        self._server = _InLoopServer(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():  # failed to start: raise its error (uvicorn may only log it and return)
                await self._task
                raise OSError(f"the OpenAI-compatible HTTP API on {self._host}:{self.port} did not start; see the log")
            await asyncio.sleep(0.01)
        log.info("OpenAI-compatible HTTP API on http://%s:%d/v1", self._host, self.port)

    async def stop(self, grace_s: float) -> None:
        """Refuses new connections; lets the requests running finish for up to `grace_s` (stop_now cuts
        that short), then cancels what is left."""
        self._server.config.timeout_graceful_shutdown = grace_s
        self._server.should_exit = True
        if self._task is not None:
            await self._task
        self._socket.close()

    def close(self) -> None:
        """Lets go of the bound port of a server never started."""
        self._socket.close()

    def stop_now(self) -> None:
        """During a `stop`: stops waiting for the running requests."""
        self._server.force_exit = True
