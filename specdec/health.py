"""grpc.health.v1 for our servers: grpc's own servicer, whose Watch streams end at a graceful stop.

A server's graceful stop waits for every RPC still open, and a health Watch (a load balancer's, a
sidecar's, a client channel's health checking) never ends by itself: one open Watch held every stop for
its whole grace (30 s by default) though nothing was being served. Here a Watch ends once it has told
its watcher NOT_SERVING, so the stop waits only for the requests that are running.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from grpc_health.v1 import health, health_pb2


class HealthServicer(health.aio.HealthServicer):
    def __init__(self) -> None:
        super().__init__()
        self._stopping = False

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING for good (grpc's), then each Watch ends once it has said so."""
        self._stopping = True
        await super().enter_graceful_shutdown()

    async def Watch(self, request: health_pb2.HealthCheckRequest, context) -> None:
        told = asyncio.Event()
        watching = asyncio.ensure_future(super().Watch(request, _Telling(context, lambda: self._stopping, told)))
        ending = asyncio.ensure_future(told.wait())
        try:
            await asyncio.wait([watching, ending], return_when=asyncio.FIRST_COMPLETED)
        finally:
            ending.cancel()
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching


class _Telling:
    """A Watch's context that sets `told` once NOT_SERVING has been written while stopping."""

    def __init__(self, context, stopping: Callable[[], bool], told: asyncio.Event) -> None:
        self._context = context
        self._stopping = stopping
        self._told = told

    async def write(self, response: health_pb2.HealthCheckResponse) -> None:
        await self._context.write(response)
        if self._stopping() and response.status == health_pb2.HealthCheckResponse.NOT_SERVING:
            self._told.set()

    def __getattr__(self, name: str):
        return getattr(self._context, name)
