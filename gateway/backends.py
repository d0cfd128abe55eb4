"""The gateway's view of the model services: channels, per-request streams, and start-up checks."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
from transformers import PreTrainedTokenizerBase

from engine.sampling import Distribution, SamplingParams
from engine.tokenizer_info import tokenizer_from_files
from gateway.config import GatewayConfig
from specdec.errors import IncompatibleModelsError, ServiceUnavailableError
from specdec.messages import distributions, distributions_pb, sampling_params_pb
from specdec.request_id import request_id_metadata
from specdec.serving import open_channel
from specdec.tls import ClientTls
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verified:
    num_accepted: int
    committed_ids: list[int]


@dataclass(frozen=True)
class Proposal:
    token_ids: list[int]
    probs: list[Distribution]  # sampled requests: the distribution each token was drawn from
    forward_ns: int = 0  # the draft's forward time for this proposal


class StreamLost(ServiceUnavailableError):
    """A model stream broke (replica gone, connection lost, no answer in time): the request goes
    on without it - without the draft, or on another target replica after a re-prefill."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out  # connected, but silent past its step timeout (a hung process, say)


class DraftLost(StreamLost):
    pass


class TargetLost(StreamLost):
    pass


# A target error with one of these codes means the replica or the connection is gone, not that
# the request is wrong: the request moves to another replica. Any other status passes through.
TARGET_LOST_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED,
                               grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})
# The draft is optional, so only a draft the client named and the service lacks passes through (NOT_FOUND),
# and the request's own deadline (DEADLINE_EXCEEDED: every stream of a request carries it, so the target's ends
# too; the request is over, not the draft); anything else ends drafting for the request, which goes on
# target-only: a draft gone, overloaded, too slow or broken, and a draft that cannot take a request the target
# accepted (a shorter context, another vocabulary: a draft loaded live is checked against the target only where
# the loader says so).
DRAFT_REQUEST_ERRORS = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED})


def verify_request(proposal: Proposal) -> target_pb2.TargetRequest:
    return target_pb2.TargetRequest(verify=target_pb2.VerifyCommand(
        draft_ids=proposal.token_ids, draft_probs=distributions_pb(proposal.probs)))


def verified(response: target_pb2.TargetResponse) -> Verified:
    return Verified(response.verify.num_accepted_draft_tokens, list(response.verify.committed_ids))


def propose_request(num_accepted: int, append_ids: list[int], num_draft_tokens: int) -> draft_pb2.DraftRequest:
    return draft_pb2.DraftRequest(propose=draft_pb2.ProposeCommand(
        num_accepted_draft_tokens=num_accepted, append_ids=append_ids, num_draft_tokens=num_draft_tokens))


def proposed(response: draft_pb2.DraftResponse) -> Proposal:
    return Proposal(list(response.proposal.draft_ids), distributions(response.proposal.draft_probs), response.forward_ns)


_REHEARSAL_ANSWERS = (
    target_pb2.TargetResponse(verify=target_pb2.VerifyResult(num_accepted_draft_tokens=2, committed_ids=[1, 2, 3]))
    .SerializeToString(),
    draft_pb2.DraftResponse(proposal=draft_pb2.ProposeResult(draft_ids=[1, 2, 3, 4]), forward_ns=1).SerializeToString(),
)


def rehearse_messages() -> None:
    """A step's messages as the gateway builds, writes, reads and unpacks them, on made-up values
    (specdec/busy_poll.py's keeping warm): no stream is touched."""
    verify_answer, propose_answer = _REHEARSAL_ANSWERS
    proposal = proposed(draft_pb2.DraftResponse.FromString(propose_answer))
    verify_request(proposal).SerializeToString()
    verification = verified(target_pb2.TargetResponse.FromString(verify_answer))
    propose_request(verification.num_accepted, verification.committed_ids[-1:], 4).SerializeToString()


