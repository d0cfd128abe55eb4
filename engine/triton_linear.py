"""Triton skinny linear: out = epilogue(x @ W^T) for the few rows of a decode or verify step.

At 1..16 rows a linear layer is bound by the bytes of W it reads; besides cuBLAS's own shortfall
at these shapes (bench/tune_linear.py: 0.59-0.70 of the copy bandwidth on Llama-3.1-8B's attention
projections, 0.70-0.77 here), a step loses to the floor in the kernels around the products, each a
launch and a ramp in the CUDA graph. One program here streams a BLOCK_N x K strip of W, contiguous
along K, through a software pipeline, and multiplies it with all rows at once (a tensor-core dot
over the rows padded to 16), fusing into its epilogue:

  scale      int8 weights (engine/linear.Int8Linear, for drafts): the strip is read as int8, half
             of bf16's bytes, widened to the activations' dtype for the dot, and each column's
             float32 sum multiplied by its row's scale
  x_scale    int8 activations too (W8A8, --quantize w8a8): x arrives as int8 rows and one float32
             scale a row (engine/triton_quant.py), and the dot runs on int8 tensor cores into int32,
             exact; nothing is widened in the loop, which the W8A16 strips spend their time on (H200,
             Llama-3.2-1B, 1 row, us: qkv 7.8 bf16 -> 4.7, o 7.2 -> 4.4, gate/up 12.5 int8 -> 10.4,
             down 12.8 bf16 -> 8.1, a 32k head 22.9 int8 -> 18.8; bench/results/probe_w8a8.json)
  silu_mul   for gate/up weights with interleaved rows (gate_0, up_0, gate_1, ...): each program
             pairs its columns and writes silu(gate) * up, half as many columns
  bias       before rounding, like addmm
  residual   after rounding, like the unfused add

Nothing is fused on the way in: any op on the x tile between its load and the dot costs the
pipeline its asynchronous copies, and measured 0.23-0.35 of the bandwidth (the RMS norm; so it
stays a kernel of its own, engine/triton_norm.py, 2 us).

Narrow products of a long K (a draft's down projection: 2048 columns, K = 8192) are split along K:
each column strip has `split_k` programs, one a K range, so four times as many programs stream W
(128 strips of 16 columns would leave each SM one program and its few loads in flight). Each
writes its float32 partial sums to a workspace and counts itself in the strip's counter; the last
to arrive adds the partials in order of their K range (whichever program that is, the same sum)
and runs the epilogue, then zeroes the counter for the next launch.

A row's result does not depend on the other rows or their number: every configuration adds a row's
products in the same order along K (K step after K step, the tensor-core instructions accumulating
16 products at a time into the same float32 sums), so a verify and a decode, or any batch, give the
row the same product. Steps of more than 16 rows (a batch's verify, a prefill chunk) take wider tiles,
64 or 128 rows and 64-128 columns a program (`launch_config`'s `rows`): a program multiplies each W tile
it loads with all its rows, where 16-row tiles made each strip of W be read once per 16 rows (a
40-row Llama-3.1-8B gate/up in 63 us against 109). On the H200 every such configuration gives each
row the bits of the 16-row one (bench/tune_linear.py --wide, bench/results/tune_linear_wide.json;
tests/engine/test_triton_linear.py, test_triton_rope.py), Hopper's warp-group instructions at 64 rows included.
Split products keep their 16-row configuration at any row count (their K ranges are part of the
sum's order). `skinny_linear_reference` is the same computation in PyTorch (CPU, the tests).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine import pdl
from engine.linear import dequantize_int8
from engine.llama import silu_mul_interleaved
from engine.triton_prefetch import prefetch_options, prefetch_strip

BLOCK_M = 16  # rows per program: the smallest tensor-core tile
SPLIT_K = 4  # K ranges of a narrow product of a long K (launch_config)
SPLIT_K_MIN_K = 8192
MAX_TILES = 8192  # (row tile, column strip) counters a split product may use


@dataclass(frozen=True)
class LaunchConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # programs a column strip, each a K range (see the module doc)
    block_m: int = BLOCK_M  # rows a program


def launch_config(n: int, k: int, int8: bool = False, rows: int = 1, act_int8: bool = False) -> LaunchConfig:
    """The configuration for a product of `rows` rows: up to 16 rows a function of the weight's shape and
    element size only, more take `wide_launch_config`'s (the same bits a row: see the module doc).
    `act_int8`: int8 activations as well (W8A8), 16-row tiles at any row count."""
    if act_int8:
        return _w8a8_launch_config(n, k)
    config = _launch_config(n, k, int8)
    if rows <= BLOCK_M or int8 or config.split_k > 1:
        return config
    return wide_launch_config(n, rows)


def wide_launch_config(n: int, rows: int) -> LaunchConfig:
    """More than 16 rows (bench/results/tune_linear_wide.json, Llama-3.1-8B shapes at 24, 40, 128 and
    512 rows): 64 rows a program up to 128 rows (up to 64 for products of 16384+ columns, whose wide
    strips fill the GPU sooner), then 128 rows of 128 columns. int8 weights keep their 16-row tiles
    (wider ones unmeasured)."""
    if rows > 128 or (rows > 64 and n >= 16384):
        return LaunchConfig(block_n=128, block_k=64, num_warps=8, num_stages=3, block_m=128)
    if n >= 16384:  # gate/up projections, LM heads
        return LaunchConfig(block_n=64, block_k=64, num_warps=4, num_stages=3, block_m=64)
    return LaunchConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, block_m=64)


def _launch_config(n: int, k: int, int8: bool) -> LaunchConfig:
    """Up to 16 rows: the best of bench/tune_linear.py's sweeps on the H200 for Llama-3.1-8B and 3.2-1B shapes.
    Products narrower than 4096 columns take 16 a program: at 32 they leave SMs idle (N = 2048 is 64
    programs on 132 SMs), and at 16 Llama-3.2-1B's down projection streams W in 12.6 us instead of
    16.2, its o_proj in 5.4 instead of 5.9 (bench/results/tune_linear_narrow.json, residual fused, 1 row).
    Narrow products of a long K split in SPLIT_K ranges (the module doc): a 1B bf16 decode replay
    1.167 -> 1.084 ms, with int8 and a 32k head 0.990 -> 0.908; 2 or 8 ranges, or splitting qkv and
    o_proj too, were slower (bench/results/gpu_draft_forward.json)."""
    if int8:
        return _int8_launch_config(n, k)
    narrow = n < 4096
    if narrow and k >= SPLIT_K_MIN_K and SPLIT_K > 1:
        return LaunchConfig(16, 256, 2, 4, split_k=SPLIT_K)
    if k >= 8192:  # down projections
        return LaunchConfig(16, 512, 2, 4) if narrow else LaunchConfig(32, 512, 4, 4)
    if n >= 65536:  # LM heads
        return LaunchConfig(block_n=64, block_k=128, num_warps=4, num_stages=4)
    if n >= 16384:  # gate/up projections
        return LaunchConfig(block_n=32, block_k=128, num_warps=4, num_stages=3)
    block_k = 256 if k % 256 == 0 else 128
    return LaunchConfig(16, block_k, 2, 4) if narrow else LaunchConfig(32, block_k, 4, 4)


def _int8_launch_config(n: int, k: int) -> LaunchConfig:
    """int8 strips: as many bytes a K step as bf16's (twice the elements); LM heads one stage fewer
    (bench/results/tune_linear_int8.json: Llama-3.2-1B's head in 67 us against 71, bf16's 118)."""
    if n >= 65536:
        return LaunchConfig(block_n=64, block_k=256, num_warps=4, num_stages=3)
    bf16 = _launch_config(n, k, int8=False)
    block_k = bf16.block_k * 2 if k % (bf16.block_k * 2) == 0 else bf16.block_k
    return LaunchConfig(bf16.block_n, block_k, bf16.num_warps, bf16.num_stages, bf16.split_k)


def _w8a8_launch_config(n: int, k: int) -> LaunchConfig:
    """int8 x int8: the best of bench/probe_w8a8.py's sweep on the H200 (Llama-3.2-1B shapes, 1 and 5 rows):
    2 warps and 4 stages everywhere but the LM head; the down projection split along K as bf16's is."""
    if n >= 32768:  # LM heads
        return LaunchConfig(block_n=64, block_k=256, num_warps=4, num_stages=3)
    if n >= 16384:  # gate/up projections
        return LaunchConfig(block_n=64, block_k=256, num_warps=2, num_stages=4)
    if n < 4096 and k >= SPLIT_K_MIN_K:
        return LaunchConfig(block_n=32, block_k=256, num_warps=2, num_stages=4, split_k=SPLIT_K)
    return LaunchConfig(block_n=32, block_k=512 if k % 512 == 0 else 256, num_warps=2, num_stages=4)


