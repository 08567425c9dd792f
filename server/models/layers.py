"""The shared decoder layers, configured per layer by a `LayerSpec` (server/models/layer_spec.py).

Module names follow the Hugging Face checkpoints (model.layers.N.self_attn.q_proj, ...,
pre_feedforward_layernorm, post_feedforward_layernorm), so weights load by name and a quantized Linear
can replace any projection without touching this file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from server.attention import AttentionBackend, AttentionMetadata
from server.models.arch import ArchConfig
from server.models.bf16_linear import Bf16GemmLinear
from server.models.cpu_fused import FusedOps
from server.models.layer_spec import LayerSpec, NormKind
from server.models.moe.block import SparseMoeBlock
from server.models.rope import apply_rotary
from server.quant.block_linear import BlockQuantLinear


class TokenEmbedding(nn.Embedding):
    """nn.Embedding ([vocab, hidden] weight) that leaves a meta weight uninitialized.

    The loaders build models on the meta device and load every weight afterwards; nn.Embedding's
    `normal_` on a meta tensor runs torch's Python meta kernel, whose first call imports torch._dynamo
    (and through it sympy, torch._inductor and triton where installed): 70-144 MiB of resident memory
    that a server never uses (measured by RSS, torch 2.13, 2026-12-05). Off the meta device (tests'
    random models) it initializes as nn.Embedding does."""

    def reset_parameters(self) -> None:
        if self.weight.is_meta:
            return
        super().reset_parameters()


class RMSNorm(nn.Module):
    def __init__(
        self, dim: int, eps: float, device: torch.device | str | None = None, kind: NormKind = "rms"
    ) -> None:
        super().__init__()
        # Gemma stores the weight zero-centred: (1 + w) scales, so a fresh norm is the identity either way.
        init = torch.zeros if kind == "rms_one_plus" else torch.ones
        self.weight = nn.Parameter(init(dim, device=device))
        self.eps = eps
        self.kind = kind
        # applied_weight's (1 + w), keyed by the weight's storage and version so a reload is seen
        self._applied: tuple[tuple[int, int], Tensor] | None = None

    def applied_weight(self) -> Tensor:  # [dim] fp32 contiguous: what multiplies the normalized x
        """The weight as the fused kernels apply it, in fp32: w (Llama) or 1 + w (Gemma), computed once (a
        bf16 model's too: its fused ops take fp32 weights)."""
        w = self.weight
        if self.kind == "rms" and w.dtype == torch.float32:
            return w
        key = (w.data_ptr(), w._version)
        if self._applied is None or self._applied[0] != key:
            one = 1.0 if self.kind == "rms_one_plus" else 0.0
            self._applied = (key, (one + w.detach().float()).contiguous())
        return self._applied[1]

    def forward(self, x: Tensor) -> Tensor:  # x: [..., dim]
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.kind == "rms_one_plus":
            return (h * (1.0 + self.weight.float())).to(dtype)  # Gemma: scaled in fp32, then cast
        # Normalise in fp32 and cast back before the weight, as the Llama reference does.
        return self.weight * h.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, spec: LayerSpec, device: torch.device | str | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, q_width, kv_width = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(h, q_width, bias=cfg.qkv_bias, device=device)
        self.k_proj = nn.Linear(h, kv_width, bias=cfg.qkv_bias, device=device)
        self.v_proj = nn.Linear(h, kv_width, bias=cfg.qkv_bias, device=device)
        self.o_proj = nn.Linear(q_width, h, bias=cfg.o_bias, device=device)
        eps = cfg.rms_norm_eps
        # head: each q and k head RMS-normalized over head_dim (Qwen3, Gemma 3); full: over the whole
        # projection output (OLMo 2). Both before RoPE.
        q_dim, k_dim = (q_width, kv_width) if spec.qk_norm == "full" else (self.head_dim, self.head_dim)
        has = spec.qk_norm != "none"
        self.q_norm = RMSNorm(q_dim, eps, device, spec.norm) if has else None
        self.k_norm = RMSNorm(k_dim, eps, device, spec.norm) if has else None
        self.full_qk_norm = spec.qk_norm == "full"
        # Set by serving_weights.prepare_for_serving: q/k/v in one matmul, replacing the three above.
        self.qkv_proj: nn.Module | None = None
        self.scale = spec.attn_scale
        self.softcap = spec.attn_softcap
        # Per-layer window (LayerSpec.sliding_window), handed to the attention backend.
        self.sliding_window = spec.sliding_window
        # The KV layer group whose caches and block tables this layer reads (server/core/kv_groups.py),
        # set by the ModelRunner that allocates the caches: windowed layers beside global ones have their own.
        self.kv_group = 0
        self.rope = spec.rope
        # gpt-oss's attention sinks (LayerSpec.attn_sinks), the checkpoint's `self_attn.sinks`: [Hq]
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads, device=device)) if spec.attn_sinks else None

    def forward(
        self,
        x: Tensor,  # [T, hidden]
        cos: Tensor | None,  # [T, 1, rotary_dim]; None: a layer without RoPE
        sin: Tensor | None,  # [T, 1, rotary_dim]
        k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        backend: AttentionBackend,
        ops: FusedOps | None = None,  # fp32 CPU: rotate in place with one compiled call
        qkv_dtype: torch.dtype | None = None,  # q, k, v's dtype where it is not x's (below)
        out_dtype: torch.dtype | None = None,  # the result's, where it is not o_proj's input's (below)
    ) -> Tensor:  # [T, hidden]
        """With `ops` (the fused CPU path, LlamaForCausalLM._forward_fused), cos and sin are [T, rotary_dim]
        and q/k norms and the rotary run in place on the fused projection's output; its fp32 stream may
        hand the fused qkv_proj a bf16 x (its bf16 GEMM's operand, qkv_dtype=float32) and take o_proj's
        bf16 result (out_dtype=bfloat16) where those GEMMs are bf16 (_bf16_gemm)."""
        t, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        meta = meta.group(self.kv_group)  # this layer's slots and block tables
        if self.qkv_proj is not None and (not self.full_qk_norm or ops is not None):
            # [T, (Hq + 2 Hkv) * D]
            qkv = self.qkv_proj(x) if qkv_dtype is None else self.qkv_proj(x, out_dtype=qkv_dtype)
            qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
            if self.q_norm is not None and self.k_norm is not None:
                if self.full_qk_norm:
                    assert ops is not None
                    # OLMo 2: one norm over each whole projection, a [T, 1, width] "head" in place
                    _head_norm(qkv[:, : hq * d].unsqueeze(1), self.q_norm, ops)
                    _head_norm(qkv[:, hq * d : (hq + hkv) * d].unsqueeze(1), self.k_norm, ops)
                else:
                    qk = self.qk_normed(qk, ops)
            if cos is not None and sin is not None:
                qk = _rotate(qk, cos, sin, ops)
            q, k = qk[:, :hq], qk[:, hq:]
            v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
        else:
            if self.qkv_proj is not None:
                qf, kf, vf = self.qkv_proj(x).split((hq * d, hkv * d, hkv * d), dim=-1)
            else:
                qf, kf, vf = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            if self.full_qk_norm and self.q_norm is not None and self.k_norm is not None:
                if ops is not None and self.qkv_proj is None:  # in place on the fresh q / k outputs
                    _head_norm(qf.unsqueeze(1), self.q_norm, ops)
                    _head_norm(kf.unsqueeze(1), self.k_norm, ops)
                else:
                    qf, kf = self.q_norm(qf), self.k_norm(kf)
            q, k, v = qf.reshape(t, hq, d), kf.reshape(t, hkv, d), vf.reshape(t, hkv, d)
            if not self.full_qk_norm and self.q_norm is not None and self.k_norm is not None:
                q, k = _head_norm(q, self.q_norm, ops), _head_norm(k, self.k_norm, ops)
            if cos is not None and sin is not None:
                q, k = _rotate(q, cos, sin, ops), _rotate(k, cos, sin, ops)
        # a bf16 out_dtype: the o projection's bf16 GEMM takes a bf16 attention output as its operand
        o = backend.forward(
            q,
            k,
            v,
            k_cache,
            v_cache,
            meta,
            self.scale,
            out_dtype=out_dtype,
            sliding_window=self.sliding_window,
            # the backends take fp32 logits (a no-op for an fp32 model; 64 values otherwise)
            sinks=None if self.sinks is None else self.sinks.float().contiguous(),
            softcap=self.softcap or 0.0,  # Gemma 2's attn_logit_softcapping; 0: none
        ).reshape(t, hq * d)
        return self.o_proj(o) if out_dtype is None else self.o_proj(o, out_dtype=out_dtype)

    def qk_normed(self, qk: Tensor, ops: FusedOps | None) -> Tensor:
        """qk: [T, Hq + Hkv, D], q heads then k heads (a view into the fused projection's output) ->
        q_norm / k_norm applied per head: in place with `ops`, else a new [T, Hq + Hkv, D] tensor."""
        assert self.q_norm is not None and self.k_norm is not None
        hq = self.num_heads
        if ops is not None:
            _head_norm(qk[:, :hq], self.q_norm, ops)
            _head_norm(qk[:, hq:], self.k_norm, ops)
            return qk
        return torch.cat((self.q_norm(qk[:, :hq]), self.k_norm(qk[:, hq:])), dim=1)


