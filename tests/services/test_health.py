"""grpc.health.v1 on our servers: a Watch follows the service's status and, at a graceful stop, hears
NOT_SERVING and ends, so the stop waits for running requests only, not for its watchers."""
from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.serving import start_server

SERVICE = "specdec.v1.Example"
GRACE_S = 30.0


async def _watch_through_a_stop() -> tuple[list[int], grpc.StatusCode]:
    server = await start_server(lambda s: None, [SERVICE], "127.0.0.1", 0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE))
        heard = [(await watch.read()).status]  # SERVING
        stopping = asyncio.ensure_future(server.stop(GRACE_S))
        while (response := await watch.read()) is not grpc.aio.EOF:
            heard.append(response.status)
        await asyncio.wait_for(stopping, GRACE_S / 2)  # well before the grace runs out
        return heard, await watch.code()


def test_a_watch_hears_not_serving_at_a_graceful_stop_and_does_not_hold_it(loop):
    heard, code = loop.run(_watch_through_a_stop())
    assert heard == [health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING]
    assert code == grpc.StatusCode.OK
