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
    num_blocks = 8 + sum(-(-ctx // block_size) for _, ctx in sequences)
    pool = KVPool(KVCacheConfig(num_blocks=num_blocks, block_size=block_size), 1, num_kv_heads, head_dim, dtype,
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
@pytest.mark.parametrize(("split_len", "programs_per_tile"), [(16, 1), (32, 2), (1024, 1), (None, 3)])
def test_kernel_matches_reference_fp32(num_heads, num_kv_heads, head_dim, block_size, split_len, programs_per_tile):
    """Interpreted on CPU (CI); compiled, in exact fp32 ("ieee" dots), on a GPU. 16-key ranges give
    the longest context 4 of them, some of a verify's queries see none of a range's keys, and two
    programs per tile take the ranges in turn; 1024 keys is one range, written without a combine; None
    cuts each tile's keys into a range per program (3), some of them empty for short contexts."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k_cache, v_cache, batch = _batch_and_inputs(num_heads, num_kv_heads, head_dim, block_size, device,
                                                   torch.float32)
    expected = paged_attention_reference(q, k_cache, v_cache, batch, head_dim**-0.5)
    actual = paged_attention_triton(q, k_cache, v_cache, batch, head_dim**-0.5, block_n=16, split_len=split_len,
                                    programs_per_tile=programs_per_tile)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_a_decode_token_gets_the_same_bits_in_any_batch():
    """Key ranges are fixed by position, so neither the batch around a sequence (here a longer
    neighbour widens the block table, so more ranges could exist) nor the programs sharing its ranges
    change a single bit of its attention. (The neighbour's 300 keys are 19 ranges: more than the
    combine loads at once.)"""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    alone = _batch_and_inputs(4, 2, 32, 16, device, torch.float32, [(1, 40)])
    crowd = _batch_and_inputs(4, 2, 32, 16, device, torch.float32, [(1, 40), (1, 300), (1, 3)])
    q_alone, k_alone, v_alone, batch_alone = alone
    q_crowd, k_crowd, v_crowd, batch_crowd = crowd
    q_crowd[0] = q_alone[0]
    _copy_first_sequence(k_alone, v_alone, batch_alone, k_crowd, v_crowd, batch_crowd)
    expected = paged_attention_triton(q_alone, k_alone, v_alone, batch_alone, 0.2, block_n=16, split_len=16)
    reference = paged_attention_reference(q_crowd, k_crowd, v_crowd, batch_crowd, 0.2)
    for programs in (1, 3):
        actual = paged_attention_triton(q_crowd, k_crowd, v_crowd, batch_crowd, 0.2, block_n=16, split_len=16,
                                        programs_per_tile=programs)
        assert torch.equal(actual[0], expected[0])
        torch.testing.assert_close(actual, reference, atol=1e-5, rtol=1e-5)  # 19 ranges: two combine loads


def _copy_first_sequence(k_src, v_src, batch_src, k_dst, v_dst, batch_dst) -> None:
    """The first sequence of batch_dst gets the K/V of batch_src's first (as far as both reach)."""
    num_keys = min(int(batch_src.context_lens[0]), int(batch_dst.context_lens[0]))
    num_blocks = -(-num_keys // k_src.shape[1])
    src, dst = batch_src.block_tables[0, :num_blocks].long(), batch_dst.block_tables[0, :num_blocks].long()
    k_dst[dst], v_dst[dst] = k_src[src], v_src[src]


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
    for split_len, programs in ((None, None), (None, 1), (128, None), (128, 1), (1024, None), (256, 2)):
        actual = paged_attention_triton(q, k_cache, v_cache, batch, head_dim**-0.5, split_len=split_len,
                                        programs_per_tile=programs)
        torch.testing.assert_close(actual.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_a_token_gets_the_same_bf16_bits_in_a_decode_and_in_a_verify():
    """The token at position 300 (three 128-key ranges) alone as a decode, and third of five in a
    verify beside other sequences: bit-equal in bf16, the property that keeps speculative output
    equal to target-only output."""
    decode = _batch_and_inputs(32, 8, 128, 16, "cuda", torch.bfloat16, [(1, 301)])
    verify = _batch_and_inputs(32, 8, 128, 16, "cuda", torch.bfloat16, [(5, 303), (5, 900), (1, 50)])
    q_decode, k_decode, v_decode, batch_decode = decode
    q_verify, k_verify, v_verify, batch_verify = verify
    _copy_first_sequence(k_decode, v_decode, batch_decode, k_verify, v_verify, batch_verify)
    q_verify[2] = q_decode[0]
    expected = paged_attention_triton(q_decode, k_decode, v_decode, batch_decode, 128**-0.5, split_len=128)
    actual = paged_attention_triton(q_verify, k_verify, v_verify, batch_verify, 128**-0.5, split_len=128)
    assert torch.equal(actual[2], expected[0])
