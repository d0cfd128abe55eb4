"""Compiles the fused kernels for the H200 (sm_90) on a machine without a GPU: Triton's frontend and
ptxas, so the errors the CPU interpreter does not raise (a branch's names of two shapes, say) show up
in CI. Run as a script without TRITON_INTERPRET (tests/engine/test_triton_compile.py does); prints
each kernel's name and PTX size."""
from __future__ import annotations

import inspect
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from engine import (  # noqa: E402
    triton_attention,
    triton_draft_step,
    triton_layer,
    triton_linear,
    triton_norm,
    triton_quant,
    triton_rope,
)

TARGET = GPUTarget("cuda", 90, 32)
BF16 = "*bf16"


def compile_sm90(kernel, pointers: dict[str, str], constexprs: dict) -> int:
    """PTX bytes of `kernel` with `pointers` (name -> Triton pointer type; other runtime args i32/fp32)."""
    return len(ptx_sm90(kernel, pointers, constexprs))


def ptx_sm90(kernel, pointers: dict[str, str], constexprs: dict) -> str:
    parameters = inspect.signature(kernel.fn).parameters
    names = list(parameters)
    constexprs = {n: p.default for n, p in parameters.items()  # those left out at their defaults, as a launch has them
                  if "constexpr" in str(p.annotation) and p.default is not inspect.Parameter.empty} | constexprs
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "fp32" if n == "scale" else "i32")
                 for n in names}  # (attention's `scale` is its softmax scale)
    source = ASTSource(kernel, signature, constexprs={(names.index(n),): v for n, v in constexprs.items()})
    return triton.compile(source, target=TARGET, options={"num_warps": 4, "num_stages": 3}).asm["ptx"]


def prefetched_before_wait(ptx: str) -> int:
    """How many L2 prefetches (engine/triton_prefetch.py) come before the PDL wait; none may come after."""
    lines = ptx.splitlines()
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    prefetches = [i for i, line in enumerate(lines) if "prefetch.global.L2" in line]
    assert prefetches and max(prefetches) < wait, f"prefetches at lines {prefetches}, the wait at {wait}"
    return len(prefetches)