def _head_norm(x: Tensor, norm: RMSNorm, ops: FusedOps | None) -> Tensor:  # x: [T, H, D]
    if ops is None:
        return norm(x)  # over the last dim, D
    # In place, like the rotary: x is a projection's fresh output.
    ops.head_rms_norm(x, norm.applied_weight(), norm.eps)
    return x


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, ops: FusedOps | None) -> Tensor:  # x: [T, H, D]
    if ops is None:
        return apply_rotary(x, cos, sin)  # cos, sin: [T, 1, R]
    # In place (cos, sin: [T, D]): x is a projection's fresh output, never a weight.
    ops.rotary(x, cos, sin)
    return x


def bf16_gemm(proj: nn.Module | None, rows: int) -> bool:
    """Whether `proj` multiplies `rows` rows in a bf16 GEMM with nothing after it (BlockQuantLinear.bf16_gemm,
    Bf16GemmLinear.bf16_gemm): it then takes a bf16 x and can return its bf16 result as is."""
    return isinstance(proj, (BlockQuantLinear, Bf16GemmLinear)) and proj.bf16_gemm(rows)


def bf16_chain(gate_up: nn.Module | None, down: nn.Module, rows: int) -> bool:
    return bf16_gemm(gate_up, rows) and bf16_gemm(down, rows)


