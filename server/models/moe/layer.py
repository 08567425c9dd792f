"""FusedMoE: router logits -> top-k experts -> grouped expert GEMMs -> weighted sum (+ shared expert).

CPU path: the T * top_k token-expert pairs are sorted by expert once (routing.group_by_expert), each
active expert runs one gate/up GEMM and one down GEMM over all of its tokens, and one `index_add_` sums
the weighted outputs back per token: the loops run over experts, never over tokens. Quantized experts
that offer a native call (`FusedExperts`: BlockQuantExperts, Mxfp4Experts) run that whole loop in one
C++ call instead (server/models/moe/native.py), with no Python per expert. The expert GEMMs
come from an `ExpertGemms` (dense here, block-quantized or MXFP4 in server/models/moe/quant.py), so at
one token only the chosen experts' weights are read. On CUDA, dense experts go through the Triton
grouped GEMM `kubeinfer_kernels.fused_moe`.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from server.models.moe.config import MoEConfig
from server.models.moe.native import FusedExpertsCall
from server.models.moe.routing import Routing, group_by_expert, select_experts
from server.models.moe.weights import ExpertWeights


def act_and_mul(h: Tensor, cfg: MoEConfig) -> Tensor:  # h: [n, 2I] gate | up -> [n, I], h's dtype
    i = h.shape[-1] // 2
    gate, up = h[..., :i], h[..., i:]
    if cfg.activation == "silu":
        return F.silu(gate) * up
    # gpt-oss (transformers GptOssExperts._apply_gate): the gate clamped above only, up both ways.
    gate = gate.clamp(max=cfg.swiglu_limit)
    up = up.clamp(min=-cfg.swiglu_limit, max=cfg.swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * cfg.swiglu_alpha))


class ExpertGemms(Protocol):
    """The two GEMMs of expert e over its n tokens; both return fp32 with the expert's bias added."""

    def gate_up(self, e: int, x: Tensor) -> Tensor: ...  # x: [n, H] fp32 -> [n, 2I] fp32

    def down(self, e: int, h: Tensor) -> Tensor: ...  # h: [n, I] fp32 -> [n, H] fp32


class FusedExperts(ExpertGemms, Protocol):
    """ExpertGemms that can also run a whole block's routed experts in one native call."""

    def fused_call(self, cfg: MoEConfig) -> FusedExpertsCall | None: ...  # None: not here, use the loop

    def fused_entry(self) -> int: ...  # the projection entry point for FusedExpertsCall.run


class SharedGemms(Protocol):
    """Qwen2-MoE's shared expert's two GEMMs held quantized (SparseMoeBlock.set_shared_expert); both
    return fp32."""

    def gate_up(self, x: Tensor) -> Tensor: ...  # x: [T, H] fp32 -> [T, 2S] fp32, gate | up

    def down(self, h: Tensor) -> Tensor: ...  # h: [T, S] fp32 -> [T, H] fp32


class DenseExperts:
    """Float expert weights kept in `gemm_dtype` (bf16 where the CPU computes it natively, fp32 else:
    `default_gemm_dtype`); sums come back as fp32."""

    def __init__(self, w: ExpertWeights, gemm_dtype: torch.dtype = torch.float32) -> None:
        if w.w13 is None or w.w2 is None:
            raise ValueError("dense experts need w13 and w2 (the weights were loaded without them)")
        self.gemm_dtype = gemm_dtype
        self.w13 = w.w13.to(gemm_dtype)  # [E, 2I, H]
        self.w2 = w.w2.to(gemm_dtype)  # [E, H, I]
        self.b13 = None if w.b13 is None else w.b13.float()  # [E, 2I]
        self.b2 = None if w.b2 is None else w.b2.float()  # [E, H]

    def gate_up(self, e: int, x: Tensor) -> Tensor:  # x: [n, H] -> [n, 2I] fp32
        y = F.linear(x.to(self.gemm_dtype), self.w13[e]).float()
        return y if self.b13 is None else y + self.b13[e]

    def down(self, e: int, h: Tensor) -> Tensor:  # h: [n, I] -> [n, H] fp32
        y = F.linear(h.to(self.gemm_dtype), self.w2[e]).float()
        return y if self.b2 is None else y + self.b2[e]


def default_gemm_dtype() -> torch.dtype:
    """bf16 where the CPU has AVX512-BF16 or AMX-BF16 (server.native.usable_cpu_features), else fp32:
    on AVX2-only CPUs torch emulates bf16 matmuls ~5x slower than fp32."""
    from server.native import KernelBuildError, usable_cpu_features

    try:
        f = usable_cpu_features()
    except (KernelBuildError, OSError):
        return torch.float32
    return torch.bfloat16 if (f.avx512_bf16 or f.amx_bf16) else torch.float32


