"""int4 weights (engine/linear.Int4Linear): the packing round-trips, and the Triton product of the packed
bytes equals the product of the dequantized weights: fp32 under TRITON_INTERPRET=1 on CPU, bf16 (both
unpackings) on the GPU; a row's result does not depend on the other rows."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.linear import Int4Linear, dequantize_int4, quantize_int4
from engine.llama import silu_mul_interleaved
from engine.triton_int4 import Int4Config, int4_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = Int4Config(block_n=16, num_warps=4, num_stages=2)


def _quantized(n: int, k: int, group: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(n + k + group)
    return quantize_int4((torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype), group)


def test_quantizing_dequantized_weights_gives_back_the_same_bytes_and_scales():
    qweight, scale = _quantized(32, 128, 32, torch.float32)
    again = quantize_int4(dequantize_int4(qweight, scale, torch.float32), 32)
    assert torch.equal(again[0], qweight) and torch.equal(again[1], scale)


def test_each_weight_is_its_group_scale_times_a_nibble_value_in_minus_8_to_7():
    weight = torch.tensor([[7.0, -8.0, 3.5, 0.0] * 4, [1.0, 2.0, 3.0, 4.0] * 4])
    qweight, scale = quantize_int4(weight, 8)
    assert qweight.shape == (2, 8) and scale.shape == (2, 2)
    assert torch.equal(scale[0], torch.tensor([8 / 7, 8 / 7]))
    q = (dequantize_int4(qweight, scale, torch.float32) / scale.repeat_interleave(8, dim=1)).round()
    assert q.min() >= -8 and q.max() <= 7
    assert torch.allclose(dequantize_int4(qweight, scale, torch.float32)[1], weight[1], atol=4 / 7 / 2 + 1e-6)


def test_a_k_that_does_not_split_into_whole_groups_per_half_is_refused():
    with pytest.raises(ValueError, match="must divide each half of K"):
        quantize_int4(torch.randn(4, 96), 32)


# (rows, N, K, group): decode, a verify, a full row tile, two row tiles, N off the strips; several groups a half
SHAPES = [(1, 32, 128, 32), (5, 48, 256, 64), (16, 32, 128, 16), (19, 64, 512, 32), (2, 40, 64, 16)]


@pytest.mark.parametrize(("rows", "n", "k", "group"), SHAPES)
@pytest.mark.parametrize("silu_mul", [False, True])
def test_the_kernel_gives_the_product_of_the_dequantized_weights(rows, n, k, group, silu_mul):
    qweight, scale = _quantized(n, k, group, torch.float32)
    x = torch.randn(rows, k, device=DEVICE)
    expected = x @ dequantize_int4(qweight, scale, torch.float32).T
    expected = silu_mul_interleaved(expected) if silu_mul else expected
    torch.testing.assert_close(int4_linear(x, qweight, scale, silu_mul=silu_mul, config=SMALL), expected,
                               atol=1e-5, rtol=1e-5)


def test_int4_linear_module_multiplies_its_dequantized_weight():
    layer = nn.Linear(64, 32, bias=True)
    quantized = Int4Linear(layer, group=16)
    x = torch.randn(3, 64)
    weight = dequantize_int4(quantized.qweight, quantized.scale, torch.float32)
    torch.testing.assert_close(quantized(x), x @ weight.T + layer.bias, atol=1e-5, rtol=1e-5)
    assert (weight - layer.weight).abs().max() <= quantized.scale.max() / 2 + 1e-6  # rounded to nearest


def test_weights_of_another_k_are_refused_before_launch():
    qweight, scale = _quantized(32, 128, 32, torch.float32)
    with pytest.raises(AssertionError, match="for x"):
        int4_linear(torch.randn(1, 64, device=DEVICE), qweight, scale, config=SMALL)
    with pytest.raises(AssertionError, match="scale"):
        int4_linear(torch.randn(1, 128, device=DEVICE), qweight, scale[:, :3], config=SMALL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("magic", [False, True])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_bf16_rows_match_the_dequantized_product_and_do_not_depend_on_the_batch(magic, silu_mul):
    qweight, scale = _quantized(16384, 2048, 128, torch.bfloat16)
    x = torch.randn(16, 2048, device=DEVICE, dtype=torch.bfloat16)
    config = Int4Config(block_n=32, num_warps=4, num_stages=4, magic=magic)
    out = int4_linear(x, qweight, scale, silu_mul=silu_mul, config=config)
    expected = x.float() @ dequantize_int4(qweight, scale, torch.float32).T
    expected = silu_mul_interleaved(expected.to(torch.bfloat16).float()) if silu_mul else expected
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    for rows in (1, 5):
        assert torch.equal(int4_linear(x[:rows], qweight, scale, silu_mul=silu_mul, config=config), out[:rows])
