"""The runtime on CUDA: our model over paged KV matches HF on the same device and dtype."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.batch import StepInput
from engine.model_runner import ModelRunner, RuntimeConfig

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-3), ("bfloat16", 6e-2)])
def test_cuda_logits_match_hf(dtype, tol, model_dirs):
    path = model_dirs["target"]
    runner = ModelRunner(RuntimeConfig(model=str(path), device="cuda", dtype=dtype, kv_cache_tokens=512))
    ids = list(range(3, 60))
    kv = runner.kv.new_sequence()
    runner.forward([StepInput(kv, ids[:50], num_logits=1)])
    [logits] = runner.forward([StepInput(kv, ids[50:], num_logits=len(ids) - 50)])  # a verify-shaped step
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to("cuda").eval()
    with torch.no_grad():
        expected = hf(torch.tensor([ids], device="cuda")).logits[0, 50:].float()
    torch.testing.assert_close(logits, expected, atol=tol, rtol=tol)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
