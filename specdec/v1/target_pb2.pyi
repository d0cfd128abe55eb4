from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TargetRequest(_message.Message):
    __slots__ = ("prefill", "verify")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    prefill: PrefillCommand
    verify: VerifyCommand
    def __init__(self, prefill: _Optional[_Union[PrefillCommand, _Mapping]] = ..., verify: _Optional[_Union[VerifyCommand, _Mapping]] = ...) -> None: ...

class PrefillCommand(_message.Message):
    __slots__ = ("prompt_ids", "max_new_tokens", "sampling")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    sampling: _common_pb2.SamplingParams
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class VerifyCommand(_message.Message):
    __slots__ = ("draft_ids", "draft_probs")
    DRAFT_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    draft_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenDistribution]
    def __init__(self, draft_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[_common_pb2.TokenDistribution, _Mapping]]] = ...) -> None: ...

class TargetResponse(_message.Message):
    __slots__ = ("prefill", "verify", "forward_ns", "batch_size")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    prefill: PrefillResult
    verify: VerifyResult
    forward_ns: int
    batch_size: int
    def __init__(self, prefill: _Optional[_Union[PrefillResult, _Mapping]] = ..., verify: _Optional[_Union[VerifyResult, _Mapping]] = ..., forward_ns: _Optional[int] = ..., batch_size: _Optional[int] = ...) -> None: ...

class PrefillResult(_message.Message):
    __slots__ = ("token_id",)
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    def __init__(self, token_id: _Optional[int] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("num_accepted_draft_tokens", "committed_ids")
    NUM_ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_IDS_FIELD_NUMBER: _ClassVar[int]
    num_accepted_draft_tokens: int
    committed_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_accepted_draft_tokens: _Optional[int] = ..., committed_ids: _Optional[_Iterable[int]] = ...) -> None: ...
