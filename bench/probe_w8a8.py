"""Probe: int8 weights times int8 activations on int8 tensor cores (W8A8: engine/triton_linear.py's
`x_scale`) against the served W8A16 and bf16 products, on the Llama-3.2-1B shapes at 1 and 5 rows, over a
sweep of launch configurations; and the row quantization kernel (engine/triton_quant.py). GPU only.
Writes bench/results/probe_w8a8.json (the committed run, 2026-12-04 03:40 UTC, times the engine's kernels;
the first, at commit ccc7cad, timed a standalone copy of them and agrees within ~1 %)."""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from engine.triton_linear import LaunchConfig, skinny_linear, split_counters  # noqa: E402
from engine.triton_quant import quantize_rows  # noqa: E402
from report import save_report  # noqa: E402
from tune_linear import copy_bandwidth, graph_ms_per_call  # noqa: E402

SHAPES = {"1b_qkv": (3072, 2048), "1b_o": (2048, 2048), "1b_gate_up": (16384, 2048), "1b_down": (2048, 8192),
          "1b_head32k": (32768, 2048)}


def main() -> None:
    bandwidth = copy_bandwidth()
    report: dict[str, object] = {"copy_bandwidth_tb_s": bandwidth / 1e12}
    counters = split_counters(torch.device("cuda"))
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-(512 << 20) // (n * k)))
        qw = [torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8) for _ in range(copies)]
        sw = torch.full((n,), 2e-4, device="cuda", dtype=torch.bfloat16)
        bcopies = max(2, -(-(512 << 20) // (2 * n * k)))
        bw16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(bcopies)]
        for rows in (1, 5):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            xq, sx = quantize_rows(x)
            want = (x.float() @ (qw[0].float() * sw.float()[:, None]).t())
            res: dict[str, float] = {
                "bf16_served": graph_ms_per_call(lambda i: skinny_linear(x, bw16[i], counters=counters), bcopies),
                "w8a16_served": graph_ms_per_call(lambda i: skinny_linear(x, qw[i], scale=sw, counters=counters),
                                                  copies),
                "quantize_rows": graph_ms_per_call(lambda i: quantize_rows(x), 64),
            }
            err = {}
            splits = (1, 2, 4) if k >= 8192 else (1, 2) if n <= 4096 else (1,)
            for bn, bk, (warps, stages), split in itertools.product((16, 32, 64), (256, 512),
                                                                    ((2, 4), (4, 3), (4, 4)), splits):
                if k % (bk * split):
                    continue
                label = f"w8a8_bn{bn}_bk{bk}_w{warps}_s{stages}_k{split}"
                config = LaunchConfig(bn, bk, warps, stages, split_k=split)

                def w8a8(i: int) -> torch.Tensor:
                    return skinny_linear(xq, qw[i], scale=sw, x_scale=sx, out_dtype=torch.bfloat16, config=config,
                                         counters=counters)
                try:
                    got = w8a8(0).float()
                    res[label] = graph_ms_per_call(w8a8, copies)
                    err[label] = float(((got - want).norm() / want.norm()).item())
                except Exception as error:  # noqa: BLE001
                    print(f"{name} {label}: {type(error).__name__}: {str(error)[:120]}", flush=True)
            ranked = sorted((v, key) for key, v in res.items() if key.startswith("w8a8"))
            entry = {key: round(v * 1e3, 2) for key, v in res.items() if not key.startswith("w8a8")}
            entry.update({key: round(v * 1e3, 2) for v, key in ranked[:5]})
            entry["best_w8a8_rel_err"] = err[ranked[0][1]]
            entry["best_w8a8_int8_tb_s"] = round(n * k / (ranked[0][0] / 1e3) / 1e12, 2)
            entry["w8a16_int8_tb_s"] = round(n * k / (res["w8a16_served"] / 1e3) / 1e12, 2)
            report[f"{name}_rows{rows}"] = entry
            print(name, rows, entry, flush=True)
        qw = bw16 = None
        torch.cuda.empty_cache()
    save_report("probe_w8a8", report, ROOT / "bench" / "results" / "probe_w8a8.json")


if __name__ == "__main__":
    main()