@triton.jit
def strip_product(x_ptr, w_ptr, rows, w_rows, row_ok, col_ok, K, stride_xm, stride_wn, k_first, k_per_split,
                  HAS_SCALE: tl.constexpr, EVEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, A_INT8: tl.constexpr = False):
    """float32 [BLOCK_M, BLOCK_N]: x's `rows` times W's rows `w_rows` (any BLOCK_N of them, each
    contiguous along K) over the K range from `k_first`, streamed through the software pipeline.
    `EVEN`: no masks (every W row exists, K a multiple of BLOCK_K). `A_INT8`: x and W int8, their
    exact int32 sum (the caller multiplies in both scales). The fused QKV-rotary kernel's
    loop (engine/triton_rope.py); product_tile keeps its own copy of these lines: called
    from there, this changed its machine code (PTX), which the H200 figures were measured without."""
    offs_k = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + w_rows[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32 if A_INT8 else tl.float32)
    for k0 in range(k_first, tl.minimum(K, k_first + k_per_split), BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        if EVEN:
            w = tl.load(w_cols + k[None, :])
        else:
            w = tl.load(w_cols + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0)
        a = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0)
        if A_INT8:
            acc += tl.dot(a, tl.trans(w), out_dtype=tl.int32)
        else:
            if HAS_SCALE:  # int8 values are exact in bf16, fp16 and float32
                w = w.to(dtype)
            acc += tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION)
    return acc.to(tl.float32)


