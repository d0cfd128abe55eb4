"""Probe: int8 weights times int8 activations on int8 tensor cores (W8A8) against the served W8A16 and bf16
products, on the Llama-3.2-1B shapes at 1 and 5 rows. GPU only. Writes bench/results/probe_w8a8.json."""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from engine.triton_linear import skinny_linear, split_counters  # noqa: E402
from report import save_report  # noqa: E402
from tune_linear import copy_bandwidth, graph_ms_per_call  # noqa: E402

SHAPES = {"1b_qkv": (3072, 2048), "1b_o": (2048, 2048), "1b_gate_up": (16384, 2048), "1b_down": (2048, 8192),
          "1b_head32k": (32768, 2048)}


@triton.jit
def _w8a8_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_per_split,
                 SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    row_tile, strip, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = strip * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows[:, None].to(tl.int64) * K
    w_cols = w_ptr + cols[:, None].to(tl.int64) * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    k_first = split * k_per_split
    for k0 in range(k_first, tl.minimum(K, k_first + k_per_split), BLOCK_K):
        k = k0 + offs_k
        w = tl.load(w_cols + k[None, :])
        a = tl.load(x_rows + k[None, :], mask=row_ok[:, None], other=0)
        acc += tl.dot(a, tl.trans(w), out_dtype=tl.int32)
    if SPLIT_K > 1:  # int32 partials: their sum is exact in any order
        tile_mask = row_ok[:, None] & col_ok[None, :]
        parts = part_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(parts + split * M * N, acc, mask=tile_mask)
        tl.debug_barrier()
        tile = row_tile * tl.num_programs(1) + strip
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        last = tl.zeros([BLOCK_M], dtype=tl.int32) + arrived == SPLIT_K - 1
        row_ok &= last
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        for s in range(SPLIT_K):
            acc += tl.load(parts + s * M * N, mask=tile_mask & last[:, None], other=0, cache_modifier=".cg")
        first_row = tl.arange(0, BLOCK_M) == 0
        tl.atomic_xchg(count_ptr + tile + tl.zeros([BLOCK_M], dtype=tl.int32), 0, mask=last & first_row)
    y = acc.to(tl.float32) * tl.load(sx_ptr + rows, mask=row_ok, other=0.0)[:, None]
    y *= tl.load(sw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], y.to(tl.bfloat16),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + row * K + k, mask=k < K, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / 127.0
    v = x / scale
    tl.store(q_ptr + row * K + k, (v + tl.where(v >= 0, 0.5, -0.5)).to(tl.int8), mask=k < K)
    tl.store(s_ptr + row, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    s = torch.empty((m,), dtype=torch.float32, device=x.device)
    _quantize_rows_kernel[(m,)](x, q, s, k, BLOCK_K=triton.next_power_of_2(k), num_warps=4)
    return q, s


def w8a8(xq, sx, w, sw, bn, bk, warps, stages, split, counters):
    m, k = xq.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=torch.bfloat16, device=xq.device)
    k_per_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    parts = torch.empty((split, m, n), dtype=torch.int32, device=xq.device) if split > 1 else out
    grid = (triton.cdiv(m, 16), triton.cdiv(n, bn), split)
    _w8a8_kernel[grid](xq, sx, w, sw, out, parts, counters, m, n, k, k_per_split, SPLIT_K=split, BLOCK_M=16,
                       BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return out


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
                try:
                    got = w8a8(xq, sx, qw[0], sw, bn, bk, warps, stages, split, counters).float()
                    res[label] = graph_ms_per_call(
                        lambda i: w8a8(xq, sx, qw[i], sw, bn, bk, warps, stages, split, counters), copies)
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
