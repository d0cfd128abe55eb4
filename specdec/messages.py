"""Protobuf conversions shared by the model services."""
from __future__ import annotations

from engine.model_runner import ModelDescription
from engine.sampling import SamplingParams
from specdec.v1 import common_pb2


def model_info_pb(description: ModelDescription) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        model_id=description.model_id,
        vocab_size=description.vocab_size,
        tokenizer_fingerprint=description.tokenizer_fingerprint,
        max_model_len=description.max_model_len,
        eos_token_ids=description.eos_token_ids,
        architecture=description.architecture,
        device=description.device,
    )


def sampling_params(pb: common_pb2.SamplingParams) -> SamplingParams:
    """The message as checked SamplingParams (an unset message is greedy)."""
    return SamplingParams(temperature=pb.temperature, top_p=pb.top_p or 1.0, top_k=pb.top_k, min_p=pb.min_p,
                          seed=pb.seed).check()


def sampling_params_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                     min_p=params.min_p, seed=params.seed)


def distributions(pbs) -> list[tuple[list[int], list[float]]]:
    return [(list(d.token_ids), list(d.probs)) for d in pbs]


def distributions_pb(dists: list[tuple[list[int], list[float]]]) -> list[common_pb2.TokenDistribution]:
    return [common_pb2.TokenDistribution(token_ids=ids, probs=probs) for ids, probs in dists]
