"""Times the Triton paged-attention kernel (with its combine) over key-range lengths, step tiles and
launch configurations on decode and verify shapes (Llama-3.1-8B heads: 32 query / 8 KV heads,
head_dim 128, bf16, 16-token pages, block tables as wide as an 8192-token context, as in the
engine's graphs). Each configuration is timed as a CUDA graph of 20 calls, so host launches do not
count. `--draft`: Llama-3.2-1B heads (32 / 8, head_dim 64) and the draft's key ranges (split_len None,
which fill the GPU) over loop steps of 16-128 keys, at the contexts a draft sees. GPU only.
Usage: python bench/tune_attention.py [--draft] [--out bench/results/tune_attention.json]"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import engine.triton_attention as triton_attention  # noqa: E402
from engine.batch import StepInput, build_forward_batch  # noqa: E402
from engine.kv_cache import KVCacheConfig, KVPool  # noqa: E402
from report import save_report  # noqa: E402

MAX_MODEL_LEN, BLOCK = 8192, 16
SHAPES = [(1, 768, 1), (1, 4096, 1), (8, 768, 1), (32, 768, 1), (32, 4096, 1), (1, 768, 5), (8, 768, 5),
          (32, 768, 5)]  # (batch, context, queries per sequence)
# split_len (None: a range per program, filling the GPU), the fewest queries per step tile, block_n
CONFIGS = [(None, 1, 128), (128, 1, 128), (128, 8, 128), (256, 1, 128), (512, 1, 128)]
DRAFT_SHAPES = [(1, 192, 1), (1, 192, 2), (1, 768, 1), (1, 2048, 1), (1, 4096, 1), (8, 192, 1), (8, 768, 1),
                (8, 4096, 1), (32, 768, 1)]
DRAFT_CONFIGS = [(None, 1, 128), (None, 1, 64), (None, 1, 32), (None, 1, 16)]


def graph_us(fn, calls: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", action="store_true", help="the 1B draft's heads and key ranges")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    name = "tune_attention_draft" if args.draft else "tune_attention"
    out = args.out or ROOT / "bench" / "results" / f"{name}.json"
    shapes, configs = (DRAFT_SHAPES, DRAFT_CONFIGS) if args.draft else (SHAPES, CONFIGS)
    head_dim = 64 if args.draft else 128
    width = -(-(MAX_MODEL_LEN + 8) // BLOCK)
    rows, metrics = [], {}
    for batch_size, context, num_q in shapes:
        pool = KVPool(KVCacheConfig(batch_size * (context // BLOCK + 1) + 1, BLOCK), 1, 8, head_dim, torch.bfloat16,
                      torch.device("cuda"))
        pool.k[0].normal_()
        pool.v[0].normal_()
        kvs = [pool.new_sequence() for _ in range(batch_size)]
        for kv in kvs:
            kv.reserve(context)
            kv.commit(context - num_q)
        batch = build_forward_batch([StepInput(kv, [0] * num_q, num_q) for kv in kvs], torch.device("cuda"))
        tables = torch.zeros(batch_size, width, dtype=torch.int32, device="cuda")
        tables[:, : batch.block_tables.shape[1]] = batch.block_tables
        batch = dataclasses.replace(batch, block_tables=tables)
        q = torch.randn(batch_size * num_q, 32, head_dim, dtype=torch.bfloat16, device="cuda")
        kv_bytes = 2 * batch_size * context * 8 * head_dim * 2
        for split_len, step_tile, block_n in configs:
            triton_attention.STEP_BLOCK_Q = step_tile
            us = graph_us(lambda: triton_attention.paged_attention_triton(
                q, pool.k[0], pool.v[0], batch, 0.088, block_n=block_n, split_len=split_len))
            rows.append(dict(batch=batch_size, context=context, num_q=num_q, split_len=split_len, step_tile=step_tile,
                             block_n=block_n, us=round(us, 2), tb_s=round(kv_bytes / us / 1e6, 3)))
            metrics[f"us_bs{batch_size}_ctx{context}_q{num_q}_split{split_len}_tile{step_tile}_n{block_n}"] = us
            print(rows[-1], flush=True)
    for split_len, step_tile, block_n in configs:
        print(f"split {split_len!s:>4} tile {step_tile} block_n {block_n:3d}: " + "  ".join(
            f"{r['us']:7.1f}" for r in rows if (r["split_len"], r["step_tile"], r["block_n"]) ==
            (split_len, step_tile, block_n)))
    print("shapes:", shapes)
    save_report(name, metrics, out, rows=rows)


if __name__ == "__main__":
    main()
