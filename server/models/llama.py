"""Our Llama-family model (Llama, SmolLM2, Mistral, Qwen2, Qwen3) over the paged KV cache.

Module names follow the Hugging Face checkpoints (model.layers.N.self_attn.q_proj, ...), so weights
load by name and a quantized Linear can replace any projection without touching this file.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from server.attention import AttentionBackend, AttentionMetadata
from server.models.arch import ArchConfig
from server.models.cpu_fused import FusedOps
from server.models.decode_graph import DecodeGraph, cache_pointers
from server.quant.block_linear import BlockQuantLinear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:  # x: [T, dim]
        # Normalise in fp32 and cast back before the weight, as the reference implementation does.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def _rope_inv_freq(cfg: ArchConfig) -> Tensor:  # [head_dim / 2] fp32
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = dict(cfg.rope_scaling or ())
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    cos: Tensor  # [max_positions, head_dim] fp32
    sin: Tensor  # [max_positions, head_dim] fp32, first half negated (see apply_rotary)

    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = _rope_inv_freq(cfg)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        self.register_buffer("cos", torch.cat((freqs.cos(), freqs.cos()), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((-freqs.sin(), freqs.sin()), dim=-1), persistent=False)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        # positions: [T] -> cos, sin: [T, 1, head_dim] in the activation dtype, once per step for all layers
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [T, H, D]; cos, sin: [T, 1, D] -> [T, H, D]
    # The reference computes x * cos + cat(-x2, x1) * sin; with the sign folded into `sin` the rotated
    # half is a plain roll, and q and k go through together: 3 ops per layer instead of 10, which
    # matters in decode steps where each op costs more in dispatch than in math.
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, device: torch.device | str | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=cfg.qkv_bias, device=device)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias, device=device)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias, device=device)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=cfg.o_bias, device=device)
        # Qwen3: each q and k head RMS-normalized over head_dim (one [head_dim] weight for all heads), before RoPE.
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, device) if cfg.qk_norm else None
        # Set by serving_weights.prepare_for_serving: q/k/v in one matmul, replacing the three above.
        self.qkv_proj: nn.Module | None = None
        self.scale = self.head_dim**-0.5
        # This layer's sliding window (ArchConfig.layer_sliding_window), handed to the attention backend.
        self.sliding_window: int | None = None

    def forward(
        self,
        x: Tensor,  # [T, hidden]
        cos: Tensor,  # [T, 1, head_dim]
        sin: Tensor,  # [T, 1, head_dim]
        k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        backend: AttentionBackend,
        ops: FusedOps | None = None,  # fp32 CPU: rotate in place with one compiled call
        qkv_dtype: torch.dtype | None = None,  # q, k, v's dtype where it is not x's (below)
        out_dtype: torch.dtype | None = None,  # the result's, where it is not o_proj's input's (below)
    ) -> Tensor:  # [T, hidden]
        """With `ops`, cos and sin are [T, head_dim] (LlamaForCausalLM._forward_fused), whose fp32 stream
        may hand the fused qkv_proj a bf16 x (its bf16 GEMM's operand, qkv_dtype=float32) and take
        o_proj's bf16 result (out_dtype=bfloat16) where those GEMMs are bf16 (_bf16_gemm)."""
        t, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            # [T, (Hq + 2 Hkv) * D]
            qkv = self.qkv_proj(x) if qkv_dtype is None else self.qkv_proj(x, out_dtype=qkv_dtype)
            qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
            if self.q_norm is not None and self.k_norm is not None:
                qk = self.qk_normed(qk, ops)
            qk = _rotate(qk, cos, sin, ops)
            q, k = qk[:, :hq], qk[:, hq:]
            v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
        else:
            q, k = self.q_proj(x).view(t, hq, d), self.k_proj(x).view(t, hkv, d)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = _head_norm(q, self.q_norm, ops), _head_norm(k, self.k_norm, ops)
            q, k = _rotate(q, cos, sin, ops), _rotate(k, cos, sin, ops)
            v = self.v_proj(x).view(t, hkv, d)
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
    ops.head_rms_norm(x, norm.weight, norm.eps)
    return x


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, ops: FusedOps | None) -> Tensor:  # x: [T, H, D]
    if ops is None:
        return apply_rotary(x, cos, sin)  # cos, sin: [T, 1, D]
    # In place (cos, sin: [T, D]): x is a projection's fresh output, never a weight.
    ops.rotary(x, cos, sin)
    return x


def _bf16_gemm(proj: nn.Module | None, rows: int) -> bool:
    """Whether `proj` multiplies `rows` rows in the bf16 library GEMM with nothing after it
    (BlockQuantLinear.bf16_gemm): it then takes a bf16 x and can return its bf16 result as is."""
    return isinstance(proj, BlockQuantLinear) and proj.bf16_gemm(rows)


