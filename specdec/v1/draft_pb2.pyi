from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftRequest(_message.Message):
    __slots__ = ("start", "propose")
    START_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    start: StartCommand
    propose: ProposeCommand
    def __init__(self, start: _Optional[_Union[StartCommand, _Mapping]] = ..., propose: _Optional[_Union[ProposeCommand, _Mapping]] = ...) -> None: ...

class StartCommand(_message.Message):
    __slots__ = ("prompt_ids", "max_new_tokens")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("draft_ids",)
    DRAFT_IDS_FIELD_NUMBER: _ClassVar[int]
    draft_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, draft_ids: _Optional[_Iterable[int]] = ...) -> None: ...
