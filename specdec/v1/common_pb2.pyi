from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "vocab_size", "tokenizer_fingerprint", "max_model_len", "eos_token_ids", "architecture", "device")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    vocab_size: int
    tokenizer_fingerprint: str
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    architecture: str
    device: str
    def __init__(self, model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., architecture: _Optional[str] = ..., device: _Optional[str] = ...) -> None: ...

class TokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerFiles(_message.Message):
    __slots__ = ("files", "tokenizer_fingerprint")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    FILES_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    files: _containers.ScalarMap[str, bytes]
    tokenizer_fingerprint: str
    def __init__(self, files: _Optional[_Mapping[str, bytes]] = ..., tokenizer_fingerprint: _Optional[str] = ...) -> None: ...

class EngineStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("num_active_sequences", "num_kv_blocks_used", "num_kv_blocks_total", "kv_block_size", "num_forwards", "num_sequence_steps", "num_sequences_started", "num_waiting_sequences", "num_ahead_hits", "num_ahead_misses")
    NUM_ACTIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_STARTED_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_AHEAD_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_AHEAD_MISSES_FIELD_NUMBER: _ClassVar[int]
    num_active_sequences: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    kv_block_size: int
    num_forwards: int
    num_sequence_steps: int
    num_sequences_started: int
    num_waiting_sequences: int
    num_ahead_hits: int
    num_ahead_misses: int
    def __init__(self, num_active_sequences: _Optional[int] = ..., num_kv_blocks_used: _Optional[int] = ..., num_kv_blocks_total: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., num_forwards: _Optional[int] = ..., num_sequence_steps: _Optional[int] = ..., num_sequences_started: _Optional[int] = ..., num_waiting_sequences: _Optional[int] = ..., num_ahead_hits: _Optional[int] = ..., num_ahead_misses: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class TokenDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...
