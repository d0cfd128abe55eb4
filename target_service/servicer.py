"""TargetService: protobuf <-> TargetEngine, nothing else."""
from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from engine.target_engine import StepTiming, TargetEngine, TargetSequence
from engine.tokenizer_info import tokenizer_files
from specdec.errors import InvalidRequestError
from specdec.messages import distributions, model_info_pb, sampling_params
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc


_REHEARSAL_REQUEST = target_pb2.TargetRequest(verify=target_pb2.VerifyCommand(draft_ids=[1, 2, 3, 4])).SerializeToString()


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, engine: TargetEngine) -> None:
        self._engine = engine
        self._tokenizer_files = tokenizer_files(engine.runner.tokenizer)

    async def Sequence(
        self, request_iterator: AsyncIterator[target_pb2.TargetRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[target_pb2.TargetResponse]:
        seq: TargetSequence | None = None
        try:
            async for request in request_iterator:
                command = request.WhichOneof("command")
                if command == "prefill" and seq is None:
                    seq, token_id, timing = await self._engine.prefill(
                        list(request.prefill.prompt_ids), request.prefill.max_new_tokens,
                        sampling_params(request.prefill.sampling),
                    )
                    yield _response(timing, prefill=target_pb2.PrefillResult(token_id=token_id))
                elif command == "verify" and seq is not None:
                    verification, timing = await self._engine.verify(
                        seq, list(request.verify.draft_ids), distributions(request.verify.draft_probs))
                    result = target_pb2.VerifyResult(
                        num_accepted_draft_tokens=verification.num_accepted,
                        committed_ids=verification.committed_ids,
                    )
                    yield _response(timing, verify=result)
                else:
                    raise InvalidRequestError(
                        f"unexpected {command or 'empty'} command: a Sequence stream is one prefill, then verifies"
                    )
        finally:  # normal end, error, cancellation or a dead client: the KV goes back
            if seq is not None:
                self._engine.release(seq)

    def rehearse(self) -> None:
        """A verify's host work on scratch objects, its messages included (specdec/busy_poll.py's keeping
        warm): a command parsed, the engine's rehearsal, an answer serialized."""
        request = target_pb2.TargetRequest.FromString(_REHEARSAL_REQUEST)
        draft_ids = list(request.verify.draft_ids)
        self._engine.rehearse()
        result = target_pb2.VerifyResult(num_accepted_draft_tokens=len(draft_ids), committed_ids=draft_ids)
        _response(StepTiming(0, 1), verify=result).SerializeToString()

    async def GetModelInfo(self, request, context) -> common_pb2.ModelInfo:
        return model_info_pb(self._engine.runner.description)

    async def GetTokenizer(self, request, context) -> common_pb2.TokenizerFiles:
        return common_pb2.TokenizerFiles(
            files=self._tokenizer_files,
            tokenizer_fingerprint=self._engine.runner.description.tokenizer_fingerprint,
        )

    async def GetEngineStats(self, request, context) -> common_pb2.EngineStats:
        return common_pb2.EngineStats(**self._engine.stats())


def _response(timing: StepTiming, **result) -> target_pb2.TargetResponse:
    return target_pb2.TargetResponse(forward_ns=timing.forward_ns, batch_size=timing.batch_size, **result)