class FusedMoE(nn.Module):
    """One MoE block: forward(x [T, H]) -> [T, H] in x's dtype.

    `experts` defaults to DenseExperts over `weights` in `gemm_dtype` (default_gemm_dtype() when None);
    the router and the shared expert stay in the weights' dtype, or the shared expert's GEMMs are
    `shared_gemms` (quantized; its sigmoid gate stays `weights.shared.gate`). Raises ValueError when
    `weights` do not match `cfg`, or the shared expert has neither dense weights nor `shared_gemms`.
    """

    def __init__(
        self,
        cfg: MoEConfig,
        weights: ExpertWeights,
        experts: ExpertGemms | None = None,
        gemm_dtype: torch.dtype | None = None,
        shared_gemms: SharedGemms | None = None,
    ) -> None:
        super().__init__()
        weights.check(cfg)
        if weights.shared is not None and (weights.shared.w13 is None) != (shared_gemms is not None):
            raise ValueError("the shared expert needs either its dense w13 / w2 or shared_gemms")
        self.cfg = cfg
        self.weights = weights
        self.shared_gemms = shared_gemms
        self.experts: ExpertGemms = (
            experts if experts is not None else DenseExperts(weights, gemm_dtype or default_gemm_dtype())
        )

    def route(self, x: Tensor) -> Routing:  # x: [T, H]
        return select_experts(F.linear(x, self.weights.router, self.weights.router_bias), self.cfg)

    def forward(self, x: Tensor) -> Tensor:  # x: [T, H] -> [T, H]
        if x.dim() != 2 or x.shape[1] != self.cfg.hidden_size:
            raise ValueError(f"x must be [T, {self.cfg.hidden_size}], got {tuple(x.shape)}")
        routing = self.route(x)
        call = None if x.is_cuda else self.native_call()
        if x.is_cuda and isinstance(self.experts, DenseExperts):
            out = self._cuda(x, routing)
        elif call is not None:
            entry = self.experts.fused_entry()  # type: ignore[attr-defined]  # native_call checked it
            out = call.run(x.float(), routing.ids, routing.weights, entry)
        else:
            out = self._grouped(x, routing)
        shared = self.weights.shared
        if shared is not None:
            if self.shared_gemms is not None:
                q = self.shared_gemms
                s = q.down(act_and_mul(q.gate_up(x.float()), self.cfg))
            else:
                assert shared.w13 is not None and shared.w2 is not None  # __init__ checked
                s = F.linear(act_and_mul(F.linear(x, shared.w13), self.cfg), shared.w2)
            out = out + (torch.sigmoid(F.linear(x, shared.gate)) * s).float()
        return out.to(x.dtype)

    def native_call(self) -> FusedExpertsCall | None:
        """The experts' one-call path on CPU (FusedExperts.fused_call), or None: the per-expert loop."""
        fused_call = getattr(self.experts, "fused_call", None)
        return fused_call(self.cfg) if callable(fused_call) else None

    def _grouped(self, x: Tensor, routing: Routing) -> Tensor:  # -> [T, H] fp32
        t, k = routing.ids.shape
        groups = group_by_expert(routing.ids, self.cfg.num_experts)
        xs = x.float().index_select(0, groups.tokens)  # [T * k, H], grouped by expert
        ys = torch.empty(t * k, self.cfg.hidden_size, dtype=torch.float32, device=x.device)
        for e, (start, n) in enumerate(zip(groups.offsets, groups.counts, strict=True)):
            if n == 0:
                continue
            h = act_and_mul(self.experts.gate_up(e, xs[start : start + n]), self.cfg)
            ys[start : start + n] = self.experts.down(e, h)
        ys *= routing.weights.reshape(-1).index_select(0, groups.pairs)[:, None]
        out = torch.zeros(t, self.cfg.hidden_size, dtype=torch.float32, device=x.device)
        return out.index_add_(0, groups.tokens, ys)

    def _cuda(self, x: Tensor, routing: Routing) -> Tensor:  # -> [T, H] fp32
        from kubeinfer_kernels import fused_moe

        dense = self.experts
        assert isinstance(dense, DenseExperts)
        return fused_moe(
            x.to(dense.gemm_dtype),
            dense.w13,
            dense.w2,
            routing.weights,
            routing.ids.to(torch.int32),
            activation=self.cfg.activation,
            b13=dense.b13,
            b2=dense.b2,
            swiglu_alpha=self.cfg.swiglu_alpha,
            swiglu_limit=self.cfg.swiglu_limit,
        ).float()
