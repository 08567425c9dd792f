"""Our decoder-only model over the paged KV cache, for every registered architecture
(server/models/registry.py): the shared layers (layers.py) configured by the layer contract
(`ArchConfig.layers`). On CPU in fp32 every model gets the compiled fused ops (`ArchConfig.fused_cpu`),
whatever its layer kind (norms, activation, rotary, window, multipliers, attention sinks: the layer
contract's fields, read as data); a mixture-of-experts layer's MLP is its own block (SparseMoeBlock, one
native experts call) between the fused norms. Models whose layers all have a dense MLP also get the decode
graph (decode_graph.layer_refusal says what it refuses).

Module names follow the Hugging Face checkpoints (model.layers.N.self_attn.q_proj, ...), so weights
load by name and a quantized Linear can replace any projection without touching this file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from server.attention import AttentionBackend, AttentionMetadata
from server.models import layers as shared
from server.models.arch import ArchConfig
from server.models.cpu_bf16_gemm import Bf16PanelLinear
from server.models.cpu_fused import FusedOps
from server.models.decode_graph import DecodeGraph, cache_pointers
from server.models.layer_spec import RopeSpec
from server.models.layers import MLP, Attention, DecoderLayer, RMSNorm, TokenEmbedding
from server.models.moe.block import SparseMoeBlock
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


@dataclass
class _Pending:
    """The residual add a sub-block still owes: its output, its post-norm (None: none), the multiplier."""

    delta: Tensor  # [T, hidden] the stream's dtype, or a bf16 GEMM's own bf16 result where post is None
    post: RMSNorm | None
    mult: float

    @property
    def simple(self) -> bool:  # x += delta: what add_rms_norm folds into the next norm, any dtype
        return self.post is None and self.mult == 1.0


def _residual(
    ops: FusedOps,
    h: Tensor,  # [T, hidden] fp32 or bf16 (a bf16 model's), the residual stream, updated in place
    pending: _Pending | None,
    norm: RMSNorm | None,  # the next norm; None: the next sub-block reads h itself (post placement)
    out_dtype: torch.dtype,  # an fp32 stream's: bf16 only with a simple pending (or none) and a next norm
) -> Tensor | None:  # [T, hidden] out_dtype: norm(h) after the add, None without a norm
    simple = pending is None or pending.simple
    delta = None if pending is None else pending.delta
    if norm is not None and simple:  # the Llama layer's add + norm, any dtype pair
        return ops.add_rms_norm(h, delta, norm.applied_weight(), norm.eps, out_dtype=out_dtype)
    assert out_dtype == h.dtype
    post = None if pending is None or pending.post is None else pending.post
    return ops.residual_norm(
        h,
        None if delta is None else delta.to(h.dtype),  # a no-op but for a bf16 GEMM's result in fp32
        None if post is None else (post.applied_weight(), post.eps),
        1.0 if pending is None else pending.mult,
        None if norm is None else (norm.applied_weight(), norm.eps),
    )


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, device: torch.device | str | None) -> None:
        super().__init__()
        self.embed_tokens = TokenEmbedding(cfg.vocab_size, cfg.hidden_size, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, device, spec) for spec in cfg.layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, cfg.final_norm)


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, cfg: ArchConfig, max_positions: int | None, device: torch.device | str | None = None
    ) -> None:
        """`max_positions`: the rotary tables' length; None leaves them to `build_rotary`, as the loaders
        do: they build on the meta device, where computing the tables would import torch._dynamo
        (layers.TokenEmbedding)."""
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, device)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device)
        self.rotaries = nn.ModuleList()
        self._rope_index: dict[RopeSpec, int] = {}
        if max_positions is not None:
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

    def rope_indices(self) -> list[int]:
        """Per layer, the index of its table in `rotaries`; -1 for a layer without RoPE."""
        return [-1 if s.rope is None else self._rope_index[s.rope] for s in self.config.layers]

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
        if cfg.embedding_multiplier != 1.0:
            # Gemma rounds its sqrt(hidden) normalizer to the activation dtype first (as transformers)
            h = h * torch.tensor(cfg.embedding_multiplier, dtype=h.dtype)
        if (
            self.fused_ops is not None
            and h.device.type == "cpu"
            and (
                (h.dtype == torch.float32 and cfg.fused_cpu)
                or (h.dtype == torch.bfloat16 and cfg.fused_cpu_bf16)
            )
        ):
            return self._forward_fused(h, positions, kv_caches, meta, backend, self.fused_ops)
        tables = [r.cos_sin(positions, h.dtype) for r in self.rotaries if isinstance(r, RotaryEmbedding)]
        for layer, (k_cache, v_cache) in zip(self.decoder_layers(), kv_caches, strict=True):
            rope = layer.spec.rope
            cos, sin = tables[self._rope_index[rope]] if rope is not None else (None, None)
            h = layer(h, cos, sin, k_cache, v_cache, meta, backend)
        return self.model.norm(h)

    def _forward_fused(
        self,
        h: Tensor,  # [T, hidden] fp32, the (scaled) embeddings
        positions: Tensor,  # [T] int64
        kv_caches: list[tuple[Tensor, Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        ops: FusedOps,
    ) -> Tensor:  # [T, hidden] h's dtype
        # forward() with each residual add folded into the next norm (one call for post-norm + add +
        # norm: _residual), q/k norms and the rotary in place and act * up in one call: ~10 calls per layer
        # instead of ~35 torch ops. Every layer kind as its LayerSpec says; decode_graph.py replays it.
        # A bf16 h (a bf16 model, ArchConfig.fused_cpu_bf16) stays a bf16 stream (`narrow`): every op
        # computes in fp32 and rounds what it writes once; its rotary tables rounded to bf16 first, as
        # torch's path's; no decode graph (its projections are not BlockQuantLinear).
        h = h.contiguous() if h._base is None else h.clone()  # the residual stream, updated in place
        stream = h.dtype
        # per rotary: cos, sin [T, rotary_dim] each, fp32
        tables = [
            (r.cos[positions], r.sin[positions])
            if stream == torch.float32
            else (r.cos[positions].to(stream).float(), r.sin[positions].to(stream).float())
            for r in self.rotaries
            if isinstance(r, RotaryEmbedding)
        ]
        if (
            stream == torch.float32
            and self.use_decode_graph
            and meta.max_query_len == 1
            and meta.num_seqs == h.shape[0] <= DecodeGraph.MAX_ROWS
        ):
            key = cache_pointers(kv_caches)
            if self._decode_graph is None or self._decode_graph[0] != key:
                graph_new = DecodeGraph.build(
                    self.decoder_layers(),
                    self.model.norm,
                    self.config,
                    kv_caches,
                    backend,
                    ops,
                    self.rope_indices(),
                )
                self._decode_graph = (key, graph_new)
            graph = self._decode_graph[1]
            if graph is not None and h.shape[0] <= graph.max_rows:
                return graph.run(h, tables, meta)
        pending: _Pending | None = None
        t, bf16, fp32 = h.shape[0], torch.bfloat16, torch.float32
        narrow = stream == bf16  # a bf16 model: every operand and every delta is bf16 as it is
        for layer, (k_cache, v_cache), rope in zip(
            self.decoder_layers(), kv_caches, self.rope_indices(), strict=True
        ):
            norms, attn, mlp, mult = layer.norms(), layer.self_attn, layer.mlp, layer.spec.residual_multiplier
            # Where a projection's GEMM is bf16 (prefill-sized batches), the norm hands it a bf16 operand
            # and takes its bf16 result as the next delta: the values of rounding and widening around an
            # fp32 stream, without the [T, H] fp32 <-> bf16 copies (the residual stream h stays fp32).
            # Only around a plain add + norm (Llama's placement): a post-norm or multiplier works in fp32.
            plain = (pending is None or pending.simple) and norms.attn_in is not None
            x_dtype = bf16 if narrow or (plain and shared.bf16_gemm(attn.qkv_proj, t)) else fp32
            x = _residual(ops, h, pending, norms.attn_in, x_dtype)
            plain = norms.attn_out is None and mult == 1.0 and norms.mlp_in is not None
            a_dtype = bf16 if not narrow and plain and shared.bf16_gemm(attn.o_proj, t) else None
            qkv_dtype = fp32 if x_dtype == bf16 and not narrow else None
            cos, sin = tables[rope] if rope >= 0 else (None, None)
            a = attn(
                h if x is None else x,
                cos,
                sin,
                k_cache,
                v_cache,
                meta,
                backend,
                ops,
                qkv_dtype=qkv_dtype,
                out_dtype=a_dtype,
            )
            if isinstance(mlp, SparseMoeBlock):
                # the router and the experts' native call take fp32 rows; the block returns fp32 (a bf16
                # stream has no MoE layer: ArchConfig.fused_cpu_bf16)
                x = _residual(ops, h, _Pending(a, norms.attn_out, mult), norms.mlp_in, fp32)
                pending = _Pending(mlp(h if x is None else x), norms.mlp_out, mult)
                continue
            x_dtype = (
                bf16 if narrow or (plain and shared.bf16_chain(mlp.gate_up_proj, mlp.down_proj, t)) else fp32
            )
            x = _residual(ops, h, _Pending(a, norms.attn_out, mult), norms.mlp_in, x_dtype)
            # bf16 where x is (MLP.forward's bf16 chain), else fp32
            pending = _Pending(mlp(h if x is None else x, ops), norms.mlp_out, mult)
        out = _residual(ops, h, pending, self.model.norm, stream)
        assert out is not None
        return out

    def compute_logits(self, hidden: Tensor) -> Tensor:  # hidden: [N, hidden] -> [N, vocab] fp32
        head = self.lm_head
        logits = head.widened(hidden) if isinstance(head, Bf16PanelLinear) else head(hidden).float()
        cfg = self.config
        if cfg.logits_divisor != 1.0:
            logits = logits / cfg.logits_divisor
        if cfg.final_logit_softcap is not None:
            logits = torch.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
        return logits
