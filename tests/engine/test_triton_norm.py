"""The Triton RMS norm rounds exactly like engine.llama.rms_norm: fp32 under TRITON_INTERPRET=1 on
CPU, bf16 on the GPU."""
from __future__ import annotations

import pytest
import torch

from engine.llama import rms_norm
from engine.triton_norm import rms_norm_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("rows", "width"), [(1, 64), (5, 96), (16, 576)])
def test_kernel_matches_reference(rows, width):
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    torch.manual_seed(rows)
    x = (3 * torch.randn(rows, width, device=DEVICE)).to(dtype)
    weight = (1 + 0.1 * torch.randn(width, device=DEVICE)).to(dtype)
    got, expected = rms_norm_triton(x, weight, 1e-5), rms_norm(x, weight, 1e-5)
    # the same roundings; only the float32 sum of squares adds up in another order
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-6)
