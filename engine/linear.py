"""Linear layers on CPU, in the product forms MKL is fast at for the row count.

On the development VM (MKL sgemm, AVX-512), over SmolLM2's layer matrices (30 layers + LM head,
fp32, median of 15, ms):

    rows                     1     2     3     5     9     16    64
    F.linear(x, W)           30    53    130   91    62    76    188
    (W @ x^T)^T              30    25    37    46    48    47    153
    x @ W^T (stored [in, out]) 18  40    89    135   69    94    213

`F.linear` on 2-9 rows (a verify, a draft catch-up) cost up to 4 times one row, so a 3-token verify
cost about 3 decode steps; and one row is fastest against a weight stored transposed. So a CPU
linear keeps a transposed copy of its weight for one-row forwards (decode, each draft step: the
SmolLM2 target's decode forward 70 -> 49 ms) and takes (W @ x^T)^T for 2..64 rows (its 3-token
verify 145 -> 48 ms). The copy doubles the CPU weight memory of the linears (the SmolLM2 target:
+0.5 GB). GPUs (cuBLAS) keep `F.linear` everywhere.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

TRANSPOSED_ROWS = range(2, 65)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] @ weight [out, in]^T (+ bias), in the faster form for the rows on CPU."""
    if x.device.type != "cpu" or x.dim() != 2 or x.shape[0] not in TRANSPOSED_ROWS:
        return F.linear(x, weight, bias)
    out = (weight @ x.t()).t().contiguous()
    return out if bias is None else out + bias


class CpuLinear(nn.Module):
    """An nn.Linear's weights (shared) plus a transposed copy, each product in its fast form."""

    def __init__(self, layer: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = layer.weight, layer.bias
        self.register_buffer("weight_t", layer.weight.detach().t().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] == 1:
            out = x @ self.weight_t
            return out if self.bias is None else out + self.bias
        return linear(x, self.weight, self.bias)


class Int8Linear(nn.Module):
    """Weight-only int8 (one scale per output row), for drafts: half of bfloat16's bytes (a quarter of
    float32's) a step reads, which bounds a draft's decode step. Only for drafts: a draft's numerics
    change its proposals, never the output (the target verifies every token).

    On CPU the products run through PyTorch's int8 kernel, in bfloat16. On CUDA the graph steps'
    fused kernels read the int8 rows directly (engine/triton_linear.py's `scale`); other forwards
    (prefill chunks, batches past the fused kernels' rows) multiply the dequantized weight, made
    for the product and dropped after it (compute-bound forwards, where the extra bytes cost little).

    `int8_activations` (W8A8, --quantize w8a8): the fused kernels take x as int8 rows too and multiply
    on int8 tensor cores (engine/triton_quant.py, triton_linear.py); the other forwards round x as
    those rows would (quantize_rows_reference) and multiply as above.
    """

    def __init__(self, layer: nn.Module, int8_activations: bool = False) -> None:
        super().__init__()
        self.int8_activations = int8_activations
        weight = layer.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127
        self.register_buffer("qweight", (weight / scale[:, None]).round().clamp(-128, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.bias = layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_activations:
            q, scales = quantize_rows_reference(x.reshape(-1, x.shape[-1]))
            x = (q.float() * scales[:, None]).to(x.dtype).view(x.shape)
        if x.device.type != "cpu":
            return F.linear(x, dequantize_int8(self.qweight, self.scale, x.dtype), self.bias)
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
        out = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scale)
        out = out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])
        return out if self.bias is None else out + self.bias


def weight_and_scale(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the Triton products read of a linear: an nn.Linear's weight, or an Int8Linear's int8 rows
    and their scales."""
    if isinstance(linear, Int8Linear):
        return linear.qweight, linear.scale
    return linear.weight, None


def int8_activations(linear: nn.Module) -> bool:
    """Whether the Triton products take this linear's input as int8 rows (W8A8)."""
    return isinstance(linear, Int8Linear) and linear.int8_activations


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> int8 [M, K] and float32 scales [M]: each row over its largest magnitude / 127,
    rounded half away from zero (engine/triton_quant.py's kernel, the same values)."""
    xf = x.float()
    scales = xf.abs().amax(dim=-1).clamp_min(1e-12) / 127.0
    v = xf / scales[:, None]
    q = (v + torch.where(v >= 0, 0.5, -0.5)).clamp(-127.0, 127.0).trunc()
    return q.to(torch.int8), scales


def dequantize_int8(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, K] int8 rows times their [N] bfloat16 scales, each product rounded once to `dtype`.

    In bfloat16 or float32 the product is formed in `dtype` itself: an int8 and a bfloat16 scale convert
    exactly and their product is exact in float32 before its one rounding, so the bits are those of the
    float32 route with no float32 copy of the weight (7 bytes an element moved, not 19; what eager stages pay
    on every product of a prefill chunk). Other dtypes (float16: a tiny scale would lose bits converting) take
    the float32 route."""
    if scale.dtype == torch.bfloat16 and dtype in (torch.bfloat16, torch.float32):
        return qweight.to(dtype) * scale.to(dtype)[:, None]
    return (qweight.float() * scale.float()[:, None]).to(dtype)


# On CUDA only products this wide take int8: narrower ones launch too few programs of the skinny
# kernel to be bound by their bytes. H200, Llama-3.2-1B, 1 row (bench/results/tune_linear_int8.json
# against tune_linear.json's bf16): gate/up (16384 rows) 12.3 us against 18.0, the LM head 67 against
# 118; qkv 5.9 against 6.2 and o_proj 5.7 against 5.7, no gain; down_proj (2048 rows, K = 8192) 14.5
# against 12.6, a loss; split along K as bf16's is, still a loss: a 1B decode replay 0.771 / 0.771 ms
# with a bf16 down projection, 0.803 / 0.805 with an int8 one (bench/results/gpu_draft_forward_int8down.json,
# a variant of bench/gpu_draft_forward.py at commit 6729999).
CUDA_MIN_INT8_OUT_FEATURES = 8192


def quantize_int8(module: nn.Module, min_out_features: int = 0, int8_activations: bool = False) -> None:
    """Replaces every linear child of `module` (recursively; nn.Linear or CpuLinear) of at least
    `min_out_features` outputs with an Int8Linear (W8A8 with `int8_activations`)."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear | CpuLinear):
            if child.weight.shape[0] >= min_out_features:
                setattr(module, name, Int8Linear(child, int8_activations))
        else:
            quantize_int8(child, min_out_features, int8_activations)


def use_cpu_linear(module: nn.Module) -> None:
    """Replaces every nn.Linear child of `module` (recursively) with a CpuLinear over the same weights."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, CpuLinear(child))
        else:
            use_cpu_linear(child)
