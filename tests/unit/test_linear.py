"""The CPU few-row linear form computes what F.linear computes, for every row count and with bias."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.linear import CpuLinear, linear, use_cpu_linear


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
