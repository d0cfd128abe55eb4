"""H200 benchmark of the target engine: random-weight Llama-3.1-8B shape, bf16, prompt 512, decode 256.

Ours (paged KV, Triton attention, CUDA graphs per bucket) vs HF transformers (static cache +
torch.compile) in the same run, against the weight-streaming floor. Writes bench/results/gpu_target.json.
Usage: python bench/gpu_target.py [--layer-kernels auto|fused|reference] [--skip-hf] [--profile] [--out PATH]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from engine.batch import StepInput, build_forward_batch  # noqa: E402
from report import save_report  # noqa: E402
from timing import cuda_ms  # noqa: E402
from engine.kv_cache import KVCacheConfig, KVPool  # noqa: E402
from engine.model_runner import ModelRunner, RuntimeConfig  # noqa: E402
from engine.model_source import LoadedModel  # noqa: E402
from engine.triton_attention import paged_attention_triton  # noqa: E402
from tiny_models import build_tokenizer  # noqa: E402

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0)
PROMPT, DECODE = 512, 256




def copy_bandwidth() -> float:
    src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_ms(lambda: dst.copy_(src), 10)
    return 2 * src.numel() / (ms / 1e3)  # read + write bytes per second


def wall_ms(fn, iters: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / iters


def engine_steps(runner: ModelRunner, batch_size: int, num_q: int, iters: int) -> float:
    """ms per step of `batch_size` sequences at prompt length, each feeding num_q tokens (rolled back)."""
    kvs = [runner.kv.new_sequence() for _ in range(batch_size)]
    for kv in kvs:
        runner.forward([StepInput(kv, [1] * PROMPT, 1)])
    tokens = [7] * num_q

    def step() -> None:
        logits = runner.forward([StepInput(kv, tokens, num_q) for kv in kvs])
        logits[-1].argmax(-1).tolist()  # the engine reads results back every step
        for kv in kvs:
            kv.truncate(kv.num_tokens - num_q + 1)  # keep one token per step: context grows like decode

    ms = wall_ms(step, iters)
    for kv in kvs:
        kv.release()
    return ms


def graph_replay_ms(runner: ModelRunner) -> float:
    """Device time of one bs1 decode replay alone (no host work): the rest of a step is overhead."""
    kv = runner.kv.new_sequence()
    runner.forward([StepInput(kv, [1] * PROMPT, 1)])
    runner.forward([StepInput(kv, [2], 1)])  # fills the bucket's buffers
    graph = runner.graphs._graphs[(1, 1)].graph
    ms = cuda_ms(graph.replay, 50)
    kv.release()
    return ms


def profile_replays(runner: ModelRunner) -> None:
    """Prints the kernels of bs1 decode (q=1) and verify (q=5) graph replays by total device time."""
    from torch.profiler import ProfilerActivity, profile

    kv = runner.kv.new_sequence()
    runner.forward([StepInput(kv, [1] * PROMPT, 1)])
    for q in (1, 5):
        runner.forward([StepInput(kv, [2] * q, q)])  # fills the bucket's buffers
        kv.truncate(PROMPT)
        graph = runner.graphs._graphs[(1, q)].graph
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                graph.replay()
            torch.cuda.synchronize()
        print(f"--- bs1 q={q}: 10 replays", flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70), flush=True)
    kv.release()


def kernel_decode_bw(bandwidth: float, batch_size: int = 32, context: int = 4096) -> dict[str, float]:
    heads, kv_heads, head_dim, block = 32, 8, 128, 16
    blocks_per_seq = context // block
    pool = KVPool(KVCacheConfig(batch_size * blocks_per_seq, block), 1, kv_heads, head_dim, torch.bfloat16,
                  torch.device("cuda"))
    kvs = [pool.new_sequence() for _ in range(batch_size)]
    for kv in kvs:
        kv.reserve(context)
        kv.commit(context - 1)
    batch = build_forward_batch([StepInput(kv, [0], 1) for kv in kvs], torch.device("cuda"))
    q = torch.randn(batch_size, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    ms = cuda_ms(lambda: paged_attention_triton(q, pool.k[0], pool.v[0], batch, head_dim**-0.5), 50)
    kv_bytes = 2 * batch_size * context * kv_heads * head_dim * 2
    k = torch.randn(batch_size, kv_heads, context, head_dim, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    qs = q[:, :, None, :]
    sdpa_ms = cuda_ms(lambda: F.scaled_dot_product_attention(qs, k, v, enable_gqa=True), 50)
    bs1_batch = build_forward_batch([StepInput(kvs[0], [0], 1)], torch.device("cuda"))
    bs1_ms = cuda_ms(lambda: paged_attention_triton(q[:1], pool.k[0], pool.v[0], bs1_batch, head_dim**-0.5), 50)
    return {"kernel_bw_fraction_decode_bs32_ctx4096": kv_bytes / (ms / 1e3) / bandwidth,
            "kernel_ms_decode_bs1_ctx4096": bs1_ms,
            "kernel_ms_decode_bs32_ctx4096": ms, "sdpa_ms_decode_bs32_ctx4096": sdpa_ms,
            "sdpa_bw_fraction_decode_bs32_ctx4096": kv_bytes / (sdpa_ms / 1e3) / bandwidth}


def hf_static_ms(model) -> float:
    ids = torch.randint(0, 1000, (1, PROMPT), device="cuda")
    gen = dict(do_sample=False, cache_implementation="static", min_new_tokens=DECODE)
    model.generate(ids, max_new_tokens=DECODE, **gen)  # compile + warm-up
    first = wall_ms(lambda: model.generate(ids, max_new_tokens=1, **gen), 2)
    total = wall_ms(lambda: model.generate(ids, max_new_tokens=DECODE, **gen), 2)
    return (total - first) / (DECODE - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--layer-kernels", choices=["auto", "fused", "reference"], default="fused",
                        help="the target's layer kernels (default: the target service's on CUDA)")
    parser.add_argument("--profile", action="store_true", help="print the kernels of a bs1 decode and verify replay")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_target.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA_8B), dtype=torch.bfloat16).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    started = time.perf_counter()
    runner = ModelRunner(
        RuntimeConfig(model="random-llama-3.1-8b-shape", device="cuda", dtype="bfloat16", max_model_len=8192,
                      kv_cache_tokens=40 * (PROMPT + DECODE + 16), layer_kernels=args.layer_kernels),
        loaded=LoadedModel("random-llama-3.1-8b-shape", hf, build_tokenizer()),
    )
    metrics: dict[str, float] = {"warmup_s": time.perf_counter() - started,
                                 "copy_bandwidth_tb_s": bandwidth / 1e12,
                                 "floor_ms_bs1": weight_bytes / bandwidth * 1e3}
    metrics["decode_ms_bs1"] = engine_steps(runner, 1, 1, DECODE)
    metrics["graph_replay_ms_bs1"] = graph_replay_ms(runner)
    metrics["host_overhead_ms_bs1"] = metrics["decode_ms_bs1"] - metrics["graph_replay_ms_bs1"]
    metrics["verify_ms_bs1_k4"] = engine_steps(runner, 1, 5, 100)
    metrics["verify_over_decode_bs1"] = metrics["verify_ms_bs1_k4"] / metrics["decode_ms_bs1"]
    for bs in (1, 8, 32):
        metrics[f"decode_tok_s_bs{bs}"] = bs / engine_steps(runner, bs, 1, 50) * 1e3
    for bs in (8, 32):
        metrics[f"verify_tok_s_bs{bs}"] = bs * 5 / engine_steps(runner, bs, 5, 50) * 1e3
    graphs, runner.graphs = runner.graphs, None  # the same step without graphs, for reference
    metrics["eager_decode_ms_bs1"] = engine_steps(runner, 1, 1, 20)
    runner.graphs = graphs
    metrics.update(kernel_decode_bw(bandwidth))
    if args.profile:
        profile_replays(runner)
    metrics["decode_over_floor_bs1"] = metrics["decode_ms_bs1"] / metrics["floor_ms_bs1"]
    if not args.skip_hf:
        del runner
        metrics["hf_static_ms_bs1"] = hf_static_ms(hf)
        metrics["speedup_vs_hf_static_bs1"] = metrics["hf_static_ms_bs1"] / metrics["decode_ms_bs1"]
    save_report("gpu_target", metrics, args.out)


if __name__ == "__main__":
    main()
