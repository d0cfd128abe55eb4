"""The Triton RMS norm rounds exactly like engine.llama.rms_norm: fp32 under TRITON_INTERPRET=1 on
CPU, bf16 on the GPU."""
from __future__ import annotations

import pytest
import torch

from engine.linear import quantize_rows_reference
from engine.llama import rms_norm
from engine.triton_norm import rms_norm_triton
from engine.triton_quant import quantize_rows

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


@pytest.mark.parametrize(("rows", "width"), [(1, 64), (5, 96), (3, 2048)])
def test_int8_rows_are_the_reference_quantization_of_the_normed_rows(rows, width):
    """--quantize w8a8: the norm kernel's int8 rows and scales, and the kernel quantizing any rows
    (attention's output, gate/up's), are engine.linear.quantize_rows_reference's."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    torch.manual_seed(rows + width)
    x = (3 * torch.randn(rows, width, device=DEVICE)).to(dtype)
    x[0, 1] = 40.0  # an outlier sets its row's scale
    weight = (1 + 0.1 * torch.randn(width, device=DEVICE)).to(dtype)
    q, scales = rms_norm_triton(x, weight, 1e-5, quantize=True)
    q_ref, scales_ref = quantize_rows_reference(rms_norm_triton(x, weight, 1e-5))
    assert q.dtype == torch.int8 and scales.dtype == torch.float32
    assert torch.equal(q, q_ref) and torch.equal(scales, scales_ref)
    assert q.abs().amax(dim=1).eq(127).all()  # each row's largest magnitude takes the full range
    q, scales = quantize_rows(x)
    q_ref, scales_ref = quantize_rows_reference(x)
    assert torch.equal(q, q_ref) and torch.equal(scales, scales_ref)
    error = (q.float() * scales[:, None] - x.float()).abs()
    assert (error <= 0.5 * scales[:, None] * (1 + 1e-5)).all()  # within half a step of its row
