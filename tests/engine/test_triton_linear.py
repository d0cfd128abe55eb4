"""The Triton skinny linear equals its PyTorch reference for every fusion: fp32 under
TRITON_INTERPRET=1 on CPU, bf16 on the GPU; and a row's result does not depend on the other rows."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.linear import Int8Linear, quantize_rows_reference
from engine.triton_linear import (
    LaunchConfig,
    launch_config,
    skinny_linear,
    skinny_linear_reference,
    split_counters,
    wide_launch_config,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = LaunchConfig(block_n=16, block_k=32, num_warps=4, num_stages=2)  # several K steps on small shapes


def _inputs(rows: int, n: int, k: int, fusion: str, bias: bool, residual: bool, dtype: torch.dtype):
    """fusion: "none" or "silu_mul" (a gate/up projection)."""
    torch.manual_seed(rows * 1000 + n + k)
    silu_mul = fusion == "silu_mul"
    return dict(
        x=torch.randn(rows, k, device=DEVICE).to(dtype),
        weight=(torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype),
        bias=torch.randn(n, device=DEVICE).to(dtype) if bias else None,
        silu_mul=silu_mul,
        residual=torch.randn(rows, n // 2 if silu_mul else n, device=DEVICE).to(dtype) if residual else None,
    )


# (rows, N, K): decode, a verify, a full row tile, two row tiles, N and K off the block sizes
SHAPES = [(1, 48, 64), (5, 32, 96), (16, 64, 64), (19, 32, 64), (3, 40, 80)]


@pytest.mark.parametrize(("rows", "n", "k"), SHAPES)
@pytest.mark.parametrize(("fusion", "bias", "residual"), [
    ("none", False, False), ("none", True, False), ("none", False, True), ("silu_mul", False, False),
    ("silu_mul", True, True),
])
def test_kernel_matches_reference_fp32(rows, n, k, fusion, bias, residual):
    args = _inputs(rows, n, k, fusion, bias, residual, torch.float32)
    expected = skinny_linear_reference(**args)
    torch.testing.assert_close(skinny_linear(**args, config=SMALL), expected, atol=1e-5, rtol=1e-5)


def _int8(args: dict) -> dict:
    """`args` with its weight as int8 rows and their scales (engine/linear.Int8Linear)."""
    quantized = Int8Linear(SimpleNamespace(weight=args["weight"], bias=None))
    return {**args, "weight": quantized.qweight, "scale": quantized.scale}


@pytest.mark.parametrize(("rows", "n", "k"), SHAPES)
@pytest.mark.parametrize(("fusion", "bias", "residual"), [("none", False, False), ("silu_mul", True, True),
                                                          ("none", True, True)])
def test_int8_weights_give_the_product_of_their_dequantized_rows(rows, n, k, fusion, bias, residual):
    args = _int8(_inputs(rows, n, k, fusion, bias, residual, torch.float32))
    expected = skinny_linear_reference(**args)
    torch.testing.assert_close(skinny_linear(**args, config=SMALL), expected, atol=1e-5, rtol=1e-5)


SPLIT = LaunchConfig(block_n=16, block_k=32, num_warps=4, num_stages=2, split_k=3)  # 3 K ranges, one maybe empty


@pytest.mark.parametrize(("rows", "n", "k"), SHAPES)
@pytest.mark.parametrize(("fusion", "bias", "residual", "int8"), [
    ("none", False, False, False), ("none", True, True, False), ("silu_mul", True, True, False),
    ("none", False, True, True), ("silu_mul", False, False, True),
])
def test_a_product_split_along_k_adds_its_ranges_to_the_same_result(rows, n, k, fusion, bias, residual, int8):
    args = _inputs(rows, n, k, fusion, bias, residual, torch.float32)
    args = _int8(args) if int8 else args
    counters = split_counters(torch.device(DEVICE))
    got = skinny_linear(**args, config=SPLIT, counters=counters)
    torch.testing.assert_close(got, skinny_linear_reference(**args), atol=1e-5, rtol=1e-5)
    assert not counters.any()  # each strip's last program zeroed its counter for the next launch
    assert torch.equal(skinny_linear(**args, config=SPLIT, counters=counters), got)  # and it adds in K order


def _w8a8(args: dict) -> dict:
    """`_int8(args)` with x as int8 rows and their scales too (--quantize w8a8); float32 out."""
    x, x_scale = quantize_rows_reference(args["x"])
    return {**_int8(args), "x": x, "x_scale": x_scale, "out_dtype": torch.float32}


@pytest.mark.parametrize(("rows", "n", "k"), SHAPES)
@pytest.mark.parametrize(("fusion", "bias", "residual", "config"), [
    ("none", False, False, SMALL), ("silu_mul", True, True, SMALL), ("none", True, True, SPLIT),
    ("silu_mul", False, False, SPLIT),
], ids=["plain", "silu_bias_residual", "split_bias_residual", "split_silu"])
def test_int8_activations_give_the_integer_sums_times_both_scales(rows, n, k, fusion, bias, residual, config):
    args = _w8a8(_inputs(rows, n, k, fusion, bias, residual, torch.float32))
    counters = split_counters(torch.device(DEVICE))
    got = skinny_linear(**args, config=config, counters=counters)
    # the reference sums exactly (float64) and scales once; a split adds its ranges' float32 sums
    torch.testing.assert_close(got, skinny_linear_reference(**args), atol=1e-5, rtol=1e-5)
    assert not counters.any()


def test_each_row_of_int8_activations_is_computed_as_if_alone():
    """A row's int8 values and scale are its own, its integer sum exact: a row alone gets its bits in a batch."""
    args = _w8a8(_inputs(5, 32, 64, "none", False, True, torch.float32))
    for config in (SMALL, SPLIT):
        together = skinny_linear(**args, config=config)
        alone = skinny_linear(**{**args, "x": args["x"][2:3], "x_scale": args["x_scale"][2:3],
                                 "residual": args["residual"][2:3]}, config=config)
        assert torch.equal(together[2:3], alone)


