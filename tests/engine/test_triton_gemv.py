"""The one-row-a-program products of quantized weights (engine/triton_gemv.py) equal the products of
their dequantized weights (fp32 under TRITON_INTERPRET=1 on CPU, bf16 on the GPU), and a row's
result is the same bits whatever the other rows."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.linear import Int8Linear, dequantize_int4, dequantize_int8, quantize_int4
from engine.llama import silu_mul_interleaved
from engine.triton_gemv import GemvConfig, gemv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = GemvConfig(block_n=16, block_k=16, num_warps=4, num_stages=2)


def _weights(kind: str, n: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight, scale, dequantized float32 weight) of a random [n, k] linear."""
    torch.manual_seed(n + k)
    weight = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    if kind == "int4":
        qweight, scale = quantize_int4(weight, 32)
        return qweight, scale, dequantize_int4(qweight, scale, torch.float32)
    layer = Int8Linear(SimpleNamespace(weight=weight, bias=None))
    return layer.qweight, layer.scale, dequantize_int8(layer.qweight, layer.scale, torch.float32)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 32, 128), (3, 48, 64), (2, 40, 128)])  # N off the strips last
@pytest.mark.parametrize("silu_mul", [False, True])
def test_the_product_of_quantized_weights_is_that_of_their_dequantized_weights(kind, rows, n, k, silu_mul):
    weight, scale, dequantized = _weights(kind, n, k, torch.float32)
    x = torch.randn(rows, k, device=DEVICE)
    expected = x @ dequantized.T
    expected = silu_mul_interleaved(expected) if silu_mul else expected
    torch.testing.assert_close(gemv(x, weight, scale, silu_mul=silu_mul, config=SMALL), expected, atol=1e-5, rtol=1e-5)


def test_a_k_step_that_does_not_divide_a_group_is_refused_before_launch():
    weight, scale, _ = _weights("int4", 32, 128, torch.float32)
    with pytest.raises(AssertionError, match="must divide"):
        gemv(torch.randn(1, 128, device=DEVICE), weight, scale, config=GemvConfig(16, 64, 4, 2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_bf16_rows_match_the_dequantized_product_and_do_not_depend_on_the_batch(kind, silu_mul):
    weight, scale, dequantized = _weights(kind, 16384, 2048, torch.bfloat16)
    x = torch.randn(8, 2048, device=DEVICE, dtype=torch.bfloat16)
    out = gemv(x, weight, scale, silu_mul=silu_mul)
    expected = x.float() @ dequantized.T
    expected = silu_mul_interleaved(expected.to(torch.bfloat16).float()) if silu_mul else expected
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    for rows in (1, 3):
        assert torch.equal(gemv(x[:rows], weight, scale, silu_mul=silu_mul), out[:rows])
