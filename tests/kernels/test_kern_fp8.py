"""fp8_gemm (e4m3 weights, per-channel scales) against the torch reference."""

from __future__ import annotations

import pytest
import torch
from kubeinfer_kernels import fp8_gemm
from kubeinfer_kernels.reference import fp8_gemm_ref, quantize_fp8_per_channel

# Relative to the largest output: one output rounding plus, on GPUs, rounding of the weight tile.
GEMM_TOL: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"]
)
@pytest.mark.parametrize("m", [1, 7, 33])
def test_fp8_gemm_matches_reference(m: int, dtype: torch.dtype, device: torch.device) -> None:
    k_dim, n_dim = 160, 96  # K not a multiple of the 64-wide K tile, N not of the N tile
    w = torch.randn(n_dim, k_dim) * torch.linspace(0.01, 2.0, n_dim)[:, None]  # channels of varied range
    quant = quantize_fp8_per_channel(w)
    weight, scale = quant.weight.to(device), quant.scale.to(device)
    x = torch.randn(m, k_dim).to(dtype).to(device)
    out = fp8_gemm(x, weight, scale)
    ref = fp8_gemm_ref(x, weight, scale)
    assert out.shape == (m, n_dim) and out.dtype == dtype
    tol = GEMM_TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol * ref.float().abs().max().item(), rtol=tol)


def test_fp8_quantization_is_close_to_the_float_weight() -> None:
    w = torch.randn(32, 64)
    quant = quantize_fp8_per_channel(w)
    dequant = quant.weight.float() * quant.scale[:, None]
    # e4m3 keeps 3 mantissa bits: relative error of a normal value is at most 2^-4.
    assert (dequant - w).abs().max() <= 2**-4 * w.abs().amax(dim=1, keepdim=True).max()


def test_fp8_gemm_rejects_bad_arguments(device: torch.device) -> None:
    quant = quantize_fp8_per_channel(torch.randn(16, 32))
    weight, scale = quant.weight.to(device), quant.scale.to(device)
    x = torch.randn(2, 32, device=device)
    with pytest.raises(TypeError, match="weight"):
        fp8_gemm(x, weight.float(), scale)
    with pytest.raises(ValueError, match="weight"):
        fp8_gemm(torch.randn(2, 16, device=device), weight, scale)
    with pytest.raises(ValueError, match="scale"):
        fp8_gemm(x, weight, scale[:8])
