"""The gateway's view of the model services: channels, per-request streams, and start-up checks."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc
from transformers import PreTrainedTokenizerBase

from engine.tokenizer_info import tokenizer_from_files
from specdec.errors import IncompatibleModelsError, ServiceUnavailableError
from specdec.request_id import request_id_metadata
from specdec.serving import CHANNEL_OPTIONS
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verified:
    num_accepted: int
    committed_ids: list[int]


class _BidiStream:
    """One request's bidi stream to a model service: write a command, read its answer."""

    def __init__(self, call: grpc.aio.StreamStreamCall, service: str) -> None:
        self._call = call
        self._service = service
        self.forward_ns = 0  # the service's forward time over this stream's answers

    async def ask(self, request):
        await self._call.write(request)
        response = await self._call.read()
        if response is grpc.aio.EOF:
            raise ServiceUnavailableError(f"the {self._service} service closed the stream unexpectedly")
        self.forward_ns += response.forward_ns
        return response

    async def close(self) -> None:
        """Ends the stream; the service frees the sequence's state."""
        self._call.cancel()


class TargetStream(_BidiStream):
    async def prefill(self, prompt_ids: list[int], max_new_tokens: int) -> int:
        command = target_pb2.PrefillCommand(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens)
        response = await self.ask(target_pb2.TargetRequest(prefill=command))
        return response.prefill.token_id

    async def verify(self, draft_ids: list[int]) -> Verified:
        response = await self.ask(target_pb2.TargetRequest(verify=target_pb2.VerifyCommand(draft_ids=draft_ids)))
        return Verified(response.verify.num_accepted_draft_tokens, list(response.verify.committed_ids))


class DraftStream(_BidiStream):
    def __init__(self, call: grpc.aio.StreamStreamCall, draft_model: str = "") -> None:
        super().__init__(call, "draft")
        self._draft_model = draft_model

    async def start(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        command = draft_pb2.StartCommand(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens,
                                         draft_model=self._draft_model)
        await self.ask(draft_pb2.DraftRequest(start=command))

    async def propose(self, num_accepted: int, append_ids: list[int], num_draft_tokens: int) -> list[int]:
        command = draft_pb2.ProposeCommand(
            num_accepted_draft_tokens=num_accepted, append_ids=append_ids, num_draft_tokens=num_draft_tokens
        )
        response = await self.ask(draft_pb2.DraftRequest(propose=command))
        return list(response.proposal.draft_ids)


class Backends:
    """Channels to the target pool and (optionally) the draft pool, load-balanced by gRPC."""

    def __init__(self, target_address: str, draft_address: str | None) -> None:
        self._target_channel = grpc.aio.insecure_channel(target_address, options=CHANNEL_OPTIONS)
        self._target = target_pb2_grpc.TargetServiceStub(self._target_channel)
        self._draft_channel = grpc.aio.insecure_channel(draft_address, options=CHANNEL_OPTIONS) if draft_address else None
        self._draft = draft_pb2_grpc.DraftServiceStub(self._draft_channel) if self._draft_channel else None
        self.target_info: common_pb2.ModelInfo | None = None
        self.draft_info: common_pb2.ModelInfo | None = None

    @property
    def has_draft(self) -> bool:
        return self._draft is not None

    async def connect(self, timeout_s: float) -> PreTrainedTokenizerBase:
        """Waits for the services, checks they are compatible, returns the target's tokenizer."""
        try:
            self.target_info = await self._target.GetModelInfo(
                common_pb2.ModelInfoRequest(), timeout=timeout_s, wait_for_ready=True)
            files = await self._target.GetTokenizer(common_pb2.TokenizerRequest(), timeout=timeout_s)
            if self._draft is not None:
                self.draft_info = await self._draft.GetModelInfo(
                    common_pb2.ModelInfoRequest(), timeout=timeout_s, wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            raise ServiceUnavailableError(f"cannot reach a model service: {e.code().name}: {e.details()}") from e
        if self.draft_info is not None:
            check_compatible(self.target_info, self.draft_info)
        return tokenizer_from_files(dict(files.files))

    def open_target(self) -> TargetStream:
        """A stream for the current request (its request id travels in the metadata)."""
        return TargetStream(self._target.Sequence(metadata=request_id_metadata()), "target")

    def open_draft(self, draft_model: str = "") -> DraftStream:
        """A stream to the named draft ("" for the draft service's default), as open_target."""
        assert self._draft is not None
        return DraftStream(self._draft.Sequence(metadata=request_id_metadata()), draft_model)

    async def close(self) -> None:
        await self._target_channel.close()
        if self._draft_channel is not None:
            await self._draft_channel.close()


def check_compatible(target: common_pb2.ModelInfo, draft: common_pb2.ModelInfo) -> None:
    """A draft must speak the target's token ids: same tokenizer (or a tokenizer-free drafter)."""
    if draft.tokenizer_fingerprint and draft.tokenizer_fingerprint != target.tokenizer_fingerprint:
        raise IncompatibleModelsError(
            f"draft {draft.model_id!r} and target {target.model_id!r} use different tokenizers "
            f"(fingerprints {draft.tokenizer_fingerprint[:12]} vs {target.tokenizer_fingerprint[:12]}, "
            f"vocab sizes {draft.vocab_size} vs {target.vocab_size}); pick a draft trained with the "
            "target's tokenizer, or use --drafter ngram"
        )
