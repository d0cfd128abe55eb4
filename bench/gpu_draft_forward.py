"""H200 A/B of the draft forward's levers, one process: a random-weight Llama-3.2-1B shape, bf16
activations, prompt 512 (--prompt), the draft service's layer kernels (auto).

Each variant builds the runner afresh (its graphs captured with the setting) and gives the device
time of a batch-1 decode replay (q = 1) and the wall time of a k = 4 greedy proposal through the
draft's captured loop at batch 1 and 8 (host sync included). The levers:
  * int8    weight-only int8 for the wide products (--quantize int8; `int8all`: every product);
            `w8a8` every product int8 with int8 activations (--quantize w8a8)
  * 32k     an LM head of 32 768 vocabulary rows (engine/subset_head.py, as distilled drafts keep)
  * pdl     programmatic dependent launch (engine/pdl.py)
  * pfN     with pdl, each product's program asks L2 for N KB of its weights before its wait
            (engine/triton_prefetch.py; none unless named: `pf0` and `pf16` A/B it)
  * splitN  narrow products of a long K split in N K ranges (engine/triton_linear.SPLIT_K; `split1`
            or none: not split); `mink2048`: every narrow product (SPLIT_K_MIN_K), not only the
            down projections
  * qkvrope the QKV product with rotary and the cache write in its epilogue (engine/fused_stages.QKV_ROPE;
            not in the default list: `--variants int8_32k_pdl_split4 int8_32k_pdl_split4_qkvrope` A/Bs it)
  * refstep the draft loop's between-step inputs by torch ops (draft_loop.advance_step_reference), not
            its one Triton kernel (engine/triton_draft_step.py): A/Bs that kernel
  * fullpick the loop's greedy pick as an argmax of vocabulary-wide logits, not the reduced head's own
            (LayerStages.greedy_ids): A/Bs that pick
  * attnN   attention's key ranges a tile at most (engine/triton_attention.MAX_FILL_SPLITS, default 16):
            `attn1` never splits, so no combine kernel runs (a draft's attention is not batch-invariant,
            so its split is free to choose); with a short --prompt, A/Bs the combine's cost
  * abnN, awN, asN  the draft attention kernel's keys a tile, warps and pipeline stages (defaults 128,
            4, 3: engine/triton_attention.paged_attention_triton); a draft's attention need not be
            batch-invariant, so any of them may serve
  * layer    a decoder layer one persistent kernel (engine/triton_layer.py, --layer-kernels layer);
            `layerstaged` the same stages each a launch of its own (no grid barriers); `lpN`, `lwN`, `lsN`
            its programs an SM at most, warps and pipeline stages (engine/triton_layer.py's defaults)
Timing bounds, not levers (their outputs are wrong): `skipnorm` replaces the fused steps' RMS norms
by the identity (no kernel), `skipattn` attention and its combine by the queries: what a forward
would save if those kernels cost nothing on its critical path. `skipnormnp`: as skipnorm, and the
kernel after each skipped norm launched without PDL (it starts when its predecessor has finished, not
beside it): what folding the norms into the products that follow them could save.
For the first and the last variant, a kernel census of one decode replay (torch.profiler): kernels,
the sum of their durations against the replay's time (the rest is gaps between kernels), and the
costliest. Also whether each variant's decode logits pick the same top token as
the plain variant of its weights and whether they are the same bits. Writes bench/results/gpu_draft_forward.json.
Usage: python bench/gpu_draft_forward.py [--variants NAME ...] [--prompt 512] [--out PATH]
"""
from __future__ import annotations

import argparse
import functools
import gc
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

from engine import model_runner  # noqa: E402
from engine import (draft_loop, fused_stages, pdl, triton_attention, triton_draft_step, triton_layer,  # noqa: E402
                    triton_linear, triton_prefetch)
from engine.batch import StepInput  # noqa: E402
from engine.cuda_graphs import GraphConfig  # noqa: E402
from engine.model_runner import ModelRunner, RuntimeConfig  # noqa: E402
from engine.model_source import LoadedModel  # noqa: E402
from engine.subset_head import SubsetLMHead  # noqa: E402
from gpu_e2e import LLAMA_1B  # noqa: E402
from report import save_report  # noqa: E402
from timing import cuda_ms, decode_logits, idle_launch_ms, kernel_census, prefilled_sequences, proposal_ms  # noqa: E402
from tiny_models import build_tokenizer  # noqa: E402

PROMPT = 512
HEAD_ROWS = 32768
NUM_LOGIT_POSITIONS = 32
VARIANTS = ["bf16", "bf16_split4", "bf16_pdl_split4", "int8_32k", "int8_32k_split4", "int8_32k_pdl_split4",
            "int8all_32k_pdl_split4", "int8all_32k_pdl_split2", "int8all_32k_pdl_split8",
            "int8all_32k_pdl_split4_mink2048", "bf16_2", "int8all_32k_pdl_split4_2"]