class MLP(nn.Module):
    def __init__(
        self, cfg: ArchConfig, device: torch.device | str | None, spec: LayerSpec | None = None
    ) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias, device=device)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias, device=device)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias, device=device)
        # Set by serving_weights.prepare_for_serving: gate and up in one matmul.
        self.gate_up_proj: nn.Module | None = None
        self.activation = "silu" if spec is None else spec.activation

    def forward(self, x: Tensor, ops: FusedOps | None = None) -> Tensor:  # x: [T, hidden]
        silu = self.activation == "silu"
        if self.gate_up_proj is not None:
            if ops is not None and bf16_chain(self.gate_up_proj, self.down_proj, x.shape[0]):
                # Both GEMMs in bf16: gate_up's bf16 result goes into the activation as is and its bf16
                # output into down, bit-identical to widening both and rounding again (cpu_fused.act_mul).
                act = ops.act_mul(self.gate_up_proj(x, out_dtype=torch.bfloat16), self.activation)
                return self.down_proj(act, out_dtype=x.dtype)  # act: [T, intermediate] bf16
            gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
            if ops is not None:  # fp32 CPU: act(gate) * up in one compiled call
                return self.down_proj(ops.act_mul(gate_up, self.activation))
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        # in place: one fewer [T, intermediate] temporary, ~30% faster at prefill sizes (measured here)
        if silu:
            return self.down_proj(F.silu(gate).mul_(up))
        return self.down_proj(F.gelu(gate, approximate="tanh").mul_(up))


