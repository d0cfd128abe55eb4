"""Protobuf conversions shared by the model services."""
from __future__ import annotations

from engine.model_runner import ModelDescription
from specdec.v1 import common_pb2


def model_info_pb(description: ModelDescription) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        model_id=description.model_id,
        vocab_size=description.vocab_size,
        tokenizer_fingerprint=description.tokenizer_fingerprint,
        max_model_len=description.max_model_len,
        eos_token_ids=description.eos_token_ids,
        architecture=description.architecture,
    )