MIN_INT8_OUT = model_runner.CUDA_MIN_INT8_OUT_FEATURES
MAX_FILL_SPLITS = triton_attention.MAX_FILL_SPLITS


def settings(name: str) -> dict:
    parts = name.removesuffix("_2").split("_")
    split = next((int(p.removeprefix("split")) for p in parts if p.startswith("split")), 1)
    attention_splits = next((int(p.removeprefix("attn")) for p in parts if p.startswith("attn")), MAX_FILL_SPLITS)
    return {
        "quantize": "w8a8" if parts[0] == "w8a8" else "int8" if parts[0].startswith("int8") else "none",
        "min_int8_out": 0 if parts[0] == "int8all" else MIN_INT8_OUT,
        "head_rows": HEAD_ROWS if "32k" in parts else None,
        "pdl": "pdl" in parts,
        "prefetch_kb": next((int(p.removeprefix("pf")) for p in parts if p.startswith("pf") and p[2:].isdigit()), 0),
        "split_k": split,
        "split_k_min_k": 2048 if "mink2048" in parts else 8192,
        "qkv_rope": "qkvrope" in parts,
        "reference_step": "refstep" in parts,
        "full_pick": "fullpick" in parts,
        "attention_splits": attention_splits,
        "attention_launch": {key: int(p.removeprefix(prefix)) for prefix, key in
                             (("abn", "block_n"), ("aw", "num_warps"), ("as", "num_stages"))
                             for p in parts if p.startswith(prefix) and p.removeprefix(prefix).isdigit()},
        "layer_kernel": "layer" in parts or "layerstaged" in parts,
        "layer_staged": "layerstaged" in parts,
        "layer_launch": {key: int(p.removeprefix(prefix)) for prefix, key in
                         (("lp", "PROGRAMS_PER_SM"), ("lw", "NUM_WARPS"), ("ls", "NUM_STAGES"))
                         for p in parts if p.startswith(prefix) and p.removeprefix(prefix).isdigit()},
        "skip_norm": "skipnorm" in parts,
        "no_pdl_after_norm": "skipnormnp" in parts,
        "skip_attention": "skipattn" in parts,
    }


def build(hf, setting: dict) -> ModelRunner:
    pdl.ENABLED = setting["pdl"]
    triton_prefetch.PREFETCH_KB = setting["prefetch_kb"]  # read at each launch, so at capture
    fused_stages.QKV_ROPE = setting["qkv_rope"]
    triton_linear.SPLIT_K, triton_linear.SPLIT_K_MIN_K = setting["split_k"], setting["split_k_min_k"]
    model_runner.CUDA_MIN_INT8_OUT_FEATURES = setting["min_int8_out"]
    triton_attention.MAX_FILL_SPLITS = setting["attention_splits"]  # read at each launch, so at capture
    full_head = hf.lm_head
    if setting["head_rows"]:  # a fresh one: quantizing replaces the head's own rows
        hf.lm_head = SubsetLMHead(full_head.weight, torch.arange(setting["head_rows"]))
    try:
        runner = ModelRunner(
            RuntimeConfig(model="random-1b", device="cuda", dtype="bfloat16", max_model_len=2048,
                          kv_cache_tokens=16 * 2048, quantize=setting["quantize"],
                          layer_kernels="layer" if setting["layer_kernel"] else "auto"),
            loaded=LoadedModel("random-1b", hf, build_tokenizer()),
        )
    finally:
        hf.lm_head = full_head
    if setting["full_pick"]:  # this runner's stages only: the instance attribute shadows the method
        stages = runner.model.stages
        stages.greedy_ids = lambda model, hidden: stages.logits(model, hidden).argmax(-1)
    return runner