class _BidiStream:
    """One request's bidi stream to a model service: write a command, read its answer."""

    def __init__(self, call: grpc.aio.StreamStreamCall, service: str, step_timeout_s: float | None = None) -> None:
        self._call = call
        self._service = service
        self._step_timeout_s = step_timeout_s  # None: wait as long as the call's deadline allows
        self.forward_ns = 0  # the service's forward time over this stream's answers
        self.prefill_forward_ns = 0  # of forward_ns: the prefill's (the stream's first answer)

    async def ask(self, request):
        try:
            # asyncio.timeout, not wait_for: wait_for ran each step's exchange as a task of its own
            async with asyncio.timeout(self._step_timeout_s):
                await self._call.write(request)
                response = await self._call.read()
        except grpc.aio.AioRpcError as e:
            if not self._is_lost(e.code()):
                raise
            raise self._lost(f"{e.code().name}: {e.details()}") from e
        except TimeoutError as e:
            raise self._lost(f"no answer within {self._step_timeout_s} s", timed_out=True) from e
        except asyncio.InvalidStateError as e:  # the call ended between our last read and this write
            code, details = await self._call.code(), await self._call.details()
            if not self._is_lost(code):  # the deadline, say: the request's end, not the replica's
                raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details) from e
            raise self._lost(f"{code.name}: {details}") from e
        if response is grpc.aio.EOF:
            raise self._lost("the service closed the stream unexpectedly")
        self.forward_ns += response.forward_ns
        return response

    def _is_lost(self, code: grpc.StatusCode) -> bool:
        raise NotImplementedError

    def _lost(self, why: str, timed_out: bool = False) -> StreamLost:
        raise NotImplementedError

    async def close(self) -> None:
        """Ends the stream; the service frees the sequence's state."""
        self._call.cancel()


class TargetStream(_BidiStream):
    async def prefill(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams) -> int:
        command = target_pb2.PrefillCommand(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens,
                                            sampling=sampling_params_pb(sampling))
        response = await self.ask(target_pb2.TargetRequest(prefill=command))
        self.prefill_forward_ns += response.forward_ns
        return response.prefill.token_id

    async def verify(self, proposal: Proposal) -> Verified:
        return verified(await self.ask(verify_request(proposal)))

    def _is_lost(self, code: grpc.StatusCode) -> bool:
        return code in TARGET_LOST_CODES

    def _lost(self, why: str, timed_out: bool = False) -> StreamLost:
        return TargetLost(f"lost the target replica: {why}", timed_out)


class DraftStream(_BidiStream):
    def __init__(self, call: grpc.aio.StreamStreamCall, draft_model: str = "",
                 step_timeout_s: float | None = None) -> None:
        super().__init__(call, "draft", step_timeout_s)
        self._draft_model = draft_model

    async def start(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams) -> None:
        command = draft_pb2.StartCommand(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens,
                                         draft_model=self._draft_model, sampling=sampling_params_pb(sampling))
        response = await self.ask(draft_pb2.DraftRequest(start=command))
        self.prefill_forward_ns += response.forward_ns

    async def propose(self, num_accepted: int, append_ids: list[int], num_draft_tokens: int) -> Proposal:
        return proposed(await self.ask(propose_request(num_accepted, append_ids, num_draft_tokens)))

    def _is_lost(self, code: grpc.StatusCode) -> bool:
        return code not in DRAFT_REQUEST_ERRORS

    def _lost(self, why: str, timed_out: bool = False) -> StreamLost:
        return DraftLost(f"lost the draft: {why}", timed_out)


