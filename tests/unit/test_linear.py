"""The CPU few-row linear form computes what F.linear computes, for every row count and with bias."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.linear import (
    CpuLinear,
    Int8Linear,
    dequantize_int8,
    int8_activations,
    linear,
    quantize_int8,
    quantize_rows_reference,
    use_cpu_linear,
)
from engine.model_runner import RuntimeConfig


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 64, 65, 200])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 48, generator=gen), torch.randn(80, 48, generator=gen)
    b = torch.randn(80, generator=gen) if with_bias else None
    out = linear(x, w, b)
    assert out.shape == (rows, 80) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_use_cpu_linear_swaps_nested_linears_and_shares_their_weights():
    model = nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.ReLU(), nn.Linear(16, 4, bias=False)))
    inputs = [torch.randn(rows, 8) for rows in (1, 3, 80)]  # the transposed copy, the transposed product, F.linear
    expected = [model(x) for x in inputs]
    weight = model[1][1].weight
    use_cpu_linear(model)
    assert isinstance(model[0], CpuLinear) and isinstance(model[1][1], CpuLinear)
    assert model[1][1].weight is weight
    for x, out in zip(inputs, expected):
        torch.testing.assert_close(model(x), out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 48), (3, 48), (2, 5, 48), (0, 48)])
def test_int8_linear_is_the_product_with_its_rounded_weights(shape):
    gen = torch.Generator().manual_seed(0)
    layer = nn.Linear(48, 80, bias=True)
    x = torch.randn(*shape, generator=gen)
    quantized = Int8Linear(layer)
    weight = quantized.qweight.float() * quantized.scale.float()[:, None]
    assert (weight - layer.weight).abs().max() <= layer.weight.abs().max() / 127  # half a step, per row
    expected = F.linear(x.bfloat16().float(), weight, layer.bias)
    torch.testing.assert_close(quantized(x), expected, rtol=2e-2, atol=2e-2)  # products in bfloat16
    assert quantized(x).shape == (*shape[:-1], 80) and quantized(x).dtype == x.dtype


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_dequantized_weights_are_each_product_rounded_once_to_the_dtype(device, dtype):
    """The eager products' weights (prefill chunks under kernel or eager stages) are the float32 route's bits:
    int8 times its row's bfloat16 scale, exact in float32, rounded once; scales of every magnitude."""
    gen = torch.Generator().manual_seed(2)
    qweight = torch.randint(-128, 128, (64, 96), generator=gen, dtype=torch.int8)
    qweight[0] = torch.tensor([-128, 127, 1, -1] * 24, dtype=torch.int8)
    scale = (torch.rand(64, generator=gen) * 10.0 ** torch.randint(-12, 3, (64,), generator=gen)).bfloat16()
    qweight, scale = qweight.to(device), scale.to(device)
    expected = (qweight.double() * scale.double()[:, None]).to(dtype)  # exact, then one rounding
    out = dequantize_int8(qweight, scale, dtype)
    assert out.dtype == dtype and torch.equal(out, expected)
    assert torch.equal(out, (qweight.float() * scale.float()[:, None]).to(dtype))


@pytest.mark.parametrize("shape", [(1, 48), (3, 48), (2, 5, 48)])
def test_a_w8a8_linear_outside_the_fused_kernels_multiplies_its_inputs_int8_rows(shape):
    """--quantize w8a8 in eager forwards (prefill chunks, CPU): each input row rounded to its int8 values
    times its scale, then the weight-only product; the rounding is engine.linear.quantize_rows_reference's."""
    gen = torch.Generator().manual_seed(1)
    layer = nn.Linear(48, 80, bias=True)
    x = torch.randn(*shape, generator=gen)
    x[..., 3] = 30.0  # an outlier: the other values lose precision
    w8a8, weight_only = Int8Linear(layer, int8_activations=True), Int8Linear(layer)
    q, scales = quantize_rows_reference(x.reshape(-1, 48))
    assert q.dtype == torch.int8 and q.abs().amax(dim=1).eq(127).all()
    rounded = (q.float() * scales[:, None]).view(x.shape)
    assert not torch.equal(rounded, x)
    assert torch.equal(w8a8(x), weight_only(rounded))
    assert int8_activations(w8a8) and not int8_activations(weight_only) and not int8_activations(layer)


def test_quantize_int8_with_int8_activations_takes_every_linear():
    model = nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.ReLU(), nn.Linear(16, 4)))
    quantize_int8(model, int8_activations=True)
    assert int8_activations(model[0]) and int8_activations(model[1][1])
    assert RuntimeConfig(model="m", device="cuda", quantize="w8a8").quantize == "w8a8"


def test_quantize_int8_swaps_plain_and_cpu_linears():
    model = nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.ReLU(), CpuLinear(nn.Linear(16, 4, bias=False))))
    quantize_int8(model)
    assert isinstance(model[0], Int8Linear) and isinstance(model[1][1], Int8Linear)


def test_quantize_int8_keeps_products_narrower_than_asked_in_their_own_dtype():
    """On CUDA only wide products take int8 (engine/linear.CUDA_MIN_INT8_OUT_FEATURES)."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.ReLU(), nn.Linear(16, 4)))
    quantize_int8(model, min_out_features=16)
    assert isinstance(model[0], Int8Linear) and isinstance(model[1][1], nn.Linear)


@pytest.mark.parametrize("layer_kernels", ["auto", "fused", "reference"])
def test_int8_drafts_run_on_gpus_with_any_layer_kernels(layer_kernels):
    assert RuntimeConfig(model="m", device="cuda", quantize="int8", layer_kernels=layer_kernels).quantize == "int8"
    with pytest.raises(ValueError, match="quantize must be"):
        RuntimeConfig(model="m", quantize="int4")
