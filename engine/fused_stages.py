"""A layer's stages as a handful of Triton kernels, for the decode and verify steps of CUDA graphs.

Per layer, seven kernels around attention instead of a dozen:

  x        = rms_norm(hidden)                           (engine/triton_norm.py)
  qkv      = skinny_linear(x)                           (engine/triton_linear.py)
  q        = rope_and_write_kv(qkv)                     (engine/triton_rope.py: rotary + cache write;
                                                         with QKV_ROPE both in the product's epilogue)
  attn     = attention(q, cache)
  hidden  += skinny_linear(attn)                        (o_proj, residual fused)
  x        = rms_norm(hidden)
  hidden  += skinny_linear(silu_mul(skinny_linear(x)))  (gate/up with the activation fused, then
                                                         down_proj with the residual fused)

and the LM head as two more (final norm, product; a draft's reduced head, engine/subset_head.py,
its rows' product placed into the vocabulary). A draft's int8 linears (--quantize int8,
engine/linear.Int8Linear) go through the same kernels, which read their int8 rows; with int8
activations too (--quantize w8a8) each product's input arrives as int8 rows and their scales, from
the norm kernel before it or, after attention and gate/up, from a kernel of its own
(engine/triton_quant.py): two kernels a layer more, every product on int8 tensor cores. These kernels
compute a row as if it were alone, and with them the engine fixes attention's key ranges
(engine/triton_attention.py), so a token's logits are the same bits in a decode, a verify, or any
batch around it.

Which steps: on CUDA, those captured into graphs (decode, verify, the draft's proposal loop),
where a kernel costs no host launch; prefill chunks (many rows, compute-bound; replaying their
prefill graphs, or eager past the largest) take the fallback stages around cuBLAS
(engine/kernel_stages.py, or torch.compile'd PyTorch). `max_rows` (--layer-kernels auto) keeps
larger graph steps on the fallback too: the skinny products read W once per 16 rows, so past 16
rows cuBLAS wins (H200: verify tok/s at batch 8/32 (40/160 rows) 4401/6170 in
bench/results/gpu_target_fused.json, 6554/21512 on cuBLAS in gpu_target_reference.json) and only
batch invariance argues for them. On CPU (the interpreter, for tests) steps of up to `CPU_MAX_ROWS`
rows.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from engine.batch import ForwardBatch
from engine.linear import int8_activations, weight_and_scale
from engine.llama import AttentionFn, CausalLM, DecoderLayer, Rotary, Stages
from engine.subset_head import SubsetLMHead
from engine.triton_layer import check_every_sm_is_ours, layer_barrier, layer_forward, layer_supported
from engine.triton_linear import skinny_linear, split_counters
from engine.triton_norm import rms_norm_triton
from engine.triton_quant import quantize_rows
from engine.triton_rope import qkv_rope_and_write_kv, qkv_rope_block_n, rope_and_write_kv

CPU_MAX_ROWS = 16
# The QKV product with rotary and the cache write in its epilogue (engine/triton_rope.py): one kernel a
# layer fewer, the same values; SPECDEC_QKV_ROPE=0 turns it off. On the H200 a 1B decode replay
# 0.830 -> 0.786 ms, a k = 4 proposal 3.93 -> 3.74 ms (bench/results/gpu_draft_forward_qkv_rope.json), an 8B
# decode replay 4.526 -> 4.449 ms and a 5-token verify 4.625 -> 4.551 ms (bench/results/gpu_qkv_rope.json),
# the logits' bits the same in each.
QKV_ROPE = os.environ.get("SPECDEC_QKV_ROPE", "1") != "0"
AUTO_MAX_ROWS = 16  # one row tile of the skinny linear (engine/triton_linear.py)


class FusedStages(Stages):
    """`fallback`'s stages for the steps the kernels do not take."""

    fused_kernels = True

    def __init__(self, fallback: Stages, max_rows: int | None, device: torch.device,
                 layer_kernel: bool = False) -> None:
        self.fallback = fallback
        self.max_rows = max_rows  # None: every graph step
        # the split products' counters (engine/triton_linear.py), made before any graph capture;
        # the model's kernels run one at a time, on its stream
        self.counters = split_counters(device) if device.type == "cuda" else None
        # a layer a kernel (engine/triton_layer.py), its attention's key ranges those of split_len=None
        if layer_kernel and device.type == "cuda":
            check_every_sm_is_ours()
        self.layer_barrier = layer_barrier(device) if layer_kernel else None

    def forward_layer(self, layer: DecoderLayer, hidden: torch.Tensor, rotary: Rotary, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, batch: ForwardBatch, attention: AttentionFn) -> torch.Tensor:
        if (self.layer_barrier is None or not self._is_fused_step(hidden) or not layer_supported(layer)
                or int8_activations(layer.qkv)):
            return super().forward_layer(layer, hidden, rotary, k_cache, v_cache, batch, attention)
        counters = self.counters if self.counters is not None else split_counters(hidden.device)
        return layer_forward(layer, hidden, rotary, k_cache, v_cache, batch, counters, self.layer_barrier)

    def attention_inputs(self, layer: DecoderLayer, hidden: torch.Tensor, rotary: Rotary,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        if not self._is_fused_step(hidden):
            return self.fallback.attention_inputs(layer, hidden, rotary, k_cache, v_cache, slot_mapping)
        x, x_scale = self._normed(hidden, layer.input_norm, layer.eps, layer.qkv)
        weight, scale = weight_and_scale(layer.qkv)
        tables = (rotary.cos_table, rotary.sin_table, rotary.positions)  # the kernels read the rows themselves
        if QKV_ROPE and qkv_rope_block_n(weight, layer.shape, scale is not None, x_scale is not None) is not None:
            return qkv_rope_and_write_kv(x, weight, layer.qkv.bias, *tables, k_cache, v_cache, slot_mapping,
                                         layer.shape, scale=scale, x_scale=x_scale)
        qkv = self._product(x, layer.qkv, x_scale=x_scale, out_dtype=hidden.dtype)
        return rope_and_write_kv(qkv, *tables, k_cache, v_cache, slot_mapping, layer.shape)

    def attention_output(self, layer: DecoderLayer, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        if not self._is_fused_step(hidden):
            return self.fallback.attention_output(layer, hidden, attn)
        hidden = self._product(attn.flatten(1), layer.o_proj, residual=hidden)
        x, x_scale = self._normed(hidden, layer.post_attention_norm, layer.eps, layer.gate_up)
        act = self._product(x, layer.gate_up, x_scale=x_scale, silu_mul=True, out_dtype=hidden.dtype)
        return self._product(act, layer.down_proj, residual=hidden)

    def logits(self, model: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
        if not self._is_fused_step(hidden):
            return self.fallback.logits(model, hidden)
        head = model.lm_head
        linear = head.rows if isinstance(head, SubsetLMHead) else head
        x, x_scale = self._normed(hidden, model.norm, model.eps, linear)
        logits = self._product(x, linear, x_scale=x_scale, out_dtype=hidden.dtype).float()
        # a draft's reduced head: its rows' product, -inf elsewhere
        return head.to_vocab(logits) if isinstance(head, SubsetLMHead) else logits

    def greedy_ids(self, model: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
        head = model.lm_head
        if not self._is_fused_step(hidden) or not isinstance(head, SubsetLMHead):
            return self.fallback.greedy_ids(model, hidden)
        # the argmax of the product's own dtype: widening to float32 is exact and keeps the order (and
        # the first of tied rows), so the pick is the same without one more kernel a forward
        x, x_scale = self._normed(hidden, model.norm, model.eps, head.rows)
        return head.greedy_ids(self._product(x, head.rows, x_scale=x_scale, out_dtype=hidden.dtype))

    def _is_fused_step(self, hidden: torch.Tensor) -> bool:
        if not hidden.is_cuda:
            return hidden.shape[0] <= CPU_MAX_ROWS
        return torch.cuda.is_current_stream_capturing() and (self.max_rows is None or hidden.shape[0] <= self.max_rows)

    @staticmethod
    def _normed(hidden: torch.Tensor, weight: torch.Tensor, eps: float,
                linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The normed rows for `linear`'s product: int8 and their scales where it takes int8 activations."""
        if int8_activations(linear):
            return rms_norm_triton(hidden, weight, eps, quantize=True)
        return rms_norm_triton(hidden, weight, eps), None

    def _product(self, x: torch.Tensor, linear: nn.Module, x_scale: torch.Tensor | None = None,
                 **epilogue: object) -> torch.Tensor:
        """`linear`'s product through the skinny kernel (float rows of x quantized first where it takes
        int8 activations)."""
        weight, scale = weight_and_scale(linear)
        if int8_activations(linear) and x_scale is None:
            epilogue.setdefault("out_dtype", x.dtype)
            x, x_scale = quantize_rows(x)
        return skinny_linear(x, weight, linear.bias, scale=scale, x_scale=x_scale, counters=self.counters, **epilogue)

