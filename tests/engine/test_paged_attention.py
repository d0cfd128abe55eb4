"""The Triton paged-attention kernel equals the PyTorch reference over a grid of shapes:
fp32 under TRITON_INTERPRET=1 on CPU, bf16 on the GPU."""
from __future__ import annotations

import pytest
import torch

from engine.attention import paged_attention_reference
from engine.batch import StepInput, build_forward_batch
from engine.kv_cache import KVCacheConfig, KVPool
from engine.triton_attention import paged_attention_triton

# (new tokens, context length after the step): decode, verify k=4, a prefill chunk after earlier
# context, a whole prompt crossing several blocks, a verify right at a block boundary
SEQUENCES = [(1, 37), (5, 21), (19, 50), (33, 33), (3, 32)]


def _batch_and_inputs(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                      device: str, dtype: torch.dtype, sequences=SEQUENCES):
    torch.manual_seed(0)
    pool = KVPool(KVCacheConfig(num_blocks=64, block_size=block_size), 1, num_kv_heads, head_dim, dtype,
                  torch.device(device))
    pool.k[0].normal_()
    pool.v[0].normal_()
    kvs = [pool.new_sequence() for _ in sequences]
    for step in range(max(ctx for _, ctx in sequences)):  # interleave blocks of different sequences
        for kv, (_, ctx) in zip(kvs, sequences):
            if step < ctx and kv.blocks_needed(1):
                kv.reserve(1)
            if step < ctx:
                kv.commit(1)
    for kv, (num_q, ctx) in zip(kvs, sequences):
        kv.truncate(ctx - num_q)
        kv.reserve(num_q)
    steps = [StepInput(kv, [0] * num_q, num_logits=0) for kv, (num_q, _) in zip(kvs, sequences)]
    batch = build_forward_batch(steps, torch.device(device))
    q = torch.randn(batch.cu_seqlens_q[-1], num_heads, head_dim, dtype=dtype, device=device)
    return q, pool.k[0], pool.v[0], batch


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(4, 4, 32, 16), (6, 2, 64, 16), (8, 2, 32, 32), (3, 1, 48, 16)],
)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kernel_matches_reference_fp32(num_heads, num_kv_heads, head_dim, block_size, num_splits):
    """Interpreted on CPU (CI); compiled, in exact fp32 ("ieee" dots), on a GPU. With 3 key splits
    some splits of short sequences see no key at all."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k_cache, v_cache, batch = _batch_and_inputs(num_heads, num_kv_heads, head_dim, block_size, device,
                                                   torch.float32)
    expected = paged_attention_reference(q, k_cache, v_cache, batch, head_dim**-0.5)
    actual = paged_attention_triton(q, k_cache, v_cache, batch, head_dim**-0.5, block_n=16, num_splits=num_splits)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_small_pages_are_gathered_into_full_tiles():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k_cache, v_cache, batch = _batch_and_inputs(4, 2, 32, 8, device, torch.float32, [(1, 9), (5, 70), (12, 12)])
    expected = paged_attention_reference(q, k_cache, v_cache, batch, 0.2)
    torch.testing.assert_close(paged_attention_triton(q, k_cache, v_cache, batch, 0.2), expected, atol=1e-5, rtol=1e-5)


def test_wrapper_rejects_mismatched_dtypes():
    q, k_cache, v_cache, batch = _batch_and_inputs(4, 2, 32, 16, "cpu", torch.float32, [(1, 9)])
    with pytest.raises(AssertionError, match="share a dtype"):
        paged_attention_triton(q.double(), k_cache, v_cache, batch, 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(32, 8, 128, 16), (9, 3, 64, 16), (14, 2, 64, 32), (8, 8, 128, 64)],
)
def test_kernel_matches_reference_bf16_cuda(num_heads, num_kv_heads, head_dim, block_size):
    q, k_cache, v_cache, batch = _batch_and_inputs(num_heads, num_kv_heads, head_dim, block_size, "cuda",
                                                   torch.bfloat16)
    expected = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), batch, head_dim**-0.5)
    for num_splits in (None, 1, 4):  # the default picks enough splits to fill the GPU
        actual = paged_attention_triton(q, k_cache, v_cache, batch, head_dim**-0.5, num_splits=num_splits)
        torch.testing.assert_close(actual.float(), expected, atol=2e-2, rtol=2e-2)
