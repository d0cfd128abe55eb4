"""Linear layers for few-row inputs on CPU.

On the development VM (MKL sgemm, AVX-512) `F.linear` on 2-9 rows, the shape of a verify or a draft
catch-up forward, runs far slower than on one row: 2-4x the time of a decode step for SmolLM2's
matrices, so a 3-token verify cost about 3 decode steps and speculation lost. Computing the same
product transposed, (W @ x^T)^T, reads the weight in the order MKL's few-column path is fast at:
measured over SmolLM2's layer matrices (30 layers + LM head, fp32, median of 15):

    rows            1     2     3     5     9     16    64
    F.linear (ms)   30    53    130   91    62    76    188
    (W @ x^T)^T     30    25    37    46    48    47    153

So CPU forwards of 2..64 rows take the transposed form; one row (decode) and larger batches keep
`F.linear`. GPUs (cuBLAS) keep `F.linear` everywhere.
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
    """An nn.Linear's weights behind `linear` (shares the tensors, copies nothing)."""

    def __init__(self, layer: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = layer.weight, layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def use_cpu_linear(module: nn.Module) -> None:
    """Replaces every nn.Linear child of `module` (recursively) with a CpuLinear over the same weights."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, CpuLinear(child))
        else:
            use_cpu_linear(child)
