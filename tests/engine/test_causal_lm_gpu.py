"""The runtime on CUDA (Triton attention, compiled layer stages, CUDA graphs) against HF."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.batch import StepInput
from engine.model_runner import ModelRunner, RuntimeConfig

pytestmark = pytest.mark.gpu


def _our_logits(path, dtype: str, ids: list[int]) -> torch.Tensor:
    runner = ModelRunner(RuntimeConfig(model=str(path), device="cuda", dtype=dtype, kv_cache_tokens=512))
    kv = runner.kv.new_sequence()
    runner.forward([StepInput(kv, ids[:50], num_logits=1)])
    [logits] = runner.forward([StepInput(kv, ids[50:], num_logits=len(ids) - 50)])  # a verify-shaped step
    return logits.float()


def _hf_logits(path, dtype: torch.dtype, ids: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()
    with torch.no_grad():
        return hf(torch.tensor([ids], device="cuda")).logits[0, 50:].float()


def test_cuda_float32_logits_match_hf(model_dirs):
    ids = list(range(3, 60))
    ours, expected = _our_logits(model_dirs["target"], "float32", ids), _hf_logits(model_dirs["target"], torch.float32, ids)
    torch.testing.assert_close(ours, expected, atol=1e-3, rtol=1e-3)
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def test_cuda_bfloat16_is_as_accurate_as_hf_bfloat16(model_dirs):
    """Against float32 ground truth, our bf16 error is within HF bf16's own error (+ slack):
    fused kernels round differently, so bit-equality with HF bf16 is not the bar."""
    ids = list(range(3, 60))
    truth = _hf_logits(model_dirs["target"], torch.float32, ids)
    ours_error = (_our_logits(model_dirs["target"], "bfloat16", ids) - truth).abs().max().item()
    hf_error = (_hf_logits(model_dirs["target"], torch.bfloat16, ids) - truth).abs().max().item()
    assert ours_error <= 2 * hf_error + 1e-2, (ours_error, hf_error)
