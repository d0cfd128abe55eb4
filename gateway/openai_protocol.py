"""The OpenAI request bodies we accept, and their mapping onto a GenerateRequest.

Validation of what both front doors share (lengths, k, stop strings, temperature) stays in
gateway/request.py; here only what is particular to OpenAI's shapes is checked. Extra fields
beyond OpenAI's: `num_draft_tokens` (k per step, 0 = no speculation) and `draft_model`.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specdec.errors import InvalidRequestError
from specdec.v1 import gateway_pb2

ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role
INT32_MAX = 2**31 - 1  # the GenerateRequest fields these map onto are 32-bit

Int32 = Annotated[int, Field(le=INT32_MAX)]
Finite = Annotated[float, Field(allow_inf_nan=False)]


def _check_text(value: Any, where: str = "") -> None:
    """Every string of the body must be encodable as UTF-8: JSON lets a lone surrogate (\\ud800) through."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where or 'the body'} holds invalid Unicode (a lone UTF-16 surrogate escape); "
                             "send well-formed text") from None
    elif isinstance(value, dict | list):
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            _check_text(key, where)  # before its name is used
            _check_text(item, f"{where}.{key}".lstrip("."))


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown fields are ignored, as vLLM does

    model: str
    max_tokens: Int32 | None = Field(default=None, ge=1)
    temperature: Finite | None = Field(default=None, ge=0, le=2)  # unset: 0 (greedy decoding, unlike OpenAI's 1)
    top_p: Finite | None = Field(default=None, gt=0, le=1)
    top_k: Int32 | None = Field(default=None, ge=0)  # beyond OpenAI's fields, as vLLM accepts
    min_p: Finite | None = Field(default=None, ge=0, lt=1)  # beyond OpenAI's fields
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(default=None, ge=0, lt=1 << 64)
    presence_penalty: Finite = 0.0
    frequency_penalty: Finite = 0.0
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None
    num_draft_tokens: Int32 | None = None
    draft_model: str | None = None
    ignore_eos: bool = False  # beyond OpenAI's fields, as vLLM accepts

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_unset(cls, data: Any) -> Any:
        """OpenAI's fields are nullable: an explicit null means the default, as clients (LangChain,
        LiteLLM) send them. And no string may carry a lone surrogate (protobuf could not encode it)."""
        if isinstance(data, dict):
            _check_text(data)
            data = {key: value for key, value in data.items() if value is not None}
        return data

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_supported(self) -> None:
        """What we would otherwise silently ignore, though the client relies on it, is refused."""
        if self.n != 1:
            raise InvalidRequestError(f"n must be 1 (one choice per request), got {self.n}")
        if self.presence_penalty or self.frequency_penalty:
            raise InvalidRequestError("presence_penalty and frequency_penalty are not supported; leave them at 0")
        if self.logit_bias:
            raise InvalidRequestError("logit_bias is not supported; leave it out")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise InvalidRequestError(f"response_format {self.response_format.get('type')!r} is not supported "
                                      "(no constrained decoding); leave it out or use {'type': 'text'}")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed with stream: true")

    def generate_request(self) -> gateway_pb2.GenerateRequest:
        """The common fields; callers set the input."""
        self.check_supported()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        request = gateway_pb2.GenerateRequest(stop=stop, temperature=self.temperature or 0.0,
                                              ignore_eos=self.ignore_eos)
        if self.max_tokens is not None:
            request.max_new_tokens = self.max_tokens
        if self.num_draft_tokens is not None:
            request.num_draft_tokens = self.num_draft_tokens
        if self.draft_model is not None:
            request.draft_model = self.draft_model
        for name in ("top_p", "top_k", "min_p", "seed"):
            if getattr(self, name) is not None:
                setattr(request, name, getattr(self, name))
        return request


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def to_generate_request(self) -> gateway_pb2.GenerateRequest:
        if self.echo or self.logprobs is not None or self.suffix is not None or self.best_of not in (None, 1):
            raise InvalidRequestError("echo, logprobs, suffix and best_of are not supported; leave them out")
        request = self.generate_request()
        request.prompt = self._prompt_text()
        return request

    def _prompt_text(self) -> str:
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return prompt[0]
        if all(isinstance(p, str) for p in prompt):
            raise InvalidRequestError(f"one prompt per request, got {len(prompt)}; send them as separate requests")
        raise InvalidRequestError("token-id prompts are not supported; send the prompt as text")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: str
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: Int32 | None = Field(default=None, ge=1)  # the newer name of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    functions: list[dict] | None = None  # the older name of tools
    function_call: str | dict | None = None

    def to_generate_request(self) -> gateway_pb2.GenerateRequest:
        if self.logprobs or self.top_logprobs:
            raise InvalidRequestError("logprobs and top_logprobs are not supported; leave them out")
        if self.tools or self.functions or self.tool_choice not in (None, "none") or \
                self.function_call not in (None, "none"):
            raise InvalidRequestError("tools and functions (tool_choice, function_call) are not supported; "
                                      "leave them out")
        request = self.generate_request()
        if self.max_completion_tokens is not None:
            request.max_new_tokens = self.max_completion_tokens
        for message in self.messages:
            request.chat.messages.add(role=ROLE_ALIASES.get(message.role, message.role), content=message.text())
        if not self.messages:
            request.chat.SetInParent()  # so the gateway says "no messages" rather than "no input"
        return request
