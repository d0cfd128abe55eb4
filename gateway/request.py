"""Validates a GenerateRequest and turns it into token ids and generation parameters."""
from __future__ import annotations

import secrets
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from engine.sampling import SamplingParams
from gateway.config import GatewayConfig
from specdec.errors import InvalidRequestError
from specdec.v1 import gateway_pb2

CHAT_ROLES = ("system", "user", "assistant")
MAX_CHAT_MESSAGES = 4096  # a chat template renders each: 500 000 empty ones held the loop for 20 s
MAX_DRAFT_NAME_CHARS = 64  # as the draft service's names (draft_service/registry.py)


@dataclass(frozen=True)
class GenerationParams:
    prompt_ids: list[int]
    max_new_tokens: int
    num_draft_tokens: int  # 0: speculation off; adaptive: the most k may grow to
    stop: list[str]
    draft_model: str = ""  # a draft loaded on the draft service; "": its default
    sampling: SamplingParams = SamplingParams()  # greedy unless the request sets a temperature
    adaptive: bool = False  # k chosen per step (gateway/speculation_policy.py) instead of fixed
    ignore_eos: bool = False  # end-of-sequence tokens are ordinary output; only length or a stop string ends it


def parse_request(
    request: gateway_pb2.GenerateRequest,
    tokenizer: PreTrainedTokenizerBase,
    config: GatewayConfig,
    max_model_len: int,
) -> GenerationParams:
    sampling = _sampling(request)
    prompt_ids = _tokenize(request, tokenizer)
    max_new = request.max_new_tokens if request.HasField("max_new_tokens") else config.default_max_new_tokens
    if max_new < 1:
        raise InvalidRequestError(f"max_new_tokens must be >= 1, got {max_new}")
    if len(prompt_ids) >= max_model_len:
        raise InvalidRequestError(
            f"the prompt is {len(prompt_ids)} tokens; the model's context is {max_model_len} tokens. "
            "Shorten the prompt."
        )
    if len(prompt_ids) + max_new > max_model_len:
        if request.HasField("max_new_tokens"):
            raise InvalidRequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new}) exceeds the model's context "
                f"of {max_model_len} tokens; ask for at most {max_model_len - len(prompt_ids)} new tokens"
            )
        max_new = max_model_len - len(prompt_ids)  # the default shrinks to fit
    k = request.num_draft_tokens if request.HasField("num_draft_tokens") else config.default_num_draft_tokens
    if not 0 <= k <= config.max_num_draft_tokens:
        raise InvalidRequestError(
            f"num_draft_tokens must be in [0, {config.max_num_draft_tokens}] (0 turns speculation off), got {k}"
        )
    draft_model = request.draft_model if request.HasField("draft_model") else ""
    if len(draft_model) > MAX_DRAFT_NAME_CHARS:
        raise InvalidRequestError(f"draft_model names are at most {MAX_DRAFT_NAME_CHARS} characters")
    # a sampled request's draws depend on what the draft proposed, so a seeded one keeps k fixed: the
    # policy's choices follow measured timings, which would make its output vary from run to run
    seeded = not sampling.is_greedy and request.HasField("seed")
    adaptive = config.adaptive_num_draft_tokens and not request.HasField("num_draft_tokens") and not seeded
    return GenerationParams(prompt_ids, max_new, k, _check_stop(list(request.stop), config), draft_model, sampling,
                            adaptive, request.ignore_eos)


def _sampling(request: gateway_pb2.GenerateRequest) -> SamplingParams:
    """The request's sampling; an unset seed gets a random one (each request is still reproducible inside)."""
    field = lambda name, default: getattr(request, name) if request.HasField(name) else default  # noqa: E731
    return SamplingParams(temperature=request.temperature, top_p=field("top_p", 1.0), top_k=field("top_k", 0),
                          min_p=field("min_p", 0.0), seed=field("seed", secrets.randbits(63))).check()


def _tokenize(request: gateway_pb2.GenerateRequest, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    kind = request.WhichOneof("input")
    if kind == "prompt":
        if not request.prompt:
            raise InvalidRequestError("prompt is empty; send some text")
        return list(tokenizer.encode(request.prompt))
    if kind == "chat":
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        if not messages:
            raise InvalidRequestError("chat has no messages; send at least one")
        if len(messages) > MAX_CHAT_MESSAGES:
            raise InvalidRequestError(f"chat has {len(messages)} messages; at most {MAX_CHAT_MESSAGES}")
        bad = [m["role"] for m in messages if m["role"] not in CHAT_ROLES]
        if bad:
            raise InvalidRequestError(f"unknown chat role {bad[0]!r}; use one of {', '.join(CHAT_ROLES)}")
        if tokenizer.chat_template is None:
            raise InvalidRequestError("the target model has no chat template; send a plain prompt instead")
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    raise InvalidRequestError("the request has no input; set prompt or chat")


def _check_stop(stop: list[str], config: GatewayConfig) -> list[str]:
    if len(stop) > config.max_stop_strings:
        raise InvalidRequestError(f"at most {config.max_stop_strings} stop strings, got {len(stop)}")
    if any(not s or len(s) > config.max_stop_string_chars for s in stop):
        raise InvalidRequestError(f"stop strings must be 1 to {config.max_stop_string_chars} characters long")
    return stop
