"""A compact Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over the paged KV cache.

Weights and rotary tables are taken from a loaded Hugging Face model, so every checkpoint format
transformers reads works; the forward is ours so that it runs varlen batches of many sequences
against paged KV (and, on GPU, a Triton kernel and CUDA graphs). Why our own definition rather
than transformers' attention interface: HF's forward assumes padded [B, L] batches and its own
cache objects, which defeats varlen continuous batching and static-shape graph capture.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import paged_attention_reference, write_kv
from engine.batch import ForwardBatch
from engine.kv_cache import KVPool
from specdec.errors import UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ForwardBatch, float], torch.Tensor]


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # in float32 like HF, then back to the activation dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, head_dim]; cos, sin: [T, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class DecoderLayer(nn.Module):
    def __init__(self, hf_layer: nn.Module, shape: ModelShape, eps: float) -> None:
        super().__init__()
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.shape, self.eps = shape, eps
        self.qkv = _fused_linear([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = attn.o_proj
        self.gate_up = _fused_linear([mlp.gate_proj, mlp.up_proj])
        self.down_proj = mlp.down_proj
        self.input_norm = hf_layer.input_layernorm.weight
        self.post_attention_norm = hf_layer.post_attention_layernorm.weight

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,  # [T, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        attention: AttentionFn,
    ) -> torch.Tensor:
        s = self.shape
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        q, k, v = self.qkv(rms_norm(hidden, self.input_norm, self.eps)).split(
            [q_size, kv_size, kv_size], dim=-1
        )
        q = apply_rope(q.view(-1, s.num_heads, s.head_dim), cos, sin)
        k = apply_rope(k.view(-1, s.num_kv_heads, s.head_dim), cos, sin)
        write_kv(k, v.view(-1, s.num_kv_heads, s.head_dim), k_cache, v_cache, batch.slot_mapping)
        attn = attention(q, k_cache, v_cache, batch, s.head_dim**-0.5)
        hidden = hidden + self.o_proj(attn.reshape(-1, q_size))
        gate, up = self.gate_up(rms_norm(hidden, self.post_attention_norm, self.eps)).chunk(2, dim=-1)
        return hidden + self.down_proj(F.silu(gate) * up)


class CausalLM(nn.Module):
    """Token ids of a varlen batch -> logits at the requested rows, reading/writing paged KV."""

    def __init__(self, hf_model: nn.Module, max_model_len: int) -> None:
        super().__init__()
        config = hf_model.config
        check_supported(config)
        self.shape = ModelShape(
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            vocab_size=config.vocab_size,
        )
        inner = hf_model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = nn.ModuleList(DecoderLayer(l, self.shape, config.rms_norm_eps) for l in inner.layers)
        self.norm, self.eps = inner.norm.weight, config.rms_norm_eps
        self.lm_head = hf_model.lm_head
        cos, sin = _rope_tables(inner.rotary_emb, max_model_len, self.embed_tokens.weight)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv: KVPool, attention: AttentionFn = paged_attention_reference
    ) -> torch.Tensor:  # [N, vocab] float32 logits at batch.logits_indices
        hidden = self.embed_tokens(batch.input_ids)
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]
        for layer, k_cache, v_cache in zip(self.layers, kv.k, kv.v):
            hidden = layer(hidden, cos, sin, k_cache, v_cache, batch, attention)
        hidden = rms_norm(hidden[batch.logits_indices], self.norm, self.eps)
        return self.lm_head(hidden).float()


def check_supported(config: object) -> None:
    model_type = getattr(config, "model_type", "?")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"activation {config.hidden_act!r} is not supported (only silu)")


def _fused_linear(linears: list[nn.Linear]) -> nn.Linear:
    weight = torch.cat([l.weight.data for l in linears], dim=0)
    has_bias = linears[0].bias is not None
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device=weight.device, dtype=weight.dtype)
    fused.weight.data = weight
    if has_bias:
        fused.bias.data = torch.cat([l.bias.data for l in linears], dim=0)
    return fused


@torch.inference_mode()
def _rope_tables(rotary_emb: nn.Module, max_len: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # HF's own rotary module computes the tables, so every rope_scaling variant matches HF exactly
    positions = torch.arange(max_len, device=like.device)[None]
    cos, sin = rotary_emb(like[:1][None].float(), positions)
    return cos[0].to(like.dtype), sin[0].to(like.dtype)