@dataclass(frozen=True)
class LayerNorms:
    """A layer's norms by role (None: its placement has none there), as the fused path and the decode graph
    apply them: pre (Llama) attn_in, mlp_in; post (OLMo 2) attn_out, mlp_out, the sub-blocks reading the
    residual stream itself; sandwich (Gemma 2/3) all four."""

    attn_in: RMSNorm | None
    attn_out: RMSNorm | None
    mlp_in: RMSNorm | None
    mlp_out: RMSNorm | None


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ArchConfig, device: torch.device | str | None, spec: LayerSpec | None = None
    ) -> None:
        super().__init__()
        spec = spec or cfg.layer_specs[0]
        self.spec = spec
        self.self_attn = Attention(cfg, spec, device)
        # "moe" layers: the model's mixture-of-experts block (ArchConfig.moe), under the same name
        self.mlp: MLP | SparseMoeBlock
        if spec.mlp == "moe":
            assert cfg.moe is not None  # ArchConfig checks it
            self.mlp = SparseMoeBlock(cfg.moe, device)
        else:
            self.mlp = MLP(cfg, device, spec)
        h, eps, kind = cfg.hidden_size, cfg.rms_norm_eps, spec.norm
        # pre: input_layernorm, post_attention_layernorm (before the MLP, Llama's name);
        # post (OLMo 2): post_attention_layernorm, post_feedforward_layernorm, on the sub-block outputs;
        # sandwich (Gemma 2/3): all four.
        if spec.norm_placement in ("pre", "sandwich"):
            self.input_layernorm = RMSNorm(h, eps, device, kind)
        self.post_attention_layernorm = RMSNorm(h, eps, device, kind)
        if spec.norm_placement == "sandwich":
            self.pre_feedforward_layernorm = RMSNorm(h, eps, device, kind)
        if spec.norm_placement in ("post", "sandwich"):
            self.post_feedforward_layernorm = RMSNorm(h, eps, device, kind)

    def forward(
        self,
        h: Tensor,  # [T, hidden], the residual stream
        cos: Tensor | None,  # [T, 1, rotary_dim] or None (no RoPE)
        sin: Tensor | None,
        k_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> Tensor:  # [T, hidden]
        placement, m = self.spec.norm_placement, self.spec.residual_multiplier
        attn, mlp = self.self_attn, self.mlp
        if placement == "pre":
            a = attn(self.input_layernorm(h), cos, sin, k_cache, v_cache, meta, backend)
            h = h + (a if m == 1.0 else a * m)
            f = mlp(self.post_attention_layernorm(h))
            return h + (f if m == 1.0 else f * m)
        if placement == "post":
            h = h + self.post_attention_layernorm(attn(h, cos, sin, k_cache, v_cache, meta, backend))
            return h + self.post_feedforward_layernorm(mlp(h))
        a = attn(self.input_layernorm(h), cos, sin, k_cache, v_cache, meta, backend)
        h = h + self.post_attention_layernorm(a)
        return h + self.post_feedforward_layernorm(mlp(self.pre_feedforward_layernorm(h)))

    def norms(self) -> LayerNorms:
        placement = self.spec.norm_placement
        if placement == "pre":
            return LayerNorms(self.input_layernorm, None, self.post_attention_layernorm, None)
        if placement == "post":
            return LayerNorms(None, self.post_attention_layernorm, None, self.post_feedforward_layernorm)
        return LayerNorms(
            self.input_layernorm,
            self.post_attention_layernorm,
            self.pre_feedforward_layernorm,
            self.post_feedforward_layernorm,
        )
