"""Drives one generation for any front door (gRPC Generate, the OpenAI HTTP API): validates the
request, opens the model streams, runs the speculative loop, turns committed tokens into text,
and records the request's statistics and metrics."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, nullcontext
from dataclasses import dataclass

import grpc
from transformers import PreTrainedTokenizerBase

from gateway.admission import RequestAdmission
from gateway.backends import Backends, DraftStream, RequestStreams, TargetStream
from gateway.config import GatewayConfig
from gateway.metrics import (
    OUTCOME_CANCELLED,
    OUTCOME_ERROR,
    OUTCOME_INVALID,
    OUTCOME_REJECTED,
    OUTCOME_UNAVAILABLE,
    GatewayMetrics,
)
from gateway.output import CompletionOutput, Finish
from gateway.read_ahead import read_ahead
from gateway.request import GenerationParams, parse_request
from gateway.speculation_policy import SpeculationHistory, SpeculationPolicy
from gateway.speculative_loop import speculative_generate
from gateway.stats import RequestStats
from specdec.busy_poll import BusyPoll
from specdec.errors import CapacityError, InvalidRequestError, NotFoundError, ServiceUnavailableError
from specdec.request_id import current_request_id
from specdec.v1 import gateway_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Delta:
    """Newly committed tokens and text; the last delta of a generation carries finish and stats."""

    token_ids: list[int]
    text: str
    finish: Finish | None = None
    stats: RequestStats | None = None
    num_completion_tokens: int = 0


MAX_DRAFT_HISTORIES = 64
TOKENIZE_INLINE_CHARS = 16_384  # longer inputs are tokenized off the event loop (~8 ms a 16 KB prompt)
CHAT_MESSAGE_CHARS = 32  # what a chat template adds around each message, about
MAX_LONG_INPUTS = 8  # long inputs tokenizing or queued to; more are refused (RESOURCE_EXHAUSTED)


class Driver:
    def __init__(self, config: GatewayConfig, backends: Backends, tokenizer: PreTrainedTokenizerBase,
                 metrics: GatewayMetrics, busy_poll: BusyPoll | None = None) -> None:
        """`busy_poll`: held for each generation, gRPC and HTTP alike (specdec/busy_poll.py)."""
        self._config = config
        self._busy_poll = busy_poll
        self._backends = backends
        self.tokenizer = tokenizer
        self.metrics = metrics
        # the target's context bounds a request; a draft with a shorter one leaves longer requests target-only
        self.max_model_len = backends.target_info.max_model_len
        self._eos_token_ids = list(backends.target_info.eos_token_ids)
        self._admission = RequestAdmission(config.max_concurrent_requests, config.max_queued_requests)
        # per (draft name, greedy?): what its requests measured (greedy and sampled requests accept differently)
        self._histories: dict[tuple[str, bool], SpeculationHistory] = {}
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="tokenize")  # one long input at a time
        self._num_long_inputs = 0  # tokenizing or waiting to

    async def prepare(self, request: gateway_pb2.GenerateRequest, api: str) -> GenerationParams:
        """Validates and tokenizes; raises InvalidRequestError with a message for the client. A long input
        is tokenized on a thread of its own (the tokenizer lets go of the GIL), so the event loop keeps
        serving every other request and stream meanwhile: a 4 MB prompt takes ~2 s to tokenize."""
        try:
            if _input_chars(request) > TOKENIZE_INLINE_CHARS:
                params = await self._tokenize_apart(request)
            else:
                params = parse_request(request, self.tokenizer, self._config, self.max_model_len)
            _check_limits(params, self._config)
            return params
        except InvalidRequestError:
            self.metrics.requests.labels(api, OUTCOME_INVALID).inc()
            raise
        except CapacityError:
            self.metrics.requests.labels(api, OUTCOME_REJECTED).inc()
            raise

    async def _tokenize_apart(self, request: gateway_pb2.GenerateRequest) -> GenerationParams:
        """parse_request on the tokenizing thread; at most MAX_LONG_INPUTS wait for it (each holds its text)."""
        if self._num_long_inputs >= MAX_LONG_INPUTS:
            raise CapacityError(f"{self._num_long_inputs} long prompts are being tokenized; retry with backoff")
        self._num_long_inputs += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._tokenizing, parse_request, request, self.tokenizer, self._config, self.max_model_len)
        finally:
            self._num_long_inputs -= 1

    async def generate(self, params: GenerationParams, api: str, timeout_s: float | None = None) -> AsyncIterator[Delta]:
        """Streams the completion once the request is admitted (CapacityError when the gateway's
        queue is full); iterate it inside `contextlib.aclosing` so an early stop frees the model
        streams at once. `timeout_s`: the client's remaining deadline, passed on to the model streams."""
        # from receipt: the time waiting for a slot counts in the waiting gauge and the time to first token
        stats = RequestStats(num_prompt_tokens=len(params.prompt_ids), request_id=current_request_id())
        polling = self._busy_poll.held() if self._busy_poll is not None else nullcontext()
        self.metrics.waiting.inc()
        admitted = False
        try:
            with polling:
                async with self._admission.slot():
                    admitted = True
                    async with aclosing(self._generate(params, api, timeout_s, stats)) as deltas:
                        async for delta in deltas:
                            yield delta
        except (CapacityError, asyncio.CancelledError, GeneratorExit) as e:
            if not admitted:  # refused, or gone while queued (an admitted request counts its own outcome)
                outcome = OUTCOME_REJECTED if isinstance(e, CapacityError) else OUTCOME_CANCELLED
                self.metrics.requests.labels(api, outcome).inc()
            raise
        finally:
            if not admitted:
                self.metrics.waiting.dec()

    async def _generate(self, params: GenerationParams, api: str, timeout_s: float | None, stats: RequestStats
                        ) -> AsyncIterator[Delta]:
        """`stats`: the request's, from its receipt; it is counted in the waiting gauge already."""
        output = CompletionOutput(self.tokenizer, params.prompt_ids, params.max_new_tokens, params.stop,
                                  [] if params.ignore_eos else self._eos_token_ids)
        streams = RequestStreams(self._backends, params.draft_model, params.num_draft_tokens > 0, timeout_s)
        outcome = OUTCOME_ERROR
        gauge = self.metrics.waiting
        try:
            policy = self._policy(params) if params.adaptive else None
            # read ahead: the next step's model round trips overlap this one's detokenizing and streaming
            steps = read_ahead(speculative_generate(params.prompt_ids, params.max_new_tokens, params.num_draft_tokens,
                                                    streams, self._config.max_target_retries, params.sampling,
                                                    policy))
            async with aclosing(steps):
                async for step in steps:
                    if stats.first_token_s is None:
                        gauge.dec()
                        gauge = self.metrics.running
                        gauge.inc()
                    else:
                        self.metrics.record_step(step.num_draft_tokens, step.num_accepted)
                    stats.record_step(len(step.committed_ids), step.num_draft_tokens, step.num_accepted,
                                      is_prefill=stats.first_token_s is None)
                    chunk = output.add(step.committed_ids)
                    if chunk.token_ids or chunk.text:
                        yield Delta(chunk.token_ids, chunk.text)
                    if chunk.finish is not None:
                        break
            outcome = output.finish.value if output.finish else OUTCOME_ERROR
        except (asyncio.CancelledError, GeneratorExit):
            outcome = OUTCOME_CANCELLED
            raise
        except Exception as e:
            outcome = _outcome_of(e)
            raise
        finally:  # ending the streams frees the sequences on both model services
            gauge.dec()
            await streams.close()
            self.metrics.requests.labels(api, outcome).inc()
        stats.target_forward_ns = streams.forward_ns(TargetStream)
        stats.draft_forward_ns = streams.forward_ns(DraftStream)
        stats.target_prefill_forward_ns = streams.prefill_forward_ns(TargetStream)
        stats.draft_prefill_forward_ns = streams.prefill_forward_ns(DraftStream)
        self._record(stats, output.num_tokens)
        yield Delta([], "", output.finish, stats, output.num_tokens)

    def _policy(self, params: GenerationParams) -> SpeculationPolicy:
        """An adaptive request's policy: it starts from what its draft's requests measured and shares
        their probe schedule (a draft that loses is probed rarely over all of them)."""
        history = self._history((params.draft_model, params.sampling.is_greedy))
        return SpeculationPolicy(params.num_draft_tokens, history=history, probes=history.probes)

    def _history(self, key: tuple[str, bool]) -> SpeculationHistory:
        """The shared estimates of a draft's greedy or sampled requests; at most MAX_DRAFT_HISTORIES
        (clients choose the names, unknown ones included), the least recently created dropped first."""
        history = self._histories.get(key)
        if history is None:
            if len(self._histories) >= MAX_DRAFT_HISTORIES:
                del self._histories[next(iter(self._histories))]
            history = self._histories[key] = SpeculationHistory()
        return history

    def _record(self, stats: RequestStats, num_completion_tokens: int) -> None:
        self.metrics.ttft.observe(stats.time_to_first_token_s)
        self.metrics.record_finished(stats, num_completion_tokens)
        log.info("finished: %d prompt + %d completion tokens, %d/%d draft tokens accepted, %.1f tok/s",
                 stats.num_prompt_tokens, num_completion_tokens, stats.num_accepted_tokens,
                 stats.num_draft_tokens, stats.tokens_per_s(num_completion_tokens))


