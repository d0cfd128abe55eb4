"""Times the Triton skinny linear over launch configurations against cuBLAS (F.linear), on the linears
of a Llama-3.1-8B and a Llama-3.2-1B shape at decode and verify row counts (bf16). GPU only.

Each timing replays a CUDA graph that runs the product over enough distinct weight copies (>= 512 MB)
that none is still in L2, the way a model's step streams its layers; the time per product includes
the ramp between kernels in a graph. Each configuration runs plain and as the model runs that
product (the norm kernel before it, the activation or residual fused after it). Writes
bench/results/tune_linear.json: per shape and row count, cuBLAS and the best configurations' ms and
fraction of the measured copy bandwidth, best first; `*` marks the default configuration. `--int8`
times int8 weights with their row scales (a draft's --quantize int8) against cuBLAS on the bf16 ones.
`--wide` times configurations of 32, 64 and 128 rows a program (WIDE_CONFIGS) against the 16-row
default (`*`) and records, per configuration, whether its rows are the default's bits (`same_bits`);
`+` marks the one launch_config takes at those rows. `--split` times products split along K (SPLIT_CONFIGS,
engine/triton_linear.py's split_k) against the default (`*`), for shapes whose column strips leave SMs with
one program or a partial last wave (Llama-3.1-8B's qkv: 192 programs of 32 columns on 132 SMs, o_proj 128).
Usage: python bench/tune_linear.py [--rows 1 5] [--shapes 8b_qkv ...] [--int8] [--wide] [--split] [--out PATH]
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from engine.triton_linear import LaunchConfig, launch_config, skinny_linear, split_counters  # noqa: E402
from engine.triton_norm import rms_norm_triton  # noqa: E402
from report import save_report  # noqa: E402
from timing import cuda_ms  # noqa: E402

SHAPES = {  # name: (N, K)
    "8b_qkv": (6144, 4096), "8b_o": (4096, 4096), "8b_gate_up": (28672, 4096), "8b_down": (4096, 14336),
    "8b_lm_head": (128256, 4096),
    "1b_qkv": (3072, 2048), "1b_o": (2048, 2048), "1b_gate_up": (16384, 2048), "1b_down": (2048, 8192),
    "1b_lm_head": (128256, 2048),
}
CONFIGS = ([LaunchConfig(bn, bk, w, s) for bn, bk, w, s in itertools.product((32, 64), (128, 256, 512), (4,), (3, 4))]
           # 16 columns a program: twice the programs, for products too narrow to fill the GPU at 32
           # (Llama-3.2-1B's o_proj and down_proj: N = 2048 is 64 programs of 32 on 132 SMs)
           + [LaunchConfig(16, bk, w, s) for bk, w, s in itertools.product((256, 512), (2, 4), (3, 4))])
# --wide: more rows a program, for verifies and prefills of 17+ rows; each is also checked for giving
# every row the bits of the default (16 rows a program: a decode's)
WIDE_CONFIGS = [LaunchConfig(bn, bk, w, s, block_m=bm) for bm, bn, bk, (w, s) in itertools.product(
    (32, 64, 128), (64, 128), (64, 128), ((4, 3), (4, 4), (8, 3)))]
# --split: each column strip in 2 or 4 K ranges (programs), their float32 partials summed in order by the last
SPLIT_CONFIGS = [LaunchConfig(bn, bk, w, s, split_k=sk) for sk, bn, bk, (w, s) in itertools.product(
    (2, 4), (16, 32, 64), (128, 256), ((2, 4), (4, 3), (4, 4)))]
INT8_CONFIGS = CONFIGS + [LaunchConfig(bn, 1024, w, s) for bn, w, s in itertools.product((16, 32), (2, 4), (3, 4))]
FUSIONS = {  # what the model fuses into each product (engine/fused_stages.py)
    "qkv": "rms_norm", "o": "residual", "gate_up": "rms_norm+silu_mul", "down": "residual", "lm_head": "rms_norm"}
# rms_norm: engine/triton_norm.py's kernel runs before the product (it is part of the time)


def copy_bandwidth() -> float:
    src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_ms(lambda: dst.copy_(src), 10)
    return 2 * src.numel() / (ms / 1e3)


def graph_ms_per_call(fn, copies: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    return cuda_ms(graph.replay, 10) / copies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tune_linear.json")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--int8", action="store_true", help="int8 weights and row scales (engine/linear.Int8Linear)")
    parser.add_argument("--wide", action="store_true", help="configurations of 32, 64 and 128 rows a program")
    parser.add_argument("--split", action="store_true", help="products split along K, against the default")
    args = parser.parse_args()
    configs = WIDE_CONFIGS if args.wide else SPLIT_CONFIGS if args.split else INT8_CONFIGS if args.int8 else CONFIGS
    counters = split_counters(torch.device("cuda"))  # split products in a graph take counters made before it
    bandwidth = copy_bandwidth()
    report: dict[str, object] = {"copy_bandwidth_tb_s": bandwidth / 1e12}
    for name in args.shapes:
        n, k = SHAPES[name]
        nbytes = n * k * (1 if args.int8 else 2)
        copies = max(2, -(-(512 << 20) // nbytes))
        if args.int8:
            weights = [torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8) for _ in range(copies)]
            int8 = dict(scale=torch.full((n,), 2e-4, device="cuda", dtype=torch.bfloat16))
            cublas_weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                              for _ in range(max(2, -(-(512 << 20) // (2 * n * k))))]
        else:
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            int8, cublas_weights = {}, weights
        fusion = FUSIONS[name.split("_", 1)[1]]
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            g = torch.ones(k, device="cuda", dtype=torch.bfloat16)
            epilogue = dict(**int8, counters=counters, silu_mul="silu" in fusion,
                            residual=torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
                            if fusion == "residual" else None)
            def as_model(i: int, c: LaunchConfig) -> torch.Tensor:
                if "rms" in fusion:  # the norm kernel before the product, as the model runs it
                    return skinny_linear(rms_norm_triton(x, g, 1e-5), weights[i], config=c, **epilogue)
                return skinny_linear(x, weights[i], config=c, **epilogue)

            variants = {"plain": lambda i, c: skinny_linear(x, weights[i], config=c, counters=counters, **int8),
                        fusion: as_model}
            if args.wide:  # as the model runs them only, the default (16 rows a program) first
                variants.pop("plain")
            # cuBLAS on bf16 weights (with --int8 their bytes are twice the bandwidth figure's)
            results = {"cublas": graph_ms_per_call(lambda i: F.linear(x, cublas_weights[i]), len(cublas_weights))}
            # the configuration the model takes at these rows (--wide: the 16-row one, the bits' reference)
            default = launch_config(n, k, int8=args.int8, rows=1 if args.wide else rows)
            expected = variants[fusion](0, default) if args.wide else None
            same_bits: dict[str, bool] = {}  # --wide: label -> every row the default's bits
            block_of: dict[str, str] = {}  # --wide: label -> rows and warps a program
            wide = launch_config(n, k, int8=args.int8, rows=rows)  # --wide: marked "+"
            with_default = [default, *configs] if args.wide or args.split else configs
            for config, variant in itertools.product(with_default, variants):
                try:
                    ms = graph_ms_per_call(lambda i: variants[variant](i, config), copies)
                except Exception as error:  # noqa: BLE001 - a configuration that does not compile or fit
                    print(f"{name} rows={rows} {config}: {type(error).__name__}", file=sys.stderr)
                    continue
                label = f"{variant}_bn{config.block_n}_bk{config.block_k}_w{config.num_warps}_s{config.num_stages}"
                if config.block_m != default.block_m:
                    label += f"_bm{config.block_m}"
                if config.split_k > 1:
                    label += f"_sk{config.split_k}"
                label += "*" if config == default else "+" if args.wide and config == wide else ""
                if args.wide and variant == fusion:
                    same_bits[label] = torch.equal(variants[fusion](0, config), expected)
                    block_of[label] = f"bm{config.block_m}_w{config.num_warps}"
                results[label] = ms
            ranked = sorted(results.items(), key=lambda item: item[1])
            shown = ranked[:3] + [item for item in ranked[3:] if item[0].endswith(("*", "+"))]
            shown = shown if "cublas" in dict(shown) else shown + [("cublas", results["cublas"])]
            entry = {label: {"ms": round(ms * 1e3, 2) / 1e3, "bw": round(nbytes / (ms / 1e3) / bandwidth, 3)}
                     for label, ms in shown}
            best_fused = next(label for label, _ in ranked if label.startswith(fusion))
            entry["best_fused"] = {"label": best_fused, "ms": results[best_fused],
                                   "bw": round(nbytes / (results[best_fused] / 1e3) / bandwidth, 3)}
            entry["cublas"] = {"ms": results["cublas"], "bw": round(nbytes / (results["cublas"] / 1e3) / bandwidth, 3)}
            report[f"{name}_rows{rows}"] = entry
            print(f"{name} rows={rows}: " + ", ".join(f"{label} {v['bw']}" for label, v in entry.items()), flush=True)
            if args.wide:
                best_same = min((label for label in same_bits if same_bits[label]), key=results.get)
                entry.update(same_bits={label: same_bits.get(label) for label, _ in shown},
                             num_configs_same_bits=[sum(same_bits.values()), len(same_bits)],
                             same_bits_by_block={block: [sum(same_bits[label] for label in same_bits
                                                             if block_of[label] == block),
                                                         sum(b == block for b in block_of.values())]
                                                 for block in sorted(set(block_of.values()))},
                             best_same_bits={"label": best_same, "ms": results[best_same]},
                             all_ms={label: round(ms, 5) for label, ms in ranked})
                print(f"  same bits: {entry['same_bits']}; best of them {entry['best_same_bits']}", flush=True)
        weights = cublas_weights = None  # the copies freed before the next shape's
        torch.cuda.empty_cache()
    save_report("tune_linear", report, args.out)


if __name__ == "__main__":
    main()
