"""The fused MLP kernel (engine/triton_mlp.py) equals the chain's two products: fp32 under
TRITON_INTERPRET=1 on CPU, bf16 on the GPU."""
from __future__ import annotations

import pytest
import torch

from engine.linear import Int8Linear
from engine.triton_linear import skinny_linear_reference, split_counters
from engine.triton_mlp import fused_mlp

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(hidden: int, inter: int, dtype: torch.dtype, int8: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.nn.Linear(hidden, 2 * inter, bias=False)
    down = torch.nn.Linear(inter, hidden, bias=False)
    gate_up.weight.data = (torch.randn(2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    down.weight.data = (torch.randn(hidden, inter, generator=gen) / inter**0.5).to(dtype)
    gate_up, down = gate_up.to(DEVICE), down.to(DEVICE)
    if not int8:
        return (gate_up.weight, None), (down.weight, None)
    gu, dn = Int8Linear(gate_up), Int8Linear(down)
    return (gu.qweight, gu.scale), (dn.qweight, dn.scale)


def _chain(x, residual, gate_up, down):
    """The two products as engine/fused_stages.py runs them (the PyTorch form of the skinny kernel)."""
    act = skinny_linear_reference(x, gate_up[0], scale=gate_up[1], silu_mul=True)
    return skinny_linear_reference(act, down[0], scale=down[1], residual=residual)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("int8", [False, True])
def test_fused_mlp_matches_the_two_products_fp32(rows, int8):
    """96 intermediate columns: 6 programs of 16 in groups of 4, so the last group has 2 members."""
    hidden, inter = 64, 96
    gate_up, down = _weights(hidden, inter, torch.float32, int8)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=gen).to(DEVICE)
    residual = torch.randn(rows, hidden, generator=gen).to(DEVICE)
    counters = split_counters(torch.device(DEVICE))
    actual = fused_mlp(x, gate_up[0], gate_up[1], down[0].t().contiguous(), down[1], residual, counters, group=4)
    torch.testing.assert_close(actual, _chain(x, residual, gate_up, down), atol=1e-5, rtol=1e-5)
    assert not counters.any(), "every counter is zeroed for the next launch"
    again = fused_mlp(x, gate_up[0], gate_up[1], down[0].t().contiguous(), down[1], residual, counters, group=4)
    assert torch.equal(actual, again)


def test_a_row_gets_the_same_bits_alone_and_among_others():
    hidden, inter = 64, 96
    gate_up, down = _weights(hidden, inter, torch.float32, int8=True)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, hidden, generator=gen).to(DEVICE)
    residual = torch.randn(4, hidden, generator=gen).to(DEVICE)
    counters = split_counters(torch.device(DEVICE))
    down_t = down[0].t().contiguous()
    together = fused_mlp(x, gate_up[0], gate_up[1], down_t, down[1], residual, counters)
    alone = fused_mlp(x[2:3], gate_up[0], gate_up[1], down_t, down[1], residual[2:3], counters)
    assert torch.equal(together[2:3], alone)


def test_too_many_rows_are_refused():
    gate_up, down = _weights(64, 96, torch.float32, int8=False)
    with pytest.raises(AssertionError, match="rows"):
        fused_mlp(torch.zeros(5, 64, device=DEVICE), gate_up[0], None, down[0].t().contiguous(), None,
                  torch.zeros(5, 64, device=DEVICE), split_counters(torch.device(DEVICE)))


@pytest.mark.gpu
@pytest.mark.parametrize("int8", [False, True])
def test_fused_mlp_bf16_on_the_gpu_llama_1b_shape(int8):
    """Llama-3.2-1B's MLP (2048 -> 8192 -> 2048) in bf16: close to the chain, the same bits every launch."""
    hidden, inter = 2048, 8192
    gate_up, down = _weights(hidden, inter, torch.bfloat16, int8)
    x = torch.randn(2, hidden, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(2, hidden, device="cuda", dtype=torch.bfloat16)
    counters = split_counters(torch.device("cuda"))
    down_t = down[0].t().contiguous()
    first = fused_mlp(x, gate_up[0], gate_up[1], down_t, down[1], residual, counters)
    expected = _chain(x.float(), residual.float(), (gate_up[0].float() if gate_up[1] is None else gate_up[0],
                                                    gate_up[1]), (down[0].float() if down[1] is None else down[0],
                                                                  down[1]))
    torch.testing.assert_close(first.float(), expected, atol=3e-2, rtol=3e-2)
    for _ in range(20):
        assert torch.equal(fused_mlp(x, gate_up[0], gate_up[1], down_t, down[1], residual, counters), first)
    assert not counters.any()
