"""A compact Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over the paged KV cache.

Weights and rotary tables are taken from a loaded Hugging Face model, so every checkpoint format
transformers reads works; the forward is ours so that it runs varlen batches of many sequences
against paged KV (and, on GPU, a Triton kernel and CUDA graphs). Why our own definition rather
than transformers' attention interface: HF's forward assumes padded [B, L] batches and its own
cache objects, which defeats varlen continuous batching and static-shape graph capture.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import paged_attention_reference, write_kv
from engine.batch import ForwardBatch
from engine.kv_cache import KVPool
from engine.subset_head import SubsetLMHead
from specdec.errors import UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

# compile-cache entries a compiled stage may hold in one process: ~32 model configurations
COMPILED_ENTRIES = 64

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ForwardBatch, float], torch.Tensor]


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int


@dataclass
class Rotary:
    """A forward's rotary angles: the model's cos/sin tables and each token's position. The fused
    kernels read the tables' rows themselves (engine/triton_rope.py); the PyTorch stages take the
    rows gathered, once a forward, on first use."""

    cos_table: torch.Tensor  # [max_positions, head_dim]
    sin_table: torch.Tensor  # [max_positions, head_dim]
    positions: torch.Tensor  # [T]
    _rows: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False)

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin [T, head_dim]
        if self._rows is None:
            self._rows = (self.cos_table[self.positions], self.sin_table[self.positions])
        return self._rows


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


def pre_attention(
    hidden: torch.Tensor,  # [T, hidden]
    norm_weight: torch.Tensor,
    qkv: nn.Linear,
    cos: torch.Tensor,  # [T, head_dim]
    sin: torch.Tensor,  # [T, head_dim]
    shape: ModelShape,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [T, H, D], k and v [T, KVH, D]
    q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    q, k, v = qkv(rms_norm(hidden, norm_weight, eps)).split([q_size, kv_size, kv_size], dim=-1)
    q = apply_rope(q.view(-1, shape.num_heads, shape.head_dim), cos, sin)
    k = apply_rope(k.view(-1, shape.num_kv_heads, shape.head_dim), cos, sin)
    return q, k, v.view(-1, shape.num_kv_heads, shape.head_dim)


def post_attention(
    hidden: torch.Tensor,  # [T, hidden] the layer's input (residual)
    attn: torch.Tensor,  # [T, H, D]
    o_proj: nn.Linear,
    norm_weight: torch.Tensor,
    gate_up: nn.Linear,
    down_proj: nn.Linear,
    eps: float,
) -> torch.Tensor:  # [T, hidden]
    hidden = hidden + o_proj(attn.flatten(1))
    return hidden + down_proj(silu_mul_interleaved(gate_up(rms_norm(hidden, norm_weight, eps))))


def silu_mul_interleaved(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """silu(gate) * up of a gate/up projection whose columns interleave (gate_0, up_0, gate_1, ...):
    the pairs sit side by side, so a kernel that computes a few columns can finish the activation."""
    pairs = gate_up.unflatten(-1, (-1, 2))
    return F.silu(pairs[..., 0]) * pairs[..., 1]


class Stages:
    """How a layer computes around attention: its queries (norm, QKV product, rotary, the cache write) and what
    follows attention (output product, residuals, norm, MLP), and the head's logits. `LayerStages` in PyTorch;
    engine.kernel_stages.KernelStages with Triton norms and rotary around cuBLAS; engine.fused_stages.FusedStages
    with Triton kernels for the decode and verify steps, falling back to one of the others."""

    fused_kernels = False  # engine.fused_stages.FusedStages: True

    def forward_layer(self, layer: DecoderLayer, hidden: torch.Tensor, rotary: Rotary, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, batch: ForwardBatch, attention: AttentionFn) -> torch.Tensor:
        """The layer's output [T, hidden]: its queries, attention, and what follows."""
        q = self.attention_inputs(layer, hidden, rotary, k_cache, v_cache, batch.slot_mapping)
        attn = attention(q, k_cache, v_cache, batch, layer.shape.head_dim**-0.5)
        return self.attention_output(layer, hidden, attn)

    def attention_inputs(self, layer: DecoderLayer, hidden: torch.Tensor, rotary: Rotary,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """The layer's queries [T, H, D]; its keys and values go to the cache."""
        raise NotImplementedError

    def attention_output(self, layer: DecoderLayer, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output [T, hidden] from its input and the attention [T, H, D]."""
        raise NotImplementedError

    def logits(self, model: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of the final hidden states' rows."""
        return model.lm_head(rms_norm(hidden, model.norm, model.eps)).float()

    def greedy_ids(self, model: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
        """[rows] int64: each row's argmax token. A reduced head (engine/subset_head.py) takes it over
        its own rows, never building vocabulary-wide logits."""
        head = model.lm_head
        if isinstance(head, SubsetLMHead):
            return head.greedy_ids(head.subset_logits(rms_norm(hidden, model.norm, model.eps)).float())
        return self.logits(model, hidden).argmax(-1)


@dataclass
class LayerStages(Stages):
    """The stages in PyTorch (CPU), or torch.compile'd on GPU (`compiled`: it fuses the norms, rotary,
    residuals and activation)."""

    pre_attention: Callable = pre_attention
    post_attention: Callable = post_attention

    def compiled(self) -> LayerStages:
        # dynamic: one graph serves every token count (bucket sizes and prefill chunks). Every model of
        # the process shares the two functions' compile caches, and each model configuration (shape,
        # linear kind, dtype) adds about two entries (one token, and any count): past dynamo's default
        # limit of 8 a fifth model, a draft service's named drafts or live swaps, would fail to compile.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILED_ENTRIES)
        return LayerStages(torch.compile(pre_attention, dynamic=True, fullgraph=True),
                           torch.compile(post_attention, dynamic=True, fullgraph=True))

    def attention_inputs(self, layer: DecoderLayer, hidden: torch.Tensor, rotary: Rotary,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary.rows()
        q, k, v = self.pre_attention(hidden, layer.input_norm, layer.qkv, cos, sin, layer.shape, layer.eps)
        write_kv(k, v, k_cache, v_cache, slot_mapping)
        return q

    def attention_output(self, layer: DecoderLayer, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        return self.post_attention(hidden, attn, layer.o_proj, layer.post_attention_norm, layer.gate_up,
                                   layer.down_proj, layer.eps)


class DecoderLayer(nn.Module):
    def __init__(self, hf_layer: nn.Module, shape: ModelShape, eps: float) -> None:
        super().__init__()
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.shape, self.eps = shape, eps
        self.qkv = _fused_linear([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = attn.o_proj
        self.gate_up = _fused_linear([mlp.gate_proj, mlp.up_proj], interleave=True)
        self.down_proj = mlp.down_proj
        self.input_norm = hf_layer.input_layernorm.weight
        self.post_attention_norm = hf_layer.post_attention_layernorm.weight

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        rotary: Rotary,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        attention: AttentionFn,
        stages: Stages,
    ) -> torch.Tensor:
        return stages.forward_layer(self, hidden, rotary, k_cache, v_cache, batch, attention)


class CausalLM(nn.Module):
    """Token ids of a varlen batch -> logits at the requested rows, reading/writing paged KV."""

    def __init__(self, hf_model: nn.Module, max_positions: int) -> None:
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
        self.layers = nn.ModuleList(DecoderLayer(layer, self.shape, config.rms_norm_eps) for layer in inner.layers)
        self.norm, self.eps = inner.norm.weight, config.rms_norm_eps
        self.lm_head = hf_model.lm_head
        cos, sin = _rope_tables(inner.rotary_emb, max_positions, self.embed_tokens.weight)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.stages: Stages = LayerStages()

    def compile_stages(self) -> None:
        """Fuses each layer's norms, rotary, residuals and activation with torch.compile (GPU)."""
        self.stages = self.stages.compiled()

    def use_kernel_stages(self) -> None:
        """Norms and rotary in Triton kernels of fixed launch around cuBLAS (engine/kernel_stages.py)."""
        from engine.kernel_stages import KernelStages  # needs triton, only here

        self.stages = KernelStages()

    def use_fused_kernels(self, max_rows: int | None, layer_kernel: bool = False) -> None:
        """CUDA-graph steps (decode, verify, draft loops) of up to `max_rows` rows (None: all) run
        engine.fused_stages' Triton kernels, with `layer_kernel` a layer a kernel (engine/triton_layer.py,
        not batch-invariant); call after compile_stages or use_kernel_stages (other steps keep those)."""
        from engine.fused_stages import FusedStages  # needs triton, only here

        self.stages = FusedStages(self.stages, max_rows, self.embed_tokens.weight.device, layer_kernel)

    @contextmanager
    def fallback_stages(self) -> Iterator[None]:
        """The forwards inside take the stages the fused kernels fall back to (engine/kernel_stages.py or
        compiled PyTorch, around cuBLAS), as eager forwards do, even while capturing (the prefill graphs:
        engine/cuda_graphs.py)."""
        stages = self.stages
        if stages.fused_kernels:
            self.stages = stages.fallback
        try:
            yield
        finally:
            self.stages = stages

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv: KVPool, attention: AttentionFn = paged_attention_reference,
        greedy: bool = False,
    ) -> torch.Tensor:  # [N, vocab] float32 logits at batch.logits_indices (greedy: [N] argmax ids)
        hidden = self.embed_tokens(batch.input_ids)
        rotary = Rotary(self.cos, self.sin, batch.positions)
        for layer, k_cache, v_cache in zip(self.layers, kv.k, kv.v):
            hidden = layer(hidden, rotary, k_cache, v_cache, batch, attention, self.stages)
        rows = hidden if batch.logits_indices is None else hidden[batch.logits_indices]
        return self.stages.greedy_ids(self, rows) if greedy else self.stages.logits(self, rows)


def check_supported(config: object) -> None:
    model_type = getattr(config, "model_type", "?")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"activation {config.hidden_act!r} is not supported (only silu)")


def _fused_linear(linears: list[nn.Linear], interleave: bool = False) -> nn.Linear:
    """One linear computing all of `linears`' outputs: concatenated, or interleaved row by row."""
    join = (lambda ts: torch.stack(ts, dim=1).flatten(0, 1)) if interleave else (lambda ts: torch.cat(ts, dim=0))
    weight = join([linear.weight.data for linear in linears])
    has_bias = linears[0].bias is not None
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device=weight.device, dtype=weight.dtype)
    fused.weight.data = weight
    if has_bias:
        fused.bias.data = join([linear.bias.data for linear in linears])
    return fused


@torch.inference_mode()
def _rope_tables(rotary_emb: nn.Module, max_len: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # HF's own rotary module computes the tables, so every rope_scaling variant matches HF exactly
    positions = torch.arange(max_len, device=like.device)[None]
    cos, sin = rotary_emb(like[:1][None].float(), positions)
    return cos[0].to(like.dtype), sin[0].to(like.dtype)