@triton.jit
def product_tile(
    row_tile, strip, split, num_strips,  # which program's work; column strips a row tile
    x_ptr, w_ptr, out_ptr, bias_ptr, res_ptr, scale_ptr, part_ptr, count_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, stride_rm, k_per_split,
    SPLIT_K: tl.constexpr,
    SILU_MUL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    x_scale_ptr=None,
    A_INT8: tl.constexpr = False,
):
    """One program's work: the kernel's, and a stage of engine/triton_layer.py's layer kernel. `A_INT8`:
    x int8 with a float32 scale a row at `x_scale_ptr` (W8A8), its K range's sum exact in int32."""
    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = strip * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    dtype = out_ptr.dtype.element_ty if A_INT8 else x_ptr.dtype.element_ty  # the activations'
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + cols[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32 if A_INT8 else tl.float32)
    k_first = split * k_per_split  # this program's K range (all of K without a split)
    for k0 in range(k_first, tl.minimum(K, k_first + k_per_split), BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        if EVEN_K and EVEN_N:
            w = tl.load(w_cols + k[None, :])
        else:
            w = tl.load(w_cols + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0)
        a = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0)
        if A_INT8:
            acc += tl.dot(a, tl.trans(w), out_dtype=tl.int32)
        else:
            if HAS_SCALE:  # int8 values are exact in bf16, fp16 and float32
                w = w.to(dtype)
            acc += tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION)
    acc = acc.to(tl.float32)
    if A_INT8:  # each row's scale (rows past M: 0)
        acc *= tl.load(x_scale_ptr + rows, mask=row_ok, other=0.0)[:, None]
    if SPLIT_K > 1:  # the partial sums to the workspace; the strip's last program adds them, in K order
        tile_mask = row_ok[:, None] & col_ok[None, :]
        parts = part_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(parts + split * M * N, acc, mask=tile_mask)
        tl.debug_barrier()  # every thread's partials written before the count (release) says so
        tile = row_tile * num_strips + strip
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        last = tl.zeros([BLOCK_M], dtype=tl.int32) + arrived == SPLIT_K - 1  # (a vector: row masks)
        row_ok &= last  # the others store nothing
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for split in range(SPLIT_K):  # from L2 (.cg), where the other programs' stores are
            acc += tl.load(parts + split * M * N, mask=tile_mask & last[:, None], other=0.0,
                           cache_modifier=".cg")
        # the counter back to zero for the next launch (one lane of the last program)
        first_row = tl.arange(0, BLOCK_M) == 0
        tl.atomic_xchg(count_ptr + tile + tl.zeros([BLOCK_M], dtype=tl.int32), 0, mask=last & first_row)
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:  # columns (2j, 2j + 1) are (gate_j, up_j); each op rounded like PyTorch's
        gate, up = tl.split(tl.reshape(acc.to(dtype).to(tl.float32), [BLOCK_M, BLOCK_N // 2, 2]))
        y = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
        cols = strip * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        col_ok = cols < N // 2
    else:
        y = acc.to(out_ptr.dtype.element_ty)
    out_mask = row_ok[:, None] & col_ok[None, :]
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + rows[:, None].to(tl.int64) * stride_rm + cols[None, :], mask=out_mask, other=0.0)
        y = y.to(tl.float32) + res.to(tl.float32)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=out_mask)


@triton.jit
def _skinny_linear_kernel(
    x_ptr, w_ptr, out_ptr, bias_ptr, res_ptr, scale_ptr, part_ptr, count_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, stride_rm, k_per_split,
    SPLIT_K: tl.constexpr,
    SILU_MUL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
    x_scale_ptr,
    A_INT8: tl.constexpr,
    PREFETCH_LINES: tl.constexpr = 0,
    LINE_ELEMS: tl.constexpr = 128,
):
    if USE_PDL:  # engine/pdl.py: wait for the previous kernel before any load or store
        if PREFETCH_LINES > 0:  # but the strip's first weights (engine/triton_prefetch.py), which no kernel writes
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            k_first = tl.program_id(2) * k_per_split
            prefetch_strip(w_ptr, cols, cols < N, k_first, tl.minimum(K, k_first + k_per_split), stride_wn,
                           PREFETCH_LINES, LINE_ELEMS)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    product_tile(tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(1),
                 x_ptr, w_ptr, out_ptr, bias_ptr, res_ptr, scale_ptr, part_ptr, count_ptr,
                 M, N, K, stride_xm, stride_wn, stride_om, stride_rm, k_per_split, SPLIT_K, SILU_MUL, HAS_BIAS,
                 HAS_RESIDUAL, HAS_SCALE, EVEN_K, EVEN_N, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, x_scale_ptr, A_INT8)


def skinny_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] (silu_mul: rows gate_0, up_0, gate_1, up_1, ...)
    bias: torch.Tensor | None = None,  # [N]
    *,
    scale: torch.Tensor | None = None,  # [N]: weight is int8, its row n standing for weight[n] * scale[n]
    x_scale: torch.Tensor | None = None,  # [M] float32: x is int8 too, its row m standing for x[m] * x_scale[m]
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,  # [M, N] ([M, N / 2] with silu_mul), added last
    out_dtype: torch.dtype | None = None,
    config: LaunchConfig | None = None,
    counters: torch.Tensor | None = None,  # split products: MAX_TILES zeroed int32 (split_counters)
) -> torch.Tensor:  # [M, N] ([M, N / 2] with silu_mul)
    """Asserting host wrapper: every shape, dtype and stride is checked before launch. A split product
    (launch_config's split_k) inside a CUDA graph capture needs `counters` made before the capture."""
    assert x.dim() == 2 and weight.dim() == 2, "x [M, K] and weight [N, K]"
    n, k = weight.shape
    m = x.shape[0]
    assert x.shape[1] == k, f"x {tuple(x.shape)} vs weight {tuple(weight.shape)}"
    assert not silu_mul or n % 2 == 0, "silu_mul needs gate/up row pairs"
    n_out = n // 2 if silu_mul else n
    if scale is None:
        assert x.dtype == weight.dtype, f"x {x.dtype} and weight {weight.dtype} must share a dtype"
    else:
        assert weight.dtype == torch.int8 and scale.shape == (n,) and scale.is_contiguous(), \
            f"scale [N] goes with int8 weights, got {weight.dtype} and {tuple(scale.shape)}"
        assert (x.dtype == torch.int8) == (x_scale is not None), "int8 rows of x go with their x_scale"
    if x_scale is not None:
        assert scale is not None and x_scale.shape == (m,) and x_scale.dtype == torch.float32, \
            "x_scale [M] float32 goes with int8 x and int8 weights"
        assert out_dtype is not None or residual is not None, "int8 x: name the output's dtype"
    assert x.stride(1) == 1 and weight.stride(1) == 1, "rows must be contiguous"
    assert x.device == weight.device
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous()
    if residual is not None:
        assert residual.shape == (m, n_out) and residual.stride(1) == 1
    out_dtype = out_dtype or (residual.dtype if residual is not None else x.dtype)
    out = torch.empty((m, n_out), dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    config = config or launch_config(n, k, int8=scale is not None, rows=m, act_int8=x_scale is not None)
    assert config.block_n % 2 == 0
    # row tiles vary fastest: the programs that share a strip of W run together and read it from L2
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), config.split_k)
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    if config.split_k > 1:
        assert grid[0] * grid[1] <= MAX_TILES, f"{grid[0] * grid[1]} tiles, counters for {MAX_TILES}"
        counters = split_counters(x.device) if counters is None else counters
        assert counters.dtype == torch.int32 and counters.numel() >= grid[0] * grid[1]
        partials = torch.empty((config.split_k, m, n), dtype=torch.float32, device=x.device)
    else:
        counters = partials = x
    options = pdl.launch_options(x.device)
    _skinny_linear_kernel[grid](
        x, weight, out,
        bias if bias is not None else x,
        residual if residual is not None else x,
        scale if scale is not None else x,
        partials, counters,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        residual.stride(0) if residual is not None else 0, k_per_split,
        SPLIT_K=config.split_k, SILU_MUL=silu_mul, HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, HAS_SCALE=scale is not None,
        EVEN_K=k % config.block_k == 0, EVEN_N=n % config.block_n == 0,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        # float32 models stay exact float32 (no TF32)
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages, **options,
        x_scale_ptr=x_scale if x_scale is not None else x, A_INT8=x_scale is not None,
        **prefetch_options(config.block_n, k_per_split, weight.element_size(), options["USE_PDL"]),
    )
    return out


def split_counters(device: torch.device) -> torch.Tensor:
    """Zeroed counters for split products; each launch leaves them zeroed. One set for the kernels
    of one stream in turn (a model's): kernels running at once must not share a set."""
    assert not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()), \
        "split products in a CUDA graph take counters made before the capture"
    return torch.zeros(MAX_TILES, dtype=torch.int32, device=device)


def skinny_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    scale: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`skinny_linear` in PyTorch ops (int8 x: the exact integer sums, in float64, then the scales)."""
    if x_scale is not None:
        dtype = out_dtype or residual.dtype
        sums = (x.double() @ weight.double().t()).float() * x_scale[:, None] * scale.float()[None, :]
        out = sums if bias is None else sums + bias.float()
        out = out.to(dtype)
        if silu_mul:
            out = silu_mul_interleaved(out)
        return out if residual is None else (residual + out).to(dtype)
    if scale is not None:
        weight = dequantize_int8(weight, scale, x.dtype)
    out = F.linear(x, weight, bias)
    if silu_mul:
        out = silu_mul_interleaved(out)
    if residual is not None:
        out = residual + out
    return out if out_dtype is None else out.to(out_dtype)

