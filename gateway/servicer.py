"""Gateway.Generate: protobuf <-> the generation driver, and a bound on a client that stops reading its stream."""
from __future__ import annotations

import asyncio
from contextlib import aclosing

import grpc

from gateway.driver import Driver, warn_stalled_client
from gateway.output import Finish
from specdec.v1 import gateway_pb2, gateway_pb2_grpc

API = "grpc"
FINISH_REASON_PB = {
    Finish.LENGTH: gateway_pb2.FINISH_REASON_LENGTH,
    Finish.EOS: gateway_pb2.FINISH_REASON_EOS,
    Finish.STOP: gateway_pb2.FINISH_REASON_STOP,
}


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, driver: Driver, stall_timeout_s: float) -> None:
        """`stall_timeout_s`: a client that takes none of its stream's messages for this long is dropped."""
        self._driver = driver
        self._stall_timeout_s = stall_timeout_s

    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        params = await self._driver.prepare(request, API)
        async with aclosing(self._driver.generate(params, API, context.time_remaining())) as deltas:
            async for delta in deltas:
                if delta.stats is None:
                    response = gateway_pb2.GenerateResponse(token_ids=delta.token_ids, text=delta.text)
                else:  # the final delta: no tokens, the finish reason and the request's figures
                    response = gateway_pb2.GenerateResponse(finish_reason=FINISH_REASON_PB[delta.finish],
                                                            stats=delta.stats.to_pb(delta.num_completion_tokens))
                if not await self._written(response, context):
                    break
            else:
                return
        # the generation is closed, its model sequences freed; the status waits behind what the client has not taken
        warn_stalled_client(self._stall_timeout_s)
        await context.abort(grpc.StatusCode.CANCELLED,
                            f"the client stopped reading the stream: nothing it was sent was taken for "
                            f"{self._stall_timeout_s:g} s (--stream-stall-timeout-s), so the request was cancelled")

    async def _written(self, response: gateway_pb2.GenerateResponse, context: grpc.aio.ServicerContext) -> bool:
        """Writes `response`; False if the client's flow-control window stayed full for the stall timeout (a
        client connected but not reading)."""
        try:
            async with asyncio.timeout(self._stall_timeout_s):
                await context.write(response)
        except TimeoutError:
            return False
        return True