def measure(hf, setting: dict, census: bool, prompt: int) -> tuple[dict[str, float], torch.Tensor, dict]:
    norm, attention_backend, layer = fused_stages.rms_norm_triton, model_runner._attention_backend, fused_stages.layer_forward
    launch_options = pdl.launch_options
    if setting["layer_staged"]:  # each stage of the layer kernel a launch of its own: no grid barriers
        fused_stages.layer_forward = functools.partial(layer, staged=True)
    launch = {key: getattr(triton_layer, key) for key in setting["layer_launch"]}
    for key, value in setting["layer_launch"].items():  # read at each launch, so at capture
        setattr(triton_layer, key, value)
    if setting["skip_norm"]:  # timing bounds (the module doc), read as graphs are captured
        fused_stages.rms_norm_triton = lambda hidden, weight, eps: hidden
    elif setting["no_pdl_after_norm"]:
        fused_stages.rms_norm_triton = functools.partial(_skipped_norm, after_norm := [False])
        pdl.launch_options = functools.partial(_options_after_norm, after_norm, launch_options)
    if setting["skip_attention"]:
        model_runner._attention_backend = lambda *args: lambda q, k_cache, v_cache, batch, scale: q
    elif setting["attention_launch"]:
        model_runner._attention_backend = lambda *args: functools.partial(attention_backend(*args),
                                                                          **setting["attention_launch"])
    try:
        return _measure(hf, setting, census, prompt)
    finally:
        fused_stages.rms_norm_triton, model_runner._attention_backend = norm, attention_backend
        fused_stages.layer_forward, pdl.launch_options = layer, launch_options
        for key, value in launch.items():
            setattr(triton_layer, key, value)


def _skipped_norm(after_norm: list[bool], hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    after_norm[0] = True  # the next kernel launched is the product the norm fed
    return hidden


def _options_after_norm(after_norm: list[bool], launch_options, device: torch.device) -> dict[str, bool]:
    if after_norm[0]:
        after_norm[0] = False
        return {"USE_PDL": False}
    return launch_options(device)


def _measure(hf, setting: dict, census: bool, prompt: int) -> tuple[dict[str, float], torch.Tensor, dict]:
    runner = build(hf, setting)
    gen = torch.Generator().manual_seed(0)
    seqs = prefilled_sequences(runner, gen, 8, prompt)
    kv = seqs[0]
    runner.forward([StepInput(kv, [100], 1)])  # fills the bucket's buffers
    kv.truncate(prompt)
    replay = runner.graphs._graphs[(1, 1)].graph.replay
    metrics = {"replay_ms_q1": cuda_ms(replay, 200)}
    # one graph of k forwards, or k graphs of one launched in turn: does a big graph's launch stall the device?
    metrics["launch_host_ms_q1"], metrics["idle_replay_ms_q1"] = idle_launch_ms(replay)
    metrics["launch_host_ms_4x_q1"], metrics["idle_replay_ms_4x_q1"] = idle_launch_ms(lambda: [replay() for _ in range(4)])
    kernels = kernel_census(replay) if census else {}
    logits = decode_logits(runner, kv, gen, NUM_LOGIT_POSITIONS, prompt)
    fused_step = triton_draft_step.advance_step
    if setting["reference_step"]:  # read when the loop is built (engine/draft_loop.py)
        triton_draft_step.advance_step = draft_loop.advance_step_reference
    try:
        metrics.update(proposal_ms(runner, seqs, prompt))
    finally:
        triton_draft_step.advance_step = fused_step
    for s in seqs:
        s.release()
    return metrics, logits, kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=VARIANTS)
    parser.add_argument("--prompt", type=int, default=PROMPT, help="tokens of context before the timed steps")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_draft_forward.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    # the decode and proposal buckets only: capture in seconds, not minutes
    torch._dynamo.config.recompile_limit = 1024  # each runner's compiled stages guard on its own weights
    torch._dynamo.config.accumulated_recompile_limit = 4096
    model_runner.GraphConfig = lambda: GraphConfig(batch_buckets=(1, 8), query_buckets=(1, 2, 5))
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA_1B), dtype=torch.bfloat16).eval()
    metrics: dict[str, float] = {"prompt": args.prompt}
    logits: dict[str, torch.Tensor] = {}
    censuses: dict[str, dict] = {}
    for i, name in enumerate(args.variants):
        setting = settings(name)
        result, logits[name], census = measure(hf, setting, census=i in (0, len(args.variants) - 1), prompt=args.prompt)
        gc.collect()
        torch.cuda.empty_cache()
        for key, value in result.items():
            metrics[f"{name}:{key}"] = value
        if census:
            censuses[name] = census
        print(name, setting, result, census, flush=True)
        # saved after every variant: a call cut short keeps what it measured
        save_report("gpu_draft_forward", {**metrics, **_closeness(logits)}, args.out, kernel_census=censuses)


def _closeness(logits: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each variant's decode logits against the first variant measured with the same weights."""
    out = {}
    for name, value in logits.items():
        base = next(b for b in logits if _weights(b) == _weights(name))
        if base == name:
            continue
        a = logits[base]
        out[f"{name}:top1_agreement_vs_{base}"] = (a.argmax(-1) == value.argmax(-1)).float().mean().item()
        out[f"{name}:same_bits_as_{base}"] = float(torch.equal(a, value))
    return out


def _weights(name: str) -> tuple:
    setting = settings(name)
    return setting["quantize"], setting["min_int8_out"], setting["head_rows"]


if __name__ == "__main__":
    main()
