"""Our compact model over paged KV computes what the Hugging Face model computes."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import fused_stages, triton_rope
from engine.batch import StepInput
from engine.linear import CpuLinear, Int8Linear, dequantize_int8, quantize_rows_reference
from engine.llama import LayerStages, ModelShape, pre_attention
from engine.model_runner import ModelRunner, RuntimeConfig
from engine.model_source import LoadedModel
from tiny_models import build_model_dir, build_reduced_head_draft


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tmp_path_factory, tokenizer):
    return build_model_dir(tmp_path_factory.mktemp(request.param), tokenizer, seed=7, model_type=request.param)


def _hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_prefill_logits_match_hf(model_dir):
    runner = ModelRunner(RuntimeConfig(model=str(model_dir), kv_cache_tokens=256, kv_block_size=4))
    ids = list(range(3, 40))
    [logits] = runner.forward([StepInput(runner.kv.new_sequence(), ids, num_logits=len(ids))])
    torch.testing.assert_close(logits, _hf_logits(model_dir, ids), atol=1e-4, rtol=1e-4)


def test_incremental_steps_after_rollback_match_hf(model_dir):
    """Prefill, a 4-token verify-shaped step, truncate 2 back, then continue: same logits as HF."""
    runner = ModelRunner(RuntimeConfig(model=str(model_dir), kv_cache_tokens=256, kv_block_size=4))
    kv = runner.kv.new_sequence()
    ids = list(range(10, 25))
    runner.forward([StepInput(kv, ids[:9], num_logits=1)])
    runner.forward([StepInput(kv, [99, 98, 97, 96], num_logits=4)])  # later rolled back
    kv.truncate(9)
    [logits] = runner.forward([StepInput(kv, ids[9:], num_logits=len(ids) - 9)])
    torch.testing.assert_close(logits, _hf_logits(model_dir, ids)[9:], atol=1e-4, rtol=1e-4)


def test_varlen_batch_equals_sequences_run_alone(model_dir):
    runner = ModelRunner(RuntimeConfig(model=str(model_dir), kv_cache_tokens=512, kv_block_size=4))
    prompts = [list(range(5, 5 + n)) for n in (1, 7, 16, 3)]
    alone = [runner.forward([StepInput(runner.kv.new_sequence(), p, num_logits=2 if len(p) > 1 else 1)])[0]
             for p in prompts]
    together = runner.forward([StepInput(runner.kv.new_sequence(), p, num_logits=2 if len(p) > 1 else 1)
                               for p in prompts])
    for a, b in zip(alone, together):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_greedy_forward_reads_back_every_steps_argmax_at_once(model_dir):
    runner = ModelRunner(RuntimeConfig(model=str(model_dir), kv_cache_tokens=512, kv_block_size=4))
    prompts = [list(range(5, 5 + n)) for n in (1, 7, 16, 3)]
    num_logits = [1, 3, 0, 2]  # a chunk with no logits among them
    steps = [StepInput(runner.kv.new_sequence(), p, n) for p, n in zip(prompts, num_logits)]
    logits, greedy = runner.forward_greedy(steps)
    ids = greedy.get()
    assert ids == [rows.argmax(-1).tolist() for rows in logits]
    assert [len(i) for i in ids] == num_logits and all(type(t) is int for i in ids for t in i)
    [none], no_greedy = runner.forward_greedy([StepInput(steps[2].kv, [9, 10], 0)])
    [no_ids] = no_greedy.get()
    assert none.shape[0] == 0 and no_ids == []


@pytest.mark.parametrize("kernels", ["fused", "layer"])  # layer: a decoder layer one kernel (engine/triton_layer.py)
def test_fused_layer_kernels_compute_the_reference_logits(model_dir, kernels):
    """engine/fused_stages (Triton, interpreted on CPU) on a decode and a verify step; prefill (more
    rows than a kernel tile) takes the reference stages in both runners."""
    reference, fused = (_decode_and_verify_logits(model_dir, name) for name in ("reference", kernels))
    torch.testing.assert_close(fused, reference, atol=1e-4, rtol=1e-4)


def test_the_qkv_product_with_rotary_in_its_epilogue_gives_the_same_logits(model_dir, monkeypatch):
    """engine/fused_stages.QKV_ROPE: the QKV product, the rotation and the cache write in one kernel
    (engine/triton_rope.qkv_rope_and_write_kv) give the fused stages' logits, the same values."""
    apart = _decode_and_verify_logits(model_dir, "fused")
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return triton_rope.qkv_rope_and_write_kv(*args, **kwargs)

    monkeypatch.setattr(fused_stages, "QKV_ROPE", True)
    monkeypatch.setattr(fused_stages, "qkv_rope_and_write_kv", counted)
    together = _decode_and_verify_logits(model_dir, "fused")
    assert calls and set(calls) == {1, 5}  # every layer's decode and verify took it; the prefill did not
    assert torch.equal(together, apart)