class RequestStreams:
    """Opens one request's streams (a new one after a loss) and closes them all at its end.

    Each stream carries the request id and the request's deadline, so the model services see the
    client's deadline too.
    """

    def __init__(self, backends: Backends, draft_model: str, use_draft: bool, timeout_s: float | None) -> None:
        self._backends = backends
        self._draft_model = draft_model
        self.use_draft = use_draft and backends.has_draft and not backends.draft_paused
        self.opens_draft_with_prefill = backends.opens_draft_with_prefill(draft_model)
        self.checks_draft_name = backends.is_unchecked_draft_name(draft_model)
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._opened: list[_BidiStream] = []

    @property
    def _timeout_s(self) -> float | None:
        """What is left of the client's deadline: a stream opened later (a re-prefill) gets no more."""
        return None if self._deadline is None else max(self._deadline - time.monotonic(), 0.0)

    def open_target(self) -> TargetStream:
        return self._remember(self._backends.open_target(self._timeout_s))

    async def wait_for_target(self) -> bool:
        return await self._backends.wait_for_target()

    def open_draft(self) -> DraftStream | None:
        """A new draft stream, or None when the request does not speculate."""
        if not self.use_draft:
            return None
        return self._remember(self._backends.open_draft(self._draft_model, self._timeout_s))

    def pause_draft(self) -> None:
        """This request's draft timed out: new requests leave the draft pool alone for a while."""
        self._backends.pause_draft()

    def draft_opened(self) -> None:
        """The draft service took this request's draft (its name is known there)."""
        self._backends.draft_opened(self._draft_model)

    def draft_not_found(self) -> None:
        """The draft service has no draft of this request's name (any more: unloaded)."""
        self._backends.draft_not_found(self._draft_model)

    def forward_ns(self, kind: type[_BidiStream]) -> int:
        return sum(s.forward_ns for s in self._opened if isinstance(s, kind))

    def prefill_forward_ns(self, kind: type[_BidiStream]) -> int:
        return sum(s.prefill_forward_ns for s in self._opened if isinstance(s, kind))

    async def close(self) -> None:
        """Ends every stream of the request; the services free its sequences."""
        for stream in self._opened:
            await stream.close()

    def _remember(self, stream):
        self._opened.append(stream)
        return stream


