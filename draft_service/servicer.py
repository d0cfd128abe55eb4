"""DraftService: protobuf <-> Drafter, nothing else."""
from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from engine.drafter import DraftSequence, Drafter
from specdec.errors import InvalidRequestError
from specdec.messages import model_info_pb
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, drafter: Drafter) -> None:
        self._drafter = drafter

    async def Sequence(
        self, request_iterator: AsyncIterator[draft_pb2.DraftRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[draft_pb2.DraftResponse]:
        seq: DraftSequence | None = None
        try:
            async for request in request_iterator:
                command = request.WhichOneof("command")
                if command == "start" and seq is None:
                    seq = await self._drafter.start(list(request.start.prompt_ids), request.start.max_new_tokens)
                    yield draft_pb2.DraftResponse(started=draft_pb2.StartResult())
                elif command == "propose" and seq is not None:
                    p = request.propose
                    draft_ids, timing = await self._drafter.propose(
                        seq, p.num_accepted_draft_tokens, list(p.append_ids), p.num_draft_tokens
                    )
                    yield draft_pb2.DraftResponse(
                        proposal=draft_pb2.ProposeResult(draft_ids=draft_ids), forward_ns=timing.forward_ns
                    )
                else:
                    raise InvalidRequestError(
                        f"unexpected {command or 'empty'} command: a Sequence stream is one start, then proposes"
                    )
        finally:  # normal end, error, cancellation or a dead client: the state goes back
            if seq is not None:
                self._drafter.release(seq)

    async def GetModelInfo(self, request, context) -> common_pb2.ModelInfo:
        return model_info_pb(self._drafter.description)

    async def GetEngineStats(self, request, context) -> common_pb2.EngineStats:
        return common_pb2.EngineStats(**self._drafter.stats())