def test_int8_activations_without_int8_weights_or_their_scales_are_refused_before_launch():
    args = _w8a8(_inputs(2, 32, 64, "none", False, False, torch.float32))
    with pytest.raises(AssertionError, match="int8 rows of x go with their x_scale"):
        skinny_linear(args["x"], args["weight"], scale=args["scale"], out_dtype=torch.float32)
    with pytest.raises(AssertionError, match="x_scale \\[M\\] float32"):
        skinny_linear(args["x"], args["weight"], scale=args["scale"], x_scale=args["x_scale"][:1],
                      out_dtype=torch.float32)
    with pytest.raises(AssertionError, match="name the output's dtype"):
        skinny_linear(args["x"], args["weight"], scale=args["scale"], x_scale=args["x_scale"])


def test_int8_weights_without_their_scales_are_refused_before_launch():
    args = _int8(_inputs(2, 32, 64, "none", False, False, torch.float32))
    with pytest.raises(AssertionError, match="must share a dtype"):
        skinny_linear(args["x"], args["weight"])
    with pytest.raises(AssertionError, match="scale \\[N\\] goes with int8 weights"):
        skinny_linear(args["x"], args["weight"], scale=args["scale"][:31])


def test_float32_output_of_bfloat16_product_keeps_the_accumulator():
    args = _inputs(2, 32, 64, "none", True, False, torch.bfloat16 if DEVICE == "cuda" else torch.float32)
    out = skinny_linear(**args, out_dtype=torch.float32, config=SMALL)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, skinny_linear_reference(**args).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fusion", ["none", "silu_mul"])
@pytest.mark.parametrize("config", [SMALL, SPLIT], ids=["whole_k", "split_k"])
def test_each_row_is_computed_as_if_alone(fusion, config):
    """Batch invariance: a decode (1 row) and a verify (5 rows) give the shared row the same bits."""
    args = _inputs(5, 32, 64, fusion, False, True, torch.float32)
    together = skinny_linear(**args, config=config)
    alone = skinny_linear(**{**args, "x": args["x"][2:3], "residual": args["residual"][2:3]}, config=config)
    assert torch.equal(together[2:3], alone)


@pytest.mark.parametrize(("rows", "n", "k", "fusion"), [(40, 64, 128, "none"), (40, 256, 96, "silu_mul"),
                                                   (130, 200, 64, "none"), (70, 16384, 64, "silu_mul")])
def test_steps_of_many_rows_take_wide_tiles_that_match_the_reference_fp32(rows, n, k, fusion):
    config = launch_config(n, k, rows=rows)
    assert config == wide_launch_config(n, rows) and config.block_m in (64, 128)
    args = _inputs(rows, n, k, fusion, True, True, torch.float32)
    torch.testing.assert_close(skinny_linear(**args), skinny_linear_reference(**args), atol=1e-5, rtol=1e-5)


def test_split_and_int8_products_keep_their_decode_configuration_at_any_row_count():
    """Their K ranges (split) are part of a row's sum; int8's wide tiles were never measured."""
    for n, k, int8 in ((2048, 8192, False), (2048, 8192, True), (16384, 2048, True)):
        assert launch_config(n, k, int8=int8, rows=200) == launch_config(n, k, int8=int8)
    for n, k in ((2048, 8192), (3072, 2048), (16384, 2048)):
        assert launch_config(n, k, int8=True, rows=200, act_int8=True) == launch_config(n, k, int8=True, act_int8=True)


