from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "chat", "max_new_tokens", "stop", "num_draft_tokens", "temperature", "draft_model", "top_p", "top_k", "min_p", "seed", "ignore_eos")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    chat: ChatMessages
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    num_draft_tokens: int
    temperature: float
    draft_model: str
    top_p: float
    top_k: int
    min_p: float
    seed: int
    ignore_eos: bool
    def __init__(self, prompt: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., num_draft_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., draft_model: _Optional[str] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("num_prompt_tokens", "num_completion_tokens", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate", "num_verify_steps", "mean_accepted_len", "time_to_first_token_s", "tokens_per_s", "draft_forward_s", "target_forward_s", "time_per_output_token_s", "num_accepted_tokens_per_pos", "request_id", "num_steps_by_k", "draft_prefill_forward_s", "target_prefill_forward_s")
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    NUM_VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LEN_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    TARGET_FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    TIME_PER_OUTPUT_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_BY_K_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PREFILL_FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    TARGET_PREFILL_FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    num_prompt_tokens: int
    num_completion_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_rate: float
    num_verify_steps: int
    mean_accepted_len: float
    time_to_first_token_s: float
    tokens_per_s: float
    draft_forward_s: float
    target_forward_s: float
    time_per_output_token_s: float
    num_accepted_tokens_per_pos: _containers.RepeatedScalarFieldContainer[int]
    request_id: str
    num_steps_by_k: _containers.RepeatedScalarFieldContainer[int]
    draft_prefill_forward_s: float
    target_prefill_forward_s: float
    def __init__(self, num_prompt_tokens: _Optional[int] = ..., num_completion_tokens: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., num_verify_steps: _Optional[int] = ..., mean_accepted_len: _Optional[float] = ..., time_to_first_token_s: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., draft_forward_s: _Optional[float] = ..., target_forward_s: _Optional[float] = ..., time_per_output_token_s: _Optional[float] = ..., num_accepted_tokens_per_pos: _Optional[_Iterable[int]] = ..., request_id: _Optional[str] = ..., num_steps_by_k: _Optional[_Iterable[int]] = ..., draft_prefill_forward_s: _Optional[float] = ..., target_prefill_forward_s: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "stats")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    stats: GenerationStats
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ...) -> None: ...