def _bf16_chain(gate_up: nn.Module | None, down: nn.Module, rows: int) -> bool:
    return _bf16_gemm(gate_up, rows) and _bf16_gemm(down, rows)


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig, device: torch.device | str | None) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias, device=device)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias, device=device)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias, device=device)
        # Set by serving_weights.prepare_for_serving: gate and up in one matmul.
        self.gate_up_proj: nn.Module | None = None

    def forward(self, x: Tensor, ops: FusedOps | None = None) -> Tensor:  # x: [T, hidden]
        if self.gate_up_proj is not None:
            if ops is not None and _bf16_chain(self.gate_up_proj, self.down_proj, x.shape[0]):
                # Both GEMMs in bf16: gate_up's bf16 result goes into silu_mul as is and its bf16 output
                # into down, bit-identical to widening both and rounding again (cpu_fused.silu_mul).
                act = ops.silu_mul(self.gate_up_proj(x, out_dtype=torch.bfloat16))  # [T, intermediate] bf16
                return self.down_proj(act, out_dtype=x.dtype)
            gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
            if ops is not None:  # fp32 CPU: silu * up in one compiled call
                return self.down_proj(ops.silu_mul(gate_up))
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        # in place: one fewer [T, intermediate] temporary, ~30% faster at prefill sizes (measured here)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, device: torch.device | str | None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, device)
        self.mlp = MLP(cfg, device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, device: torch.device | str | None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device)
        layers = [DecoderLayer(cfg, device) for _ in range(cfg.num_layers)]
        for i, layer in enumerate(layers):
            layer.self_attn.sliding_window = cfg.layer_sliding_window(i)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ArchConfig, max_positions: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, device)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device)
        self.rotary = RotaryEmbedding(cfg, max_positions)
        # Set by serving_weights.prepare_for_serving on CPU: fp32 steps then run the fused ops.
        self.fused_ops: FusedOps | None = None
        # Pure-decode steps through one compiled call when the model allows (decode_graph.py): recorded
        # at the first such step, for the KV cache tensors it ran with (None: not possible).
        self.use_decode_graph = True
        self._decode_graph: tuple[tuple[int, ...], DecodeGraph | None] | None = None

    def decoder_layers(self) -> list[DecoderLayer]:
        layers = list(self.model.layers)
        assert all(isinstance(layer, DecoderLayer) for layer in layers)
        return layers  # type: ignore[return-value]

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: Tensor,  # [T] int64
        positions: Tensor,  # [T] int64
        kv_caches: list[tuple[Tensor, Tensor]],  # per layer: 2 x [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> Tensor:  # [T, hidden]
        h = self.model.embed_tokens(input_ids)
        if self.fused_ops is not None and h.dtype == torch.float32 and h.device.type == "cpu":
            return self._forward_fused(h, positions, kv_caches, meta, backend, self.fused_ops)
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        for layer, (k_cache, v_cache) in zip(self.decoder_layers(), kv_caches, strict=True):
            h = h + layer.self_attn(layer.input_layernorm(h), cos, sin, k_cache, v_cache, meta, backend)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.norm(h)

    def _forward_fused(
        self,
        h: Tensor,  # [T, hidden] fp32, the embeddings
        positions: Tensor,  # [T] int64
        kv_caches: list[tuple[Tensor, Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        ops: FusedOps,
    ) -> Tensor:  # [T, hidden]
        # forward() with each residual add folded into the next RMSNorm (one call for add + norm), the
        # rotary in place and silu * up in one call: ~10 calls per layer instead of ~35 torch ops.
        h = h.contiguous() if h._base is None else h.clone()  # the residual stream, updated in place
        cos, sin = self.rotary.cos[positions], self.rotary.sin[positions]  # [T, head_dim] each
        if (
            self.use_decode_graph
            and meta.max_query_len == 1
            and meta.num_seqs == h.shape[0] <= DecodeGraph.MAX_ROWS
        ):
            key = cache_pointers(kv_caches)
            if self._decode_graph is None or self._decode_graph[0] != key:
                self._decode_graph = (key, DecodeGraph.build(self, kv_caches, backend, ops))
            graph = self._decode_graph[1]
            if graph is not None and h.shape[0] <= graph.max_rows:
                return graph.run(h, cos, sin, meta)
        delta: Tensor | None = None
        t, bf16, fp32 = h.shape[0], torch.bfloat16, torch.float32
        for layer, (k_cache, v_cache) in zip(self.decoder_layers(), kv_caches, strict=True):
            norm1, norm2, attn, mlp = (
                layer.input_layernorm,
                layer.post_attention_layernorm,
                layer.self_attn,
                layer.mlp,
            )
            # Where a projection's GEMM is bf16 (prefill-sized batches), the norm hands it a bf16 operand
            # and takes its bf16 result as the next delta: the values of rounding and widening around an
            # fp32 stream, without the [T, H] fp32 <-> bf16 copies (the residual stream h stays fp32).
            x_dtype = bf16 if _bf16_gemm(attn.qkv_proj, t) else fp32
            x = ops.add_rms_norm(h, delta, norm1.weight, norm1.eps, out_dtype=x_dtype)
            a_dtype = bf16 if _bf16_gemm(attn.o_proj, t) else None
            qkv_dtype = fp32 if x_dtype == bf16 else None
            a = attn(
                x, cos, sin, k_cache, v_cache, meta, backend, ops, qkv_dtype=qkv_dtype, out_dtype=a_dtype
            )
            x_dtype = bf16 if _bf16_chain(mlp.gate_up_proj, mlp.down_proj, t) else fp32
            x = ops.add_rms_norm(h, a, norm2.weight, norm2.eps, out_dtype=x_dtype)
            delta = mlp(x, ops)  # bf16 where x is (MLP.forward's bf16 chain), else fp32
        return ops.add_rms_norm(h, delta, self.model.norm.weight, self.model.norm.eps)

    def compute_logits(self, hidden: Tensor) -> Tensor:  # hidden: [N, hidden] -> [N, vocab] fp32
        return self.lm_head(hidden).float()