class Backends:
    """Channels to the target pool and (optionally) the draft pool, load-balanced by gRPC."""

    def __init__(self, target_address: str, draft_address: str | None, draft_step_timeout_s: float | None = None,
                 target_failover_timeout_s: float = 5.0, tls: ClientTls | None = None, draft_pause_s: float = 0.0,
                 draft_opens_with_prefill: bool = False) -> None:
        """`draft_step_timeout_s`: a draft that takes longer to answer is dropped from the request;
        `target_failover_timeout_s`: how long a request that lost its target replica waits for a
        connected one; `tls`: TLS (or mTLS) to both services; None: plaintext; `draft_pause_s`: after a
        draft timed out, new requests run target-only this long (a hung draft, still connected, would
        otherwise hold every request up by a step timeout; 0: never pause); `draft_opens_with_prefill`: a
        request's draft sequence opens beside its target prefill, else once the first token is in (a draft name
        no request has opened yet opens beside it either way: gateway/speculative_loop.py)."""
        self._addresses = {"target": target_address, "draft": draft_address}
        self._target_channel = open_channel(target_address, tls)
        self._target = target_pb2_grpc.TargetServiceStub(self._target_channel)
        self._draft_channel = open_channel(draft_address, tls) if draft_address else None
        self._draft = draft_pb2_grpc.DraftServiceStub(self._draft_channel) if self._draft_channel else None
        self._draft_step_timeout_s = draft_step_timeout_s
        self._target_failover_timeout_s = target_failover_timeout_s
        self._draft_pause_s = draft_pause_s
        self.draft_opens_with_prefill = draft_opens_with_prefill
        self._opened_drafts: set[str] = set()  # draft names requests have opened sequences of
        self._draft_paused_until = 0.0
        self.target_info: common_pb2.ModelInfo | None = None
        self.draft_info: common_pb2.ModelInfo | None = None

    @classmethod
    def for_config(cls, config: GatewayConfig) -> Backends:
        """The pools a gateway of `config` talks to, with its timeouts, pause and TLS."""
        return cls(config.target_address, config.draft_address, config.draft_step_timeout_s,
                   config.target_failover_timeout_s, config.backend_tls, config.draft_pause_s,
                   config.draft_opens_with_prefill)

    @property
    def has_draft(self) -> bool:
        return self._draft is not None

    @property
    def draft_paused(self) -> bool:
        return time.monotonic() < self._draft_paused_until

    def pause_draft(self) -> None:
        if self._draft_pause_s > 0 and not self.draft_paused:
            log.warning("a draft timed out: new requests run target-only for %g s", self._draft_pause_s)
            self._draft_paused_until = time.monotonic() + self._draft_pause_s

    def opens_draft_with_prefill(self, draft_model: str) -> bool:
        """Whether a request's draft prefills beside the target's prefill, not once the first token is in: as
        configured, or for a draft name no request has opened yet (`is_unchecked_draft_name`)."""
        return self.draft_opens_with_prefill or self.is_unchecked_draft_name(draft_model)

    def is_unchecked_draft_name(self, draft_model: str) -> bool:
        """A draft name no request has opened (or unknown to the draft service since): it may be unknown there,
        so its request's first token waits for the draft's start, and a NOT_FOUND comes before any token."""
        return bool(draft_model) and draft_model not in self._opened_drafts

    def draft_opened(self, draft_model: str) -> None:
        self._opened_drafts.add(draft_model)

    def draft_not_found(self, draft_model: str) -> None:
        """The name is unknown to the draft service (unloaded since requests opened it): its next request opens
        the draft beside the prefill again, so its NOT_FOUND comes before the first token."""
        self._opened_drafts.discard(draft_model)

    async def connect(self, timeout_s: float) -> PreTrainedTokenizerBase:
        """Waits for the services, checks they are compatible, returns the target's tokenizer."""
        service = "target"
        waiting = ", ".join(f"the {name} at {address}" for name, address in self._addresses.items() if address)
        log.info("waiting up to %g s for %s (a model service may still be loading its weights)", timeout_s, waiting)
        try:
            self.target_info = await self._target.GetModelInfo(
                common_pb2.ModelInfoRequest(), timeout=timeout_s, wait_for_ready=True)
            files = await self._target.GetTokenizer(common_pb2.TokenizerRequest(), timeout=timeout_s)
            if self._draft is not None:
                service = "draft"
                self.draft_info = await self._draft.GetModelInfo(
                    common_pb2.ModelInfoRequest(), timeout=timeout_s, wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            raise ServiceUnavailableError(
                f"cannot reach a model service: the {service} at {self._addresses[service]} did not answer within "
                f"{timeout_s:g} s ({e.code().name}: {e.details()})") from e
        log.info("connected: target %s%s", self.target_info.model_id,
                 f", draft {self.draft_info.model_id}" if self.draft_info is not None else "")
        if self.draft_info is not None:
            check_compatible(self.target_info, self.draft_info)
        return tokenizer_from_files(dict(files.files))

    async def wait_for_target(self) -> bool:
        """Whether some target replica is connected, or becomes so within the failover timeout
        (a restarted replica is reconnected within the channel's reconnect backoff)."""
        channel = self._target_channel
        try:
            async with asyncio.timeout(self._target_failover_timeout_s):
                while (state := channel.get_state(try_to_connect=True)) != grpc.ChannelConnectivity.READY:
                    await channel.wait_for_state_change(state)
        except TimeoutError:
            return False
        return True

    def open_target(self, timeout_s: float | None = None) -> TargetStream:
        """A stream for the current request (its request id travels in the metadata); gRPC's
        round-robin puts it on a ready replica."""
        call = self._target.Sequence(metadata=request_id_metadata(), timeout=timeout_s)
        return TargetStream(call, "target")

    def open_draft(self, draft_model: str = "", timeout_s: float | None = None) -> DraftStream:
        """A stream to the named draft ("" for the draft service's default), as open_target."""
        assert self._draft is not None
        call = self._draft.Sequence(metadata=request_id_metadata(), timeout=timeout_s)
        return DraftStream(call, draft_model, self._draft_step_timeout_s)

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
