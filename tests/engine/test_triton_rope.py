"""The Triton rotary + KV-write kernel equals its PyTorch reference: fp32 under TRITON_INTERPRET=1 on
CPU, bf16 on the GPU."""
from __future__ import annotations

import pytest
import torch

from engine.llama import ModelShape
from engine.triton_rope import rope_and_write_kv, rope_and_write_kv_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _run(fn, shape: ModelShape, num_tokens: int, dtype: torch.dtype):
    torch.manual_seed(num_tokens)
    width = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    qkv = torch.randn(num_tokens, width, device=DEVICE).to(dtype)
    angles = torch.rand(num_tokens, shape.head_dim // 2, device=DEVICE) * 6
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(dtype)
    k_cache = torch.zeros(8, 4, shape.num_kv_heads, shape.head_dim, device=DEVICE, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(32, device=DEVICE)[:num_tokens]
    q = fn(qkv, cos, sin, k_cache, v_cache, slots, shape)
    return q, k_cache, v_cache


@pytest.mark.parametrize("shape", [
    ModelShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=0),
    ModelShape(num_layers=1, num_heads=6, num_kv_heads=2, head_dim=48, vocab_size=0),  # not a power of 2
    ModelShape(num_layers=1, num_heads=3, num_kv_heads=3, head_dim=8, vocab_size=0),
])
@pytest.mark.parametrize("num_tokens", [1, 5, 13])
def test_kernel_matches_reference(shape, num_tokens):
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    got = _run(rope_and_write_kv, shape, num_tokens, dtype)
    expected = _run(rope_and_write_kv_reference, shape, num_tokens, dtype)
    tolerance = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-6, rtol=1e-6)
    for a, b in zip(got, expected):  # queries, K cache (written slots only; the rest stays zero), V cache
        torch.testing.assert_close(a.float(), b.float(), **tolerance)
