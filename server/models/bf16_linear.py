"""An fp32 `nn.Linear` whose matmul runs in bf16 (bf16 operands, fp32 sums, a bf16 result): the weight held
once, rounded to bf16 and pre-packed for oneDNN (half the fp32 copy's bytes), the activations rounded to bf16
on the way in. For layers of an fp32 residual stream on CPUs that compute bf16 natively (AVX512-BF16, AMX),
where a bf16 GEMM runs ~1.8x the fp32 one: the fused CPU path (server/models/llama.py `_forward_fused`)
hands such a projection a bf16 operand and takes its bf16 result as is, as it does for block-quantized
layers under `gemm_dtype` bf16 (`layers.bf16_gemm`). Used by decoder embedders under `--dtype auto`
(server/pooling/decoder.py `prepare_for_pooling`); a model that computes in bf16 throughout (a bf16 folder
served as generation) keeps bf16 weights instead."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class Bf16GemmLinear(nn.Module):
    """Drop-in for an fp32 CPU `nn.Linear` (oneDNN with bf16: `serving_weights.cpu_packing_supported`):
    `forward(x [..., K] fp32 or bf16, out_dtype)` -> `[..., N]` in `out_dtype` (default x's dtype), equal to
    `F.linear(x.bfloat16(), W.bfloat16())` (bias added in fp32 after widening)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if linear.weight.dtype != torch.float32 or linear.weight.device.type != "cpu":
            raise ValueError(
                f"Bf16GemmLinear wraps an fp32 CPU Linear, got {linear.weight.dtype} on {linear.weight.device}"
            )
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # An opaque oneDNN tensor, not a parameter: it cannot be moved, saved or read back.
        weight = linear.weight.detach().to(torch.bfloat16)  # [N, K]
        self.packed_weight: Tensor = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias: Tensor | None = None if linear.bias is None else linear.bias.detach().float()  # [N]

    def bf16_gemm(self, rows: int) -> bool:
        """Whether the result is the bf16 GEMM's own (no bias after it), so that forward(x,
        out_dtype=torch.bfloat16) returns it unwidened: every row count (layers.bf16_gemm's contract)."""
        return self.bias is None

    def forward(self, x: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:  # x: [..., K]
        dtype = x.dtype if out_dtype is None else out_dtype
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()  # [M, K]
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed_weight, None, "none", [], "")  # [M, N] bf16
        if self.bias is not None:
            y = y.float() + self.bias
        return y.reshape(*lead, self.out_features).to(dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            "gemm=bf16"
        )
