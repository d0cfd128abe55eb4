"""A layer's stages around cuBLAS with every reduction in a kernel of fixed launch: the same bits in
every process, for the steps the fused kernels (engine/fused_stages.py) do not take (prefill chunks,
large graph steps).

torch.compile fuses these stages well, but what inductor builds is not the same bits in every process: of
target replicas of one checkpoint compiling side by side, one answered a prompt's prefill with other bits and
so one greedy prompt differently (bench/results/gpu_replicas.json, gpu_replicas_kernels.json; which of its
kernels parts is not yet named). Here

  x       = rms_norm(hidden)                     (engine/triton_norm.py: one program a row)
  q       = rope_and_write_kv(x @ W_qkv)         (engine/triton_rope.py: rotary + cache write)
  attn    = attention(q, cache)
  hidden += attn @ W_o                           (cuBLAS, then a PyTorch add)
  hidden += silu_mul(rms_norm(hidden) @ W_gu) @ W_down

the products are cuBLAS's (the same kernel for a shape in every process), the residuals and activation
element-wise PyTorch ops (no reduction: any launch computes the same values). The rounding is
engine.llama's (each product and the activation rounded to the activations' dtype).
"""
from __future__ import annotations

import torch

from engine.llama import DecoderLayer, Rotary, Stages, silu_mul_interleaved
from engine.triton_norm import rms_norm_triton
from engine.triton_rope import rope_and_write_kv


class KernelStages(Stages):
    def attention_inputs(self, layer: DecoderLayer, hidden: torch.Tensor, rotary: Rotary,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        qkv = layer.qkv(rms_norm_triton(hidden, layer.input_norm, layer.eps))
        return rope_and_write_kv(qkv, rotary.cos_table, rotary.sin_table, rotary.positions, k_cache, v_cache,
                                 slot_mapping, layer.shape)

    def attention_output(self, layer: DecoderLayer, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        hidden = hidden + layer.o_proj(attn.flatten(1))
        x = rms_norm_triton(hidden, layer.post_attention_norm, layer.eps)
        return hidden + layer.down_proj(silu_mul_interleaved(layer.gate_up(x)))
