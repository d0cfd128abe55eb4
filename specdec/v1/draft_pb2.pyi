from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadDraftRequest(_message.Message):
    __slots__ = ("name", "model", "make_default", "expected_tokenizer_fingerprint", "replace")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAKE_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    name: str
    model: str
    make_default: bool
    expected_tokenizer_fingerprint: str
    replace: bool
    def __init__(self, name: _Optional[str] = ..., model: _Optional[str] = ..., make_default: _Optional[bool] = ..., expected_tokenizer_fingerprint: _Optional[str] = ..., replace: _Optional[bool] = ...) -> None: ...

class DraftEntry(_message.Message):
    __slots__ = ("name", "info", "is_default")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    name: str
    info: _common_pb2.ModelInfo
    is_default: bool
    def __init__(self, name: _Optional[str] = ..., info: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ..., is_default: _Optional[bool] = ...) -> None: ...

class LoadDraftResponse(_message.Message):
    __slots__ = ("loaded", "load_s")
    LOADED_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    loaded: DraftEntry
    load_s: float
    def __init__(self, loaded: _Optional[_Union[DraftEntry, _Mapping]] = ..., load_s: _Optional[float] = ...) -> None: ...

class UnloadDraftRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class SetDefaultDraftRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListDraftsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDraftsResponse(_message.Message):
    __slots__ = ("drafts",)
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    drafts: _containers.RepeatedCompositeFieldContainer[DraftEntry]
    def __init__(self, drafts: _Optional[_Iterable[_Union[DraftEntry, _Mapping]]] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("start", "propose")
    START_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    start: StartCommand
    propose: ProposeCommand
    def __init__(self, start: _Optional[_Union[StartCommand, _Mapping]] = ..., propose: _Optional[_Union[ProposeCommand, _Mapping]] = ...) -> None: ...

class StartCommand(_message.Message):
    __slots__ = ("prompt_ids", "max_new_tokens", "draft_model", "sampling")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    draft_model: str
    sampling: _common_pb2.SamplingParams
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., draft_model: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class ProposeCommand(_message.Message):
    __slots__ = ("num_accepted_draft_tokens", "append_ids", "num_draft_tokens")
    NUM_ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    APPEND_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_accepted_draft_tokens: int
    append_ids: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: int
    def __init__(self, num_accepted_draft_tokens: _Optional[int] = ..., append_ids: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("started", "proposal", "forward_ns")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    started: StartResult
    proposal: ProposeResult
    forward_ns: int
    def __init__(self, started: _Optional[_Union[StartResult, _Mapping]] = ..., proposal: _Optional[_Union[ProposeResult, _Mapping]] = ..., forward_ns: _Optional[int] = ...) -> None: ...

class StartResult(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProposeResult(_message.Message):
    __slots__ = ("draft_ids", "draft_probs")
    DRAFT_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    draft_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenDistribution]
    def __init__(self, draft_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[_common_pb2.TokenDistribution, _Mapping]]] = ...) -> None: ...
