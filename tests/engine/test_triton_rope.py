"""The Triton rotary + KV-write kernel equals its PyTorch reference, and the QKV product with both in
its epilogue equals the two kernels: fp32 under TRITON_INTERPRET=1 on CPU, bf16 on the GPU."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.linear import Int8Linear, quantize_rows_reference
from engine.llama import ModelShape
from engine.triton_linear import skinny_linear
from engine.triton_rope import (
    qkv_rope_and_write_kv,
    qkv_rope_block_n,
    qkv_rope_config,
    rope_and_write_kv,
    rope_and_write_kv_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[2]


def _tables(num_tokens: int, head_dim: int, dtype: torch.dtype):
    """Cos/sin tables of 40 positions (as the model's, halves repeated) and each token's position in them."""
    angles = torch.rand(40, head_dim // 2, device=DEVICE) * 6
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(dtype)
    return cos, sin, torch.randint(0, 40, (num_tokens,), device=DEVICE)


def _run(fn, shape: ModelShape, num_tokens: int, dtype: torch.dtype):
    torch.manual_seed(num_tokens)
    width = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    qkv = torch.randn(num_tokens, width, device=DEVICE).to(dtype)
    cos, sin, positions = _tables(num_tokens, shape.head_dim, dtype)
    k_cache = torch.zeros(8, 4, shape.num_kv_heads, shape.head_dim, device=DEVICE, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(32, device=DEVICE)[:num_tokens]
    q = fn(qkv, cos, sin, positions, k_cache, v_cache, slots, shape)
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


FUSED_SHAPES = [  # (shape, hidden): K masked (64 of a 128 block) and even (256)
    (ModelShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=0), 64),
    (ModelShape(num_layers=1, num_heads=6, num_kv_heads=2, head_dim=48, vocab_size=0), 64),  # 3 strips a head
    (ModelShape(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32, vocab_size=0), 256),
]


def _fused_inputs(shape: ModelShape, hidden: int, num_tokens: int, dtype: torch.dtype, bias: bool, int8: bool,
                  num_slots: int = 32):
    torch.manual_seed(num_tokens + hidden)
    n = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    x = torch.randn(num_tokens, hidden, device=DEVICE).to(dtype)
    weight = (torch.randn(n, hidden, device=DEVICE) / hidden**0.5).to(dtype)
    scale = None
    if int8:  # int8 rows and their scales (engine/linear.Int8Linear)
        quantized = Int8Linear(SimpleNamespace(weight=weight, bias=None))
        weight, scale = quantized.qweight, quantized.scale
    b = torch.randn(n, device=DEVICE).to(dtype) if bias else None
    slots = torch.randperm(num_slots, device=DEVICE)[:num_tokens]
    return x, weight, b, scale, _tables(num_tokens, shape.head_dim, dtype), slots


def _caches(shape: ModelShape, dtype: torch.dtype, num_slots: int = 32):
    k_cache = torch.zeros(num_slots // 4, 4, shape.num_kv_heads, shape.head_dim, device=DEVICE, dtype=dtype)
    return k_cache, torch.zeros_like(k_cache)


@pytest.mark.parametrize(("shape", "hidden"), FUSED_SHAPES)
@pytest.mark.parametrize("num_tokens", [1, 5, 17])
@pytest.mark.parametrize(("bias", "int8"), [(False, False), (True, False), (False, True)])
def test_the_qkv_product_with_rotary_in_its_epilogue_equals_the_product_then_the_rope_kernel(
        shape, hidden, num_tokens, bias, int8):
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x, weight, b, scale, tables, slots = _fused_inputs(shape, hidden, num_tokens, dtype, bias, int8)
    k_fused, v_fused = _caches(shape, dtype)
    q_fused = qkv_rope_and_write_kv(x, weight, b, *tables, k_fused, v_fused, slots, shape, scale=scale)
    k_two, v_two = _caches(shape, dtype)
    # the product at the fused kernel's configuration (on CPU the interpreter's dot rounds another tile
    # shape apart; on the GPU every configuration gives the same bits: test_triton_linear.py)
    qkv = skinny_linear(x, weight, b, scale=scale, config=qkv_rope_config(weight, shape, int8, rows=num_tokens))
    q_two = rope_and_write_kv(qkv, *tables, k_two, v_two, slots, shape)
    for fused, two in ((q_fused, q_two), (k_fused, k_two), (v_fused, v_two)):
        torch.testing.assert_close(fused, two, atol=0, rtol=0)  # the same roundings: the same values


@pytest.mark.parametrize(("shape", "hidden"), [
    FUSED_SHAPES[2], (ModelShape(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=64, vocab_size=0), 96)])
@pytest.mark.parametrize("num_tokens", [1, 5, 17])
def test_the_fused_qkv_kernel_takes_int8_activations_as_the_product_does(shape, hidden, num_tokens):
    """--quantize w8a8: int8 rows of x and their scales in, the same values as the W8A8 product then the
    rope kernel."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x, weight, b, scale, tables, slots = _fused_inputs(shape, hidden, num_tokens, dtype, True, True)
    x, x_scale = quantize_rows_reference(x)
    config = qkv_rope_config(weight, shape, True, rows=num_tokens, act_int8=True)
    assert config is not None
    k_fused, v_fused = _caches(shape, dtype)
    q_fused = qkv_rope_and_write_kv(x, weight, b, *tables, k_fused, v_fused, slots, shape, scale=scale,
                                    x_scale=x_scale)
    assert q_fused.dtype == dtype
    k_two, v_two = _caches(shape, dtype)
    qkv = skinny_linear(x, weight, b, scale=scale, x_scale=x_scale, out_dtype=dtype, config=config)
    q_two = rope_and_write_kv(qkv, *tables, k_two, v_two, slots, shape)
    for fused, two in ((q_fused, q_two), (k_fused, k_two), (v_fused, v_two)):
        torch.testing.assert_close(fused, two, atol=0, rtol=0)


def _assert_token_as_if_alone(t: int, x, weight, bias, tables, slots, shape: ModelShape, together) -> None:
    """Token `t` run through the fused kernel alone writes the query, key and value it got among all
    (`together`: the query and the two caches of the run of every token)."""
    q_all, k_all, v_all = together
    cos, sin, positions = tables
    k_one, v_one = torch.zeros_like(k_all), torch.zeros_like(v_all)
    q_one = qkv_rope_and_write_kv(x[t:t + 1], weight, bias, cos, sin, positions[t:t + 1], k_one, v_one,
                                  slots[t:t + 1], shape)
    assert torch.equal(q_one[0], q_all[t])
    slot = int(slots[t])
    assert torch.equal(k_one.flatten(0, 1)[slot], k_all.flatten(0, 1)[slot])
    assert torch.equal(v_one.flatten(0, 1)[slot], v_all.flatten(0, 1)[slot])


def test_each_token_of_the_fused_qkv_kernel_is_computed_as_if_alone():
    shape, hidden = FUSED_SHAPES[1]
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x, weight, b, scale, (cos, sin, positions), slots = _fused_inputs(shape, hidden, 9, dtype, True, False)
    k_all, v_all = _caches(shape, dtype)
    q_all = qkv_rope_and_write_kv(x, weight, b, cos, sin, positions, k_all, v_all, slots, shape)
    # on CPU the interpreter's dot is numpy's matmul, which rounds rows 8-15 of a 16-row tile apart
    # from rows 0-7 (the skinny linear's own products differ there too); the GPU's tensor cores do not
    for t in (0, 4, 8) if DEVICE == "cuda" else (0, 2, 5):
        _assert_token_as_if_alone(t, x, weight, b, (cos, sin, positions), slots, shape, (q_all, k_all, v_all))


def test_a_head_dim_narrower_than_a_strip_is_not_taken_by_the_fused_qkv_kernel():
    shape = ModelShape(num_layers=1, num_heads=3, num_kv_heads=3, head_dim=8, vocab_size=0)
    weight = torch.zeros(9 * 8, 64)
    assert qkv_rope_block_n(weight, shape) is None
    assert qkv_rope_block_n(torch.zeros(8 * 16, 64), FUSED_SHAPES[0][0]) == 16


@pytest.mark.gpu
@pytest.mark.parametrize(("shape", "hidden"), [
    (ModelShape(num_layers=1, num_heads=32, num_kv_heads=8, head_dim=64, vocab_size=0), 2048),  # Llama-3.2-1B
    (ModelShape(num_layers=1, num_heads=32, num_kv_heads=8, head_dim=128, vocab_size=0), 4096),  # Llama-3.1-8B
])
@pytest.mark.parametrize("num_tokens", [1, 5, 16])
def test_the_fused_qkv_kernel_gives_the_two_kernels_bits_in_bf16_at_llama_shapes(shape, hidden, num_tokens):
    """On the H200: the same values as the QKV product then the rope kernel, in bfloat16 (where an
    FMA contracted differently would show), for every token."""
    x, weight, b, scale, tables, slots = _fused_inputs(shape, hidden, num_tokens, torch.bfloat16, False, False)
    k_fused, v_fused = _caches(shape, torch.bfloat16)
    q_fused = qkv_rope_and_write_kv(x, weight, b, *tables, k_fused, v_fused, slots, shape)
    k_two, v_two = _caches(shape, torch.bfloat16)
    q_two = rope_and_write_kv(skinny_linear(x, weight, b), *tables, k_two, v_two, slots, shape)
    assert torch.equal(q_fused, q_two) and torch.equal(k_fused, k_two) and torch.equal(v_fused, v_two)


@pytest.mark.gpu
@pytest.mark.parametrize(("shape", "hidden"), [
    (ModelShape(num_layers=1, num_heads=32, num_kv_heads=8, head_dim=64, vocab_size=0), 2048),  # Llama-3.2-1B
    (ModelShape(num_layers=1, num_heads=32, num_kv_heads=8, head_dim=128, vocab_size=0), 4096),  # Llama-3.1-8B
])
@pytest.mark.parametrize("num_tokens", [40, 200])
def test_the_fused_qkv_kernel_in_wide_tiles_gives_each_token_its_bits_alone(shape, hidden, num_tokens):
    """A verify of several sequences or a prefill chunk (more than 16 tokens: 64- or 128-row tiles) writes
    each token's query, key and value as a decode of that token would, and the two kernels' values."""
    dtype = torch.bfloat16
    x, weight, _, _, (cos, sin, positions), slots = _fused_inputs(shape, hidden, num_tokens, dtype, False, False,
                                                                  num_slots=num_tokens)
    k_all, v_all = _caches(shape, dtype, num_slots=num_tokens)
    q_all = qkv_rope_and_write_kv(x, weight, None, cos, sin, positions, k_all, v_all, slots, shape)
    k_two, v_two = _caches(shape, dtype, num_slots=num_tokens)
    q_two = rope_and_write_kv(skinny_linear(x, weight), cos, sin, positions, k_two, v_two, slots, shape)
    assert torch.equal(q_all, q_two) and torch.equal(k_all, k_two) and torch.equal(v_all, v_two)
    for t in range(num_tokens):
        _assert_token_as_if_alone(t, x, weight, None, (cos, sin, positions), slots, shape, (q_all, k_all, v_all))


@pytest.mark.parametrize(("env", "on"), [({}, True), ({"SPECDEC_QKV_ROPE": "1"}, True), ({"SPECDEC_QKV_ROPE": "0"}, False)])
def test_the_fused_qkv_kernel_is_switched_by_the_environment(env, on):
    """On in both services unless SPECDEC_QKV_ROPE=0."""
    environ = {k: v for k, v in os.environ.items() if k != "SPECDEC_QKV_ROPE"} | env
    out = subprocess.run([sys.executable, "-c", "import engine.fused_stages as f; print(f.QKV_ROPE)"],
                         cwd=ROOT, env=environ, stdout=subprocess.PIPE, text=True, check=True).stdout
    assert out.strip() == str(on)
