"""DraftService: protobuf <-> the draft registry and its drafters, nothing else."""
from __future__ import annotations

import hmac
from collections.abc import AsyncIterator

import grpc

from draft_service.registry import DraftInfo, DraftRegistry, Lease
from engine.drafter import DraftSequence
from specdec.errors import InvalidRequestError, PermissionDeniedError
from specdec.messages import distributions_pb, model_info_pb, sampling_params
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc


_REHEARSAL_REQUEST = draft_pb2.DraftRequest(
    propose=draft_pb2.ProposeCommand(num_accepted_draft_tokens=2, append_ids=[1], num_draft_tokens=4)).SerializeToString()


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, drafts: DraftRegistry, admin_token: str | None = None) -> None:
        """`admin_token`: what LoadDraft/UnloadDraft/SetDefaultDraft callers must send; None disables them."""
        self._drafts = drafts
        self._admin_token = admin_token

    async def Sequence(
        self, request_iterator: AsyncIterator[draft_pb2.DraftRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[draft_pb2.DraftResponse]:
        lease: Lease | None = None
        seq: DraftSequence | None = None
        try:
            async for request in request_iterator:
                command = request.WhichOneof("command")
                if command == "start" and lease is None:
                    lease = self._drafts.acquire(request.start.draft_model)
                    seq = await lease.drafter.start(list(request.start.prompt_ids), request.start.max_new_tokens,
                                                    sampling_params(request.start.sampling))
                    yield draft_pb2.DraftResponse(started=draft_pb2.StartResult(), forward_ns=seq.prefill_forward_ns)
                elif command == "propose" and seq is not None:
                    p = request.propose
                    draft_ids, timing = await lease.drafter.propose(
                        seq, p.num_accepted_draft_tokens, list(p.append_ids), p.num_draft_tokens
                    )
                    result = draft_pb2.ProposeResult(draft_ids=draft_ids,
                                                     draft_probs=distributions_pb(seq.proposal_probs))
                    yield draft_pb2.DraftResponse(proposal=result, forward_ns=timing.forward_ns)
                else:
                    raise InvalidRequestError(
                        f"unexpected {command or 'empty'} command: a Sequence stream is one start, then proposes"
                    )
        finally:  # normal end, error, cancellation or a dead client: the state goes back
            if seq is not None:
                lease.drafter.release(seq)
            if lease is not None:
                self._drafts.release(lease)

    def rehearse(self) -> None:
        """A proposal's host work on scratch objects, its messages included (specdec/busy_poll.py's keeping
        warm): a command parsed, the default drafter's rehearsal where it has one, an answer serialized."""
        request = draft_pb2.DraftRequest.FromString(_REHEARSAL_REQUEST)
        append_ids = list(request.propose.append_ids)
        rehearse = getattr(self._drafts.default, "rehearse", None)  # model drafters (engine/model_drafter.py)
        if rehearse is not None:
            rehearse()
        result = draft_pb2.ProposeResult(draft_ids=append_ids * request.propose.num_draft_tokens,
                                         draft_probs=distributions_pb([]))
        draft_pb2.DraftResponse(proposal=result, forward_ns=0).SerializeToString()

    async def GetModelInfo(self, request, context) -> common_pb2.ModelInfo:
        return model_info_pb(self._drafts.default.description)

    async def GetEngineStats(self, request, context) -> common_pb2.EngineStats:
        return common_pb2.EngineStats(**self._drafts.stats())

    async def LoadDraft(self, request: draft_pb2.LoadDraftRequest, context) -> draft_pb2.LoadDraftResponse:
        self._check_admin(context)
        info, seconds = await self._drafts.load(request.name, request.model, request.make_default,
                                                request.expected_tokenizer_fingerprint, request.replace)
        return draft_pb2.LoadDraftResponse(loaded=_entry_pb(info), load_s=seconds)

    async def UnloadDraft(self, request: draft_pb2.UnloadDraftRequest, context) -> draft_pb2.ListDraftsResponse:
        self._check_admin(context)
        self._drafts.unload(request.name)
        return await self.ListDrafts(draft_pb2.ListDraftsRequest(), context)

    async def SetDefaultDraft(self, request: draft_pb2.SetDefaultDraftRequest,
                              context) -> draft_pb2.ListDraftsResponse:
        self._check_admin(context)
        self._drafts.set_default(request.name)
        return await self.ListDrafts(draft_pb2.ListDraftsRequest(), context)

    async def ListDrafts(self, request, context) -> draft_pb2.ListDraftsResponse:
        return draft_pb2.ListDraftsResponse(drafts=[_entry_pb(info) for info in self._drafts.list()])

    def _check_admin(self, context: grpc.aio.ServicerContext) -> None:
        if self._admin_token is None:
            raise PermissionDeniedError(
                "admin RPCs are disabled on this draft service; start it with --admin-token "
                "(or SPECDEC_DRAFT_ADMIN_TOKEN) and send 'authorization: Bearer TOKEN'")
        sent = [value for key, value in context.invocation_metadata() or () if key == "authorization"]
        if len(sent) != 1 or not hmac.compare_digest(sent[0].encode(), f"Bearer {self._admin_token}".encode()):
            raise PermissionDeniedError("missing or wrong admin token: send 'authorization: Bearer TOKEN' metadata")


def _entry_pb(info: DraftInfo) -> draft_pb2.DraftEntry:
    return draft_pb2.DraftEntry(name=info.name, info=model_info_pb(info.drafter.description),
                                is_default=info.is_default)