def _decode_and_verify_logits(model_dir, layer_kernels: str, num_prefill: int = 24, loaded: LoadedModel | None = None,
                              prepare: Callable[[ModelRunner], object] | None = None, **config: object) -> torch.Tensor:
    """A prefill, then the logits of a decode step and a 5-token verify step (`loaded`: this model
    instead of model_dir's; `prepare`: called with the runner before the forwards)."""
    runner = ModelRunner(RuntimeConfig(model=str(model_dir), kv_cache_tokens=256, kv_block_size=4,
                                       layer_kernels=layer_kernels, attention_backend="reference", **config), loaded)
    if prepare is not None:
        prepare(runner)
    ids = list(range(10, 16 + num_prefill))
    kv = runner.kv.new_sequence()
    [prefill] = runner.forward([StepInput(kv, ids[:num_prefill], num_logits=1)])
    [decode] = runner.forward([StepInput(kv, ids[num_prefill:num_prefill + 1], num_logits=1)])
    [verify] = runner.forward([StepInput(kv, ids[num_prefill + 1:], num_logits=len(ids) - num_prefill - 1)])
    return torch.cat([prefill, decode, verify])


def test_fused_kernels_serve_a_draft_with_a_reduced_lm_head(tmp_path, tokenizer):
    """A distilled draft keeps only some rows of its LM head (engine/subset_head.py, like the shipped
    draft): the fused stages' head computes those rows and leaves -inf elsewhere, as the reference does."""
    target = build_model_dir(tmp_path / "target", tokenizer, seed=7)
    draft = build_reduced_head_draft(tmp_path / "draft", target)
    reference, fused = (_decode_and_verify_logits(draft, kernels) for kernels in ("reference", "fused"))
    kept = torch.isfinite(reference)
    assert kept[:, ::2].all() and not kept[:, 1::2].any()  # the draft keeps every second row
    assert torch.equal(torch.isfinite(fused), kept)
    torch.testing.assert_close(fused[kept], reference[kept], atol=1e-4, rtol=1e-4)


def _with_dequantized_int8_weights(model_dir, tokenizer) -> LoadedModel:
    """model_dir's model in float32, each linear's weight its int8 rows times their scales."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for module in hf.modules():
        if isinstance(module, torch.nn.Linear):
            quantized = Int8Linear(module)
            module.weight.data = dequantize_int8(quantized.qweight, quantized.scale, torch.float32)
    return LoadedModel(str(model_dir), hf, tokenizer)


def test_an_int8_draft_through_the_fused_kernels_computes_its_dequantized_weights_logits(model_dir, tokenizer):
    """--quantize int8 (engine/linear.Int8Linear) under the fused kernels, every step of at most a
    kernel tile of rows (all fused): the logits of the model whose linears hold the dequantized int8
    rows, computed by the reference stages."""
    fused = _decode_and_verify_logits(model_dir, "fused", num_prefill=12, quantize="int8")
    expected = _decode_and_verify_logits(model_dir, "reference", num_prefill=12,
                                         loaded=_with_dequantized_int8_weights(model_dir, tokenizer))
    assert not torch.allclose(expected, _decode_and_verify_logits(model_dir, "reference", num_prefill=12), atol=1e-3)
    torch.testing.assert_close(fused, expected, atol=1e-4, rtol=1e-4)


def test_a_w8a8_draft_through_the_fused_kernels_computes_the_logits_of_its_int8_rows(model_dir, tokenizer):
    """--quantize w8a8: every linear int8, and the fused kernels take each product's input as int8 rows
    too (the norm kernels quantize theirs, attention's and gate/up's outputs a kernel of their own). The
    logits are those of the reference stages over the dequantized weights with each linear's input
    rounded to its int8 rows (engine.linear.quantize_rows_reference); not those of weight-only int8."""
    fused = _decode_and_verify_logits(model_dir, "fused", num_prefill=12, quantize="w8a8")

    def round_inputs(runner: ModelRunner) -> None:
        def rounded(_module, args):
            q, scales = quantize_rows_reference(args[0].reshape(-1, args[0].shape[-1]))
            return ((q.float() * scales[:, None]).view(args[0].shape),)
        linears = [m for m in runner.model.modules() if isinstance(m, torch.nn.Linear | CpuLinear)]
        assert linears
        for module in linears:
            module.register_forward_pre_hook(rounded)

    expected = _decode_and_verify_logits(model_dir, "reference", num_prefill=12, prepare=round_inputs,
                                         loaded=_with_dequantized_int8_weights(model_dir, tokenizer))
    torch.testing.assert_close(fused, expected, atol=1e-4, rtol=1e-4)
    weight_only = _decode_and_verify_logits(model_dir, "fused", num_prefill=12, quantize="int8")
    assert not torch.allclose(fused, weight_only, atol=1e-3)


def test_compiled_stages_serve_more_model_shapes_than_dynamos_default_limit_in_one_process():
    """A draft service holds several drafts and swaps them live: each model shape adds its own entries
    to the compiled stages' one cache (torch.compile, real inductor on CPU), past dynamo's default 8."""
    stages, head_dim = LayerStages().compiled(), 8
    for heads in range(2, 12):  # ten shapes, each a compile of its own
        shape = ModelShape(num_layers=1, num_heads=heads, num_kv_heads=1, head_dim=head_dim, vocab_size=10)
        qkv = torch.nn.Linear(heads * head_dim, (heads + 2) * head_dim, bias=False)
        hidden, cos, sin = torch.randn(3, heads * head_dim), torch.randn(3, head_dim), torch.randn(3, head_dim)
        q, k, v = stages.pre_attention(hidden, torch.ones(heads * head_dim), qkv, cos, sin, shape, 1e-5)
        expected = pre_attention(hidden, torch.ones(heads * head_dim), qkv, cos, sin, shape, 1e-5)
        for got, want in zip((q, k, v), expected):
            torch.testing.assert_close(got, want)