def test_mismatched_shapes_are_refused_before_launch():
    args = _inputs(2, 32, 64, "none", False, False, torch.float32)
    with pytest.raises(AssertionError, match="x .* vs weight"):
        skinny_linear(args["x"][:, :48], args["weight"])
    with pytest.raises(AssertionError, match="gate/up row pairs"):
        skinny_linear(args["x"], args["weight"][:31], silu_mul=True)


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 4096, 4096), (5, 6144, 4096), (16, 1024, 14336), (3, 1000, 2048)])
@pytest.mark.parametrize("fusion", ["none", "silu_mul"])
def test_kernel_matches_reference_bf16_at_model_shapes(rows, n, k, fusion):
    args = _inputs(rows, n, k, fusion, False, True, torch.bfloat16)
    got, expected = skinny_linear(**args), skinny_linear_reference(**args)
    # rounding differs (fused float32 products vs rounded intermediates): about one bf16 ulp of the output
    torch.testing.assert_close(got.float(), expected.float(), atol=6e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("fusion", ["none", "silu_mul"])
def test_each_row_is_computed_as_if_alone_bf16(fusion):
    args = _inputs(5, 4096, 4096, fusion, False, True, torch.bfloat16)
    together = skinny_linear(**args)
    for row in range(5):
        alone = skinny_linear(**{**args, "x": args["x"][row:row + 1], "residual": args["residual"][row:row + 1]})
        assert torch.equal(together[row:row + 1], alone)


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k", "fusion"), [
    (6144, 4096, "none"), (4096, 14336, "none"), (28672, 4096, "silu_mul"), (128256, 4096, "none"),  # Llama-3.1-8B
    (2048, 8192, "none"), (1000, 2048, "none"),  # a split product; N off the block sizes
])
@pytest.mark.parametrize("rows", [17, 40, 64, 65, 129, 300])
def test_wide_tiles_give_each_row_the_bits_of_a_decode(n, k, fusion, rows):
    """Steps of more than 16 rows take 64- or 128-row tiles (launch_config's rows; on the H200 Hopper's
    warp-group instructions at 64 rows and more): every row is the bits of that row alone, 16-row tiles."""
    args = _inputs(rows, n, k, fusion, False, True, torch.bfloat16)
    together = skinny_linear(**args)
    alone = torch.cat([skinny_linear(**{**args, "x": args["x"][r:r + 1], "residual": args["residual"][r:r + 1]})
                       for r in range(rows)])
    assert torch.equal(together, alone)


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 3072, 2048), (5, 2048, 8192), (16, 16384, 2048), (3, 1000, 2048)])
@pytest.mark.parametrize("fusion", ["none", "silu_mul"])
def test_int8_kernel_matches_reference_bf16_at_model_shapes(rows, n, k, fusion):
    args = _int8(_inputs(rows, n, k, fusion, False, True, torch.bfloat16))
    got, expected = skinny_linear(**args), skinny_linear_reference(**args)
    torch.testing.assert_close(got.float(), expected.float(), atol=6e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 3072, 2048), (5, 2048, 8192), (16, 16384, 2048), (3, 1000, 2048),
                                              (2, 32768, 2048)])
@pytest.mark.parametrize("fusion", ["none", "silu_mul"])
def test_int8_activations_match_the_exact_integer_sums_on_int8_tensor_cores(rows, n, k, fusion):
    """W8A8 at the Llama-3.2-1B draft's shapes (the launch configurations it serves with): the int32 sums
    are exact, so only the output's rounding differs from the float64 reference."""
    args = _w8a8(_inputs(rows, n, k, fusion, False, True, torch.bfloat16))
    args["out_dtype"] = None  # the residual's bf16
    got, expected = skinny_linear(**args), skinny_linear_reference(**args)
    torch.testing.assert_close(got.float(), expected.float(), atol=6e-2, rtol=2e-2)
    for row in range(rows):
        alone = skinny_linear(**{**args, "x": args["x"][row:row + 1], "x_scale": args["x_scale"][row:row + 1],
                                 "residual": args["residual"][row:row + 1]})
        assert torch.equal(got[row:row + 1], alone)


@pytest.mark.gpu
@pytest.mark.parametrize("int8", [False, True])
def test_a_split_product_replays_in_a_cuda_graph_with_the_same_bits(int8):
    """A draft's down projection (2048 x 8192, split along K) captured with counters made before the
    capture: every replay gives the eager product's bits, and each row's alone."""
    assert launch_config(2048, 8192, int8=int8).split_k > 1
    args = _inputs(5, 2048, 8192, "none", False, True, torch.bfloat16)
    args = _int8(args) if int8 else args
    counters = split_counters(torch.device("cuda"))
    eager = skinny_linear(**args, counters=counters)
    torch.testing.assert_close(eager.float(), skinny_linear_reference(**args).float(), atol=6e-2, rtol=2e-2)
    x = args["x"].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        skinny_linear(**{**args, "x": x}, counters=counters)  # compiled outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = skinny_linear(**{**args, "x": x}, counters=counters)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    assert not counters.any()
    for row in range(5):
        alone = skinny_linear(**{**args, "x": args["x"][row:row + 1], "residual": args["residual"][row:row + 1]},
                              counters=counters)
        assert torch.equal(eager[row:row + 1], alone)