def warn_stalled_client(stall_timeout_s: float) -> None:
    """Either front door's log line for a request ended because its client took none of its stream for the
    stall timeout (the generation is closed by then, its model sequences freed)."""
    log.warning("the client stopped reading its stream for %g s: request cancelled", stall_timeout_s)


def _input_chars(request: gateway_pb2.GenerateRequest) -> int:
    """About the text the tokenizer will see: the prompt, or the chat's messages with their template."""
    return len(request.prompt) + sum(len(message.content) + CHAT_MESSAGE_CHARS for message in request.chat.messages)


def _check_limits(params: GenerationParams, config: GatewayConfig) -> None:
    """The gateway's own limits, stricter than the model's context where configured."""
    if config.max_prompt_tokens is not None and len(params.prompt_ids) > config.max_prompt_tokens:
        raise InvalidRequestError(f"the prompt is {len(params.prompt_ids)} tokens; this gateway accepts at most "
                                  f"{config.max_prompt_tokens}. Shorten the prompt.")
    if config.max_new_tokens_limit is not None and params.max_new_tokens > config.max_new_tokens_limit:
        raise InvalidRequestError(f"max_new_tokens is {params.max_new_tokens}; this gateway allows at most "
                                  f"{config.max_new_tokens_limit}")


def _outcome_of(error: Exception) -> str:
    """The outcome label of a failed request: whose doing it was, as its status says."""
    if isinstance(error, InvalidRequestError | NotFoundError):
        return OUTCOME_INVALID
    if isinstance(error, ServiceUnavailableError):
        return OUTCOME_UNAVAILABLE
    if isinstance(error, grpc.aio.AioRpcError):  # a model service's status, passed through
        return {grpc.StatusCode.UNAVAILABLE: OUTCOME_UNAVAILABLE, grpc.StatusCode.NOT_FOUND: OUTCOME_INVALID,
                grpc.StatusCode.INVALID_ARGUMENT: OUTCOME_INVALID,
                # the client's deadline, as the model streams that carry it saw it end: the client's doing
                grpc.StatusCode.DEADLINE_EXCEEDED: OUTCOME_CANCELLED,
                grpc.StatusCode.RESOURCE_EXHAUSTED: OUTCOME_REJECTED}.get(error.code(), OUTCOME_ERROR)
    return OUTCOME_ERROR
