"""Gateway.Generate: protobuf <-> the generation driver, nothing else."""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from gateway.driver import Driver
from gateway.output import Finish
from specdec.v1 import gateway_pb2, gateway_pb2_grpc

API = "grpc"
FINISH_REASON_PB = {
    Finish.LENGTH: gateway_pb2.FINISH_REASON_LENGTH,
    Finish.EOS: gateway_pb2.FINISH_REASON_EOS,
    Finish.STOP: gateway_pb2.FINISH_REASON_STOP,
}


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, driver: Driver) -> None:
        self._driver = driver

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        params = await self._driver.prepare(request, API)
        async with aclosing(self._driver.generate(params, API, context.time_remaining())) as deltas:
            async for delta in deltas:
                if delta.stats is None:
                    yield gateway_pb2.GenerateResponse(token_ids=delta.token_ids, text=delta.text)
                else:  # the final delta: no tokens, the finish reason and the request's figures
                    yield gateway_pb2.GenerateResponse(
                        finish_reason=FINISH_REASON_PB[delta.finish],
                        stats=delta.stats.to_pb(delta.num_completion_tokens),
                    )
