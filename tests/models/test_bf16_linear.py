"""server/models/bf16_linear.py: an fp32 Linear multiplied in bf16 (bf16 operands, fp32 sums, bf16 result),
against torch's own bf16 matmul of the rounded operands; skipped where oneDNN runs no bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from server.models.bf16_linear import Bf16GemmLinear
from server.models.serving_weights import cpu_packing_supported

pytestmark = pytest.mark.skipif(
    not cpu_packing_supported(torch.device("cpu"), torch.bfloat16), reason="oneDNN runs no bf16 on this CPU"
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead", [(1,), (37,), (3, 5)])
def test_bf16_gemm_linear_is_the_bf16_matmul_of_the_rounded_operands(
    bias: bool, x_dtype: torch.dtype, out_dtype: torch.dtype | None, lead: tuple[int, ...]
) -> None:
    g = torch.Generator().manual_seed(len(lead) * 7 + int(bias))
    linear = nn.Linear(96, 80, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(80, 96, generator=g) * 0.1)  # [N, K] fp32
        if bias:
            linear.bias.copy_(torch.randn(80, generator=g))
    layer = Bf16GemmLinear(linear)
    x = torch.randn(*lead, 96, generator=g).to(x_dtype)  # [..., K]
    want = F.linear(x.bfloat16(), linear.weight.bfloat16())  # [..., N] bf16: fp32 sums, one rounding
    if bias:
        want = want.float() + linear.bias
    got = layer(x) if out_dtype is None else layer(x, out_dtype=out_dtype)
    expect_dtype = x_dtype if out_dtype is None else out_dtype
    assert got.dtype == expect_dtype and got.shape == (*lead, 80)
    # oneDNN's packed and unpacked bf16 GEMMs sum in one order: equal after the same final rounding
    torch.testing.assert_close(got, want.to(expect_dtype), rtol=0, atol=0)
    assert layer.bf16_gemm(lead[0]) is (not bias)


def test_bf16_gemm_linear_refuses_a_non_fp32_weight() -> None:
    with pytest.raises(ValueError, match="fp32 CPU Linear"):
        Bf16GemmLinear(nn.Linear(8, 8).bfloat16())
