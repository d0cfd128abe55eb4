"""The kernel stages (engine/kernel_stages.py: Triton norms and rotary around the products) compute what
the PyTorch stages compute: a prefill's logits and the K/V it writes, then a decode after it; and the fused
kernels fall back to them. Under TRITON_INTERPRET=1 on CPU (float32), compiled on the GPU (bf16)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from engine.batch import StepInput, build_forward_batch
from engine.kernel_stages import KernelStages
from engine.kv_cache import KVCacheConfig, KVPool
from engine.llama import CausalLM, LayerStages

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
TOLERANCE = dict(atol=2e-2, rtol=2e-2) if DTYPE == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)


def _model() -> CausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=256)
    return CausalLM(AutoModelForCausalLM.from_config(config, dtype=DTYPE).to(DEVICE).eval(), 256)


def _prefill_then_decode(model: CausalLM, prompt: list[int], next_token: int) -> tuple[torch.Tensor, KVPool]:
    """Every prompt row's logits, then the decode's: [len(prompt) + 1, vocab]; and the pool they wrote."""
    shape = model.shape
    kv = KVPool(KVCacheConfig(16, 4), shape.num_layers, shape.num_kv_heads, shape.head_dim, DTYPE, torch.device(DEVICE))
    seq = kv.new_sequence()
    logits = []
    for tokens in (prompt, [next_token]):
        seq.reserve(len(tokens))
        step = StepInput(seq, tokens, len(tokens))
        logits.append(model(build_forward_batch([step], torch.device(DEVICE)), kv))
        seq.commit(len(tokens))
    return torch.cat(logits), kv


@pytest.mark.parametrize("prompt_len", [1, 7, 21])  # within a block, across blocks
def test_a_prefill_and_decode_through_the_kernel_stages_compute_the_pytorch_stages_logits_and_kv(prompt_len):
    model = _model()
    prompt = torch.randint(3, 500, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    expected, expected_kv = _prefill_then_decode(model, prompt, 9)
    model.use_kernel_stages()
    got, got_kv = _prefill_then_decode(model, prompt, 9)
    torch.testing.assert_close(got, expected, **TOLERANCE)
    for ours, theirs in zip(got_kv.k + got_kv.v, expected_kv.k + expected_kv.v):
        torch.testing.assert_close(ours, theirs, **TOLERANCE)


def test_the_same_prompt_through_the_kernel_stages_is_the_same_bits_every_time():
    model = _model()
    model.use_kernel_stages()
    first, _ = _prefill_then_decode(model, list(range(10, 30)), 9)
    again, _ = _prefill_then_decode(model, list(range(10, 30)), 9)
    assert torch.equal(first, again)


def test_the_fused_kernels_fall_back_to_the_kernel_stages():
    model = _model()
    model.use_kernel_stages()
    kernel_stages = model.stages
    model.use_fused_kernels(max_rows=None)
    assert isinstance(kernel_stages, KernelStages) and model.stages.fused_kernels
    with model.fallback_stages():
        assert model.stages is kernel_stages
    assert model.stages.fused_kernels
    model.stages = LayerStages()  # no fused kernels: nothing to fall back from
    with model.fallback_stages():
        assert type(model.stages) is LayerStages
