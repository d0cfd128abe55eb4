"""Gateway.Generate: validate, run the speculative loop, stream tokens and text."""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc
from transformers import PreTrainedTokenizerBase

from gateway.backends import Backends
from gateway.config import GatewayConfig
from gateway.output import CompletionOutput, Finish
from gateway.request import parse_request
from gateway.speculative_loop import speculative_generate
from gateway.stats import RequestStats
from specdec.v1 import gateway_pb2, gateway_pb2_grpc

FINISH_REASON_PB = {
    Finish.LENGTH: gateway_pb2.FINISH_REASON_LENGTH,
    Finish.EOS: gateway_pb2.FINISH_REASON_EOS,
    Finish.STOP: gateway_pb2.FINISH_REASON_STOP,
}


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, config: GatewayConfig, backends: Backends, tokenizer: PreTrainedTokenizerBase) -> None:
        self._config = config
        self._backends = backends
        self._tokenizer = tokenizer
        lengths = [info.max_model_len for info in (backends.target_info, backends.draft_info) if info]
        self._max_model_len = min(lengths)
        self._eos_token_ids = list(backends.target_info.eos_token_ids)

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        params = parse_request(request, self._tokenizer, self._config, self._max_model_len)
        stats = RequestStats(num_prompt_tokens=len(params.prompt_ids))
        output = CompletionOutput(self._tokenizer, params.prompt_ids, params.max_new_tokens, params.stop,
                                  self._eos_token_ids)
        target = self._backends.open_target()
        use_draft = params.num_draft_tokens > 0 and self._backends.has_draft
        draft = self._backends.open_draft(params.draft_model) if use_draft else None
        try:
            steps = speculative_generate(params.prompt_ids, params.max_new_tokens, params.num_draft_tokens,
                                         target, draft)
            async with aclosing(steps):
                async for step in steps:
                    stats.record_step(len(step.committed_ids), step.num_draft_tokens, step.num_accepted,
                                      is_prefill=stats.first_token_s is None)
                    chunk = output.add(step.committed_ids)
                    if chunk.token_ids or chunk.text:
                        yield gateway_pb2.GenerateResponse(token_ids=chunk.token_ids, text=chunk.text)
                    if chunk.finish is not None:
                        break
        finally:  # ending the streams frees the sequences on both model services
            await target.close()
            if draft is not None:
                await draft.close()
        yield gateway_pb2.GenerateResponse(
            finish_reason=FINISH_REASON_PB[output.finish], stats=stats.to_pb(output.num_tokens)
        )