def main() -> None:
    linear = {n: BF16 for n in ("x_ptr", "w_ptr", "out_ptr", "bias_ptr", "res_ptr", "scale_ptr")} | \
        {"part_ptr": "*fp32", "count_ptr": "*i32"}
    for split, silu, int8 in ((1, False, False), (1, True, True), (4, False, False)):
        size = compile_sm90(triton_linear._skinny_linear_kernel, linear | ({"w_ptr": "*i8"} if int8 else {}), dict(
            SPLIT_K=split, SILU_MUL=silu, HAS_BIAS=False, HAS_RESIDUAL=not silu, HAS_SCALE=int8, EVEN_K=True,
            EVEN_N=True, BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, DOT_PRECISION="tf32", USE_PDL=True, A_INT8=False))
        print(f"skinny_linear split={split} silu_mul={silu} int8={int8}: {size}")
    w8a8 = linear | {"x_ptr": "*i8", "w_ptr": "*i8", "x_scale_ptr": "*fp32"}
    for split, silu in ((1, True), (4, False)):  # --quantize w8a8: int8 x, int32 dots
        size = compile_sm90(triton_linear._skinny_linear_kernel, w8a8, dict(
            SPLIT_K=split, SILU_MUL=silu, HAS_BIAS=False, HAS_RESIDUAL=not silu, HAS_SCALE=True, EVEN_K=True,
            EVEN_N=True, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, DOT_PRECISION="tf32", USE_PDL=True, A_INT8=True))
        print(f"skinny_linear w8a8 split={split} silu_mul={silu}: {size}")
        ptx = ptx_sm90(triton_linear._skinny_linear_kernel, w8a8, dict(
            SPLIT_K=split, SILU_MUL=silu, HAS_BIAS=False, HAS_RESIDUAL=not silu, HAS_SCALE=True, EVEN_K=True,
            EVEN_N=True, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, DOT_PRECISION="tf32", USE_PDL=True, A_INT8=True,
            PREFETCH_LINES=16, LINE_ELEMS=128))
        print(f"skinny_linear w8a8 split={split} silu_mul={silu} prefetching "
              f"{prefetched_before_wait(ptx)} lines a thread: {len(ptx)}")
    size = compile_sm90(triton_linear._skinny_linear_kernel, linear, dict(  # a step of 17-128 rows (wide tiles)
        SPLIT_K=1, SILU_MUL=True, HAS_BIAS=False, HAS_RESIDUAL=False, HAS_SCALE=False, EVEN_K=True, EVEN_N=True,
        BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, DOT_PRECISION="tf32", USE_PDL=True, A_INT8=False))
    print(f"skinny_linear wide silu_mul=True: {size}")
    rope = {n: BF16 for n in ("qkv_ptr", "cos_ptr", "sin_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")} | \
        {"slot_ptr": "*i64", "pos_ptr": "*i64"}
    for head_dim in (64, 128):
        size = compile_sm90(triton_rope._rope_write_kv_kernel, rope, dict(
            NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=head_dim, BLOCK_H=32, BLOCK_KVH=8, BLOCK_HALF=head_dim // 2,
            BLOCK_D=head_dim, USE_PDL=True))
        print(f"rope_write_kv head_dim={head_dim}: {size}")
    fused = {n: BF16 for n in ("x_ptr", "w_ptr", "bias_ptr", "scale_ptr", "cos_ptr", "sin_ptr", "q_ptr", "k_cache_ptr",
                               "v_cache_ptr")} | {"slot_ptr": "*i64", "pos_ptr": "*i64"}
    for head_dim, block_m, block_n, int8, act_int8 in ((64, 16, 16, False, False), (128, 16, 32, False, False),
                                                       (64, 16, 16, True, False), (128, 64, 64, False, False),
                                                       (64, 16, 32, True, True)):
        pointers = fused | ({"w_ptr": "*i8"} if int8 else {}) | ({"x_ptr": "*i8", "x_scale_ptr": "*fp32"}
                                                                if act_int8 else {})
        size = compile_sm90(triton_rope._qkv_rope_write_kv_kernel, pointers, dict(
            NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=head_dim, HAS_BIAS=True, HAS_SCALE=int8, EVEN_K=True,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=256 if block_m == 16 else 128, DOT_PRECISION="tf32",
            USE_PDL=True, A_INT8=act_int8))
        print(f"qkv_rope_write_kv head_dim={head_dim} rows={block_m} int8={int8} act_int8={act_int8}: {size}")
    ptx = ptx_sm90(triton_rope._qkv_rope_write_kv_kernel, fused | {"w_ptr": "*i8", "x_ptr": "*i8", "x_scale_ptr": "*fp32"},
                   dict(NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=64, HAS_BIAS=False, HAS_SCALE=True, EVEN_K=True,
                        BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, DOT_PRECISION="tf32", USE_PDL=True, A_INT8=True,
                        PREFETCH_LINES=16, LINE_ELEMS=128))
    print(f"qkv_rope_write_kv w8a8 prefetching {prefetched_before_wait(ptx)} lines a thread: {len(ptx)}")
    norm = {"x_ptr": BF16, "w_ptr": BF16, "out_ptr": BF16, "scale_ptr": "*fp32", "eps": "fp32"}
    print("rms_norm:", compile_sm90(triton_norm._rms_norm_kernel, norm, dict(BLOCK_K=2048, QUANTIZE=False,
                                                                             USE_PDL=True)))
    print("rms_norm int8 rows:", compile_sm90(triton_norm._rms_norm_kernel, norm | {"out_ptr": "*i8"},
                                              dict(BLOCK_K=2048, QUANTIZE=True, USE_PDL=True)))
    print("quantize_rows:", compile_sm90(triton_quant._quantize_rows_kernel,
                                         {"x_ptr": BF16, "q_ptr": "*i8", "s_ptr": "*fp32"},
                                         dict(BLOCK_K=8192, USE_PDL=True)))
    attention = {n: BF16 for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")} | \
        {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "block_tables_ptr": "*i32", "cu_seqlens_q_ptr": "*i32",
         "context_lens_ptr": "*i32"}
    print("paged_attention:", compile_sm90(triton_attention._paged_attention_kernel, attention, dict(
        SPLIT_LEN=128, GROUP=4, HEAD_DIM=64, BLOCK_D=64, BLOCK_SIZE=16, BLOCK_N=128, BLOCK_Q=1, BLOCK_M=16,
        DOT_PRECISION="tf32", PROGRAMS=4, DIRECT=False, USE_PDL=True)))
    layer = {n: BF16 for n in ("hidden_ptr", "out_ptr", "x_ptr", "q_ptr", "attn_ptr", "mid_ptr", "x2_ptr", "act_ptr",
                               "norm1_ptr",
                               "qkv_w_ptr", "qkv_b_ptr", "qkv_s_ptr", "o_w_ptr", "o_b_ptr", "o_s_ptr", "norm2_ptr",
                               "gu_w_ptr", "gu_b_ptr", "gu_s_ptr", "down_w_ptr", "down_b_ptr", "down_s_ptr", "cos_ptr",
                               "sin_ptr", "k_cache_ptr", "v_cache_ptr")} | \
        {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "part_ptr": "*fp32", "count_ptr": "*i32",
         "barrier_ptr": "*i32", "pos_ptr": "*i64", "slot_ptr": "*i64", "block_tables_ptr": "*i32",
         "cu_seqlens_q_ptr": "*i32", "context_lens_ptr": "*i32", "eps": "fp32", "gu_w_ptr": "*i8"}
    for splits in (1, 16):  # a Llama-3.2-1B layer, int8 gate/up, every stage with the barriers between
        print(f"layer splits={splits}:", compile_sm90(triton_layer._layer_kernel, layer, dict(
            HIDDEN=2048, INTER=8192, NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=64, BLOCK_SIZE=16,
            QKV_BN=16, QKV_BK=256, QKV_BIAS=False, QKV_INT8=False, O_BN=16, O_BK=256, O_BIAS=False, O_INT8=False,
            GU_BN=32, GU_BK=256, GU_BIAS=False, GU_INT8=True, DOWN_BN=16, DOWN_BK=256, DOWN_SPLIT=4, DOWN_BIAS=False,
            DOWN_INT8=False, ATT_BLOCK_N=128, ATT_BLOCK_Q=1, ATT_BLOCK_M=16, ATT_Q_TILES=1, ATT_PROGRAMS=splits,
            ATT_SPLITS=splits, COMBINE_S=16, BLOCK_M=16, DOT_PRECISION="tf32", STAGE=-1, USE_PDL=True)))
    step = {"token_ptr": "*i64", "base_ptr": "*i64", "tables_ptr": "*i32", "ids_ptr": "*i64", "positions_ptr": "*i64",
            "slots_ptr": "*i64", "context_ptr": "*i32"}
    print("draft_step:", compile_sm90(triton_draft_step._advance_kernel, step, dict(BLOCK_SIZE=16, BLOCK_B=8, USE_PDL=True)))


if __name__ == "__main__":
    main()
