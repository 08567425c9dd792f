"""Our decoder-only model over the paged KV cache, for every registered architecture
(server/models/registry.py): the shared layers (layers.py) configured by the layer contract
(`ArchConfig.layers`). Models made only of Llama layers (`ArchConfig.is_llama`) also get the compiled
fp32 CPU path and the decode graph.

Module names follow the Hugging Face checkpoints (model.layers.N.self_attn.q_proj, ...), so weights
load by name and a quantized Linear can replace any projection without touching this file.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from server.attention import AttentionBackend, AttentionMetadata
from server.models import layers as shared
from server.models.arch import ArchConfig
from server.models.cpu_fused import FusedOps
from server.models.decode_graph import DecodeGraph, cache_pointers
from server.models.layers import MLP, Attention, DecoderLayer, RMSNorm
from server.models.rope import RotaryEmbedding, apply_rotary

__all__ = [
    "MLP",
    "Attention",
    "DecoderLayer",
    "LlamaForCausalLM",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary",
]


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, device: torch.device | str | None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, device, spec) for spec in cfg.layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, cfg.final_norm)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ArchConfig, max_positions: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, device)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device)
        self.build_rotary(max_positions)
        # Set by serving_weights.prepare_for_serving on CPU: fp32 steps then run the fused ops.
        self.fused_ops: FusedOps | None = None
        # Pure-decode steps through one compiled call when the model allows (decode_graph.py): recorded
        # at the first such step, for the KV cache tensors it ran with (None: not possible).
        self.use_decode_graph = True
        self._decode_graph: tuple[tuple[int, ...], DecodeGraph | None] | None = None

    def build_rotary(self, max_positions: int) -> None:
        """The cos/sin tables of every distinct RopeSpec among the layers, for positions < max_positions."""
        specs = list(dict.fromkeys(s.rope for s in self.config.layers if s.rope is not None))
        mpe = self.config.max_position_embeddings
        self.rotaries = nn.ModuleList(RotaryEmbedding(spec, max_positions, mpe) for spec in specs)
        self._rope_index = {spec: i for i, spec in enumerate(specs)}

    @property
    def rotary(self) -> RotaryEmbedding:
        """The first layer's rotary (the only one of a Llama-layer model)."""
        r = self.rotaries[0]
        assert isinstance(r, RotaryEmbedding)
        return r

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
        cfg = self.config
        if (
            self.fused_ops is not None
            and h.dtype == torch.float32
            and h.device.type == "cpu"
            and cfg.is_llama
        ):
            return self._forward_fused(h, positions, kv_caches, meta, backend, self.fused_ops)
        if cfg.embedding_multiplier != 1.0:
            # Gemma rounds its sqrt(hidden) normalizer to the activation dtype first (as transformers)
            h = h * torch.tensor(cfg.embedding_multiplier, dtype=h.dtype)
        tables = [r.cos_sin(positions, h.dtype) for r in self.rotaries if isinstance(r, RotaryEmbedding)]
        for layer, (k_cache, v_cache) in zip(self.decoder_layers(), kv_caches, strict=True):
            rope = layer.spec.rope
            cos, sin = tables[self._rope_index[rope]] if rope is not None else (None, None)
            h = layer(h, cos, sin, k_cache, v_cache, meta, backend)
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
                graph_new = DecodeGraph.build(
                    self.decoder_layers(), self.model.norm, self.config, kv_caches, backend, ops
                )
                self._decode_graph = (key, graph_new)
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
            assert isinstance(mlp, MLP)  # cfg.is_llama: every layer's MLP is dense
            # Where a projection's GEMM is bf16 (prefill-sized batches), the norm hands it a bf16 operand
            # and takes its bf16 result as the next delta: the values of rounding and widening around an
            # fp32 stream, without the [T, H] fp32 <-> bf16 copies (the residual stream h stays fp32).
            x_dtype = bf16 if shared.bf16_gemm(attn.qkv_proj, t) else fp32
            x = ops.add_rms_norm(h, delta, norm1.weight, norm1.eps, out_dtype=x_dtype)
            a_dtype = bf16 if shared.bf16_gemm(attn.o_proj, t) else None
            qkv_dtype = fp32 if x_dtype == bf16 else None
            a = attn(
                x, cos, sin, k_cache, v_cache, meta, backend, ops, qkv_dtype=qkv_dtype, out_dtype=a_dtype
            )
            x_dtype = bf16 if shared.bf16_chain(mlp.gate_up_proj, mlp.down_proj, t) else fp32
            x = ops.add_rms_norm(h, a, norm2.weight, norm2.eps, out_dtype=x_dtype)
            delta = mlp(x, ops)  # bf16 where x is (MLP.forward's bf16 chain), else fp32
        return ops.add_rms_norm(h, delta, self.model.norm.weight, self.model.norm.eps)

    def compute_logits(self, hidden: Tensor) -> Tensor:  # hidden: [N, hidden] -> [N, vocab] fp32
        logits = self.lm_head(hidden).float()
        cfg = self.config
        if cfg.logits_divisor != 1.0:
            logits = logits / cfg.logits_divisor
        if cfg.final_logit_softcap is not None:
            logits = torch.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
        return logits
