"""Times the Triton paged-attention kernel over launch configurations on decode and verify shapes
(Llama-3.1-8B heads: 32 query / 8 KV heads, head_dim 128, bf16, 16-token pages). GPU only.
Usage: python bench/tune_attention.py"""
from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.batch import StepInput, build_forward_batch  # noqa: E402
from timing import cuda_ms  # noqa: E402
from engine.kv_cache import KVCacheConfig, KVPool  # noqa: E402
from engine.triton_attention import paged_attention_triton  # noqa: E402




def main() -> None:
    results = []
    for batch_size, context, num_q in [(1, 512, 1), (1, 4096, 1), (32, 4096, 1), (8, 1024, 5), (32, 1024, 5)]:
        pool = KVPool(KVCacheConfig(batch_size * (context // 16 + 1), 16), 1, 8, 128, torch.bfloat16,
                      torch.device("cuda"))
        kvs = [pool.new_sequence() for _ in range(batch_size)]
        for kv in kvs:
            kv.reserve(context)
            kv.commit(context - num_q)
        batch = build_forward_batch([StepInput(kv, [0] * num_q, num_q) for kv in kvs], torch.device("cuda"))
        q = torch.randn(batch_size * num_q, 32, 128, dtype=torch.bfloat16, device="cuda")
        kv_bytes = 2 * batch_size * context * 8 * 128 * 2
        for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3)):
            try:
                ms = cuda_ms(lambda: paged_attention_triton(q, pool.k[0], pool.v[0], batch, 0.088, block_n, warps, stages))
            except Exception as e:  # e.g. out of shared memory
                print(f"skip {block_n=} {warps=} {stages=}: {type(e).__name__}")
                continue
            results.append(dict(batch=batch_size, context=context, num_q=num_q, block_n=block_n, warps=warps,
                                stages=stages, ms=round(ms, 4), tb_s=round(kv_bytes / ms / 1e9, 3)))
    for shape in {(r["batch"], r["context"], r["num_q"]) for r in results}:
        best = sorted((r for r in results if (r["batch"], r["context"], r["num_q"]) == shape), key=lambda r: r["ms"])
        print(shape, "best:", best[0], "| default (64,4,2):",
              next((r for r in best if (r["block_n"], r["warps"], r["stages"]) == (64, 4, 2)), None))
    Path(sys.argv[1] if len(sys.argv) > 1 else "tune_attention.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
