"""The architecture of a Llama-family checkpoint, read from its config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.models.layer_spec import LayerSpec, NormKind, RopeSpec, UnsupportedModelError
from server.models.moe.config import MoEConfig

# config.json's layer_types values (transformers' ALLOWED_LAYER_TYPES subset we serve)
LAYER_TYPES = ("full_attention", "sliding_attention")

__all__ = ["BASE_MODEL_ARCHITECTURES", "ArchConfig", "UnsupportedModelError", "rope_spec_from_hf"]

# Headless base models (a sentence-transformers folder around a decoder saves these): served as
# embedders only (server/pooling/model.py), never for generation
BASE_MODEL_ARCHITECTURES = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
    "Gemma2Model": "Gemma2ForCausalLM",  # BAAI/bge-multilingual-gemma2 (attention soft-capped)
    "Gemma3TextModel": "Gemma3ForCausalLM",  # EmbeddingGemma (bidirectional: archs/gemma.py)
}


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    # Qwen3: per-head RMSNorm of q and k (weights [head_dim], eps rms_norm_eps) between projection and RoPE
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # The layer contract (layer_spec.py): one spec per layer; empty -> the Llama layer from the fields above.
    layers: tuple[LayerSpec, ...] = ()
    # Model-level: embeddings * embedding_multiplier (Granite; Gemma's sqrt(hidden)), logits /
    # logits_divisor (Granite's logits_scaling), then cap * tanh(logits / cap) (Gemma 2's
    # final_logit_softcapping); the final norm's kind.
    embedding_multiplier: float = 1.0
    logits_divisor: float = 1.0
    final_logit_softcap: float | None = None
    final_norm: NormKind = "rms"
    model_type: str = "llama"
    # The mixture-of-experts block of every layer whose LayerSpec.mlp is "moe" (routing, sizes, shared
    # expert: server/models/moe/config.py); None for a dense model. Dense layers of a MoE model
    # (Qwen2-MoE's mlp_only_layers) keep `intermediate_size`.
    moe: MoEConfig | None = None
    # Non-causal attention (EmbeddingGemma's use_bidirectional_attention): every query sees every key,
    # a windowed layer's those with |query - key| < its sliding_window. Only the pooling encoder
    # (server/pooling/decoder.py) runs it; the loader refuses such a model for generation.
    bidirectional: bool = False

    def __post_init__(self) -> None:
        if not self.layers:
            rope = RopeSpec(self.rope_theta, self.head_dim, self.rope_scaling)
            spec = LayerSpec(rope, self.head_dim**-0.5, qk_norm="head" if self.qk_norm else "none")
            object.__setattr__(self, "layers", (spec,) * self.num_layers)
        if len(self.layers) != self.num_layers:
            raise UnsupportedModelError(f"{len(self.layers)} layer specs for {self.num_layers} layers")
        if self.is_moe and self.moe is None:
            raise UnsupportedModelError(
                "a layer's MLP is a mixture of experts but the config has no MoE block"
            )
        if self.moe is not None and self.moe.hidden_size != self.hidden_size:
            raise UnsupportedModelError(
                f"MoE hidden size {self.moe.hidden_size} differs from hidden_size {self.hidden_size}"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def num_parameters(self) -> int:
        """Logical parameter count, the same whether the weights are dense or packed."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
        dense_mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        norms = 0
        layers = 0
        for spec in self.layers:
            layers += attn + (self.moe_parameters if spec.mlp == "moe" else dense_mlp)
            norms += h * {"pre": 2, "post": 2, "sandwich": 4}[spec.norm_placement]
            norms += {"none": 0, "head": 2 * d, "full": q + kv}[spec.qk_norm]
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + layers + norms + h

    @property
    def moe_parameters(self) -> int:
        """One MoE block's parameters: router (+ bias), every expert (+ biases), the shared expert."""
        m = self.moe
        if m is None:
            return 0
        e, h, i, s = m.num_experts, m.hidden_size, m.intermediate_size, m.shared_expert_intermediate_size
        router = e * h + (e if m.router_bias else 0)
        experts = e * 3 * h * i + (e * (2 * i + h) if m.expert_bias else 0)
        shared = 3 * h * s + h if s else 0
        return router + experts + shared

    @property
    def is_moe(self) -> bool:
        """Some layer's MLP is a mixture of experts."""
        return any(spec.mlp == "moe" for spec in self.layers)

    @property
    def layer_specs(self) -> tuple[LayerSpec, ...]:
        return self.layers

    def layer_sliding_window(self, layer: int) -> int | None:
        """The sliding window W of decoder layer `layer` (the attention backends' `sliding_window`: the
        query at position p sees keys p - W + 1 .. p), or None where the layer attends globally."""
        return self.layers[layer].sliding_window

    @property
    def all_layers_windowed(self) -> bool:
        """Every layer has a window (Mistral-style): KV blocks out of every window can be freed."""
        return all(spec.sliding_window is not None for spec in self.layers)

    @property
    def kv_window(self) -> int | None:
        """The window the block manager may free blocks behind: the widest layer window when every layer
        is windowed, else None (a global layer needs the whole context)."""
        if not self.all_layers_windowed:
            return None
        return max(spec.sliding_window for spec in self.layers if spec.sliding_window is not None)

    @property
    def fused_cpu(self) -> bool:
        """Every layer's MLP is one the compiled fp32 CPU path can call (dense, or a mixture-of-experts
        block between its fused norms): the fused path (and, where decode_graph.py can record it, the
        decode graph) serves the model, whatever its layer kind."""
        return all(spec.mlp in ("dense", "moe") for spec in self.layers)

    @property
    def fused_cpu_bf16(self) -> bool:
        """Every layer's MLP is dense: a bf16 model's residual stream then runs the fused ops of every norm
        placement, multiplier and q/k norm (cpu_fused.cpp's *_bf16 and bf16 act_mul;
        LlamaForCausalLM._forward_fused). A mixture-of-experts block takes fp32 rows: such bf16 models keep
        torch's ops."""
        return all(spec.mlp == "dense" for spec in self.layers)

    @property
    def is_llama(self) -> bool:
        """Every layer is the Llama layer and nothing model-level differs: tensor parallelism and
        calibrated quantization serve only this (the fused CPU path and decode graph: `fused_cpu`)."""
        return (
            all(spec.is_llama(self.head_dim) for spec in self.layers)
            and self.embedding_multiplier == 1.0
            and self.logits_divisor == 1.0
            and self.final_logit_softcap is None
            and self.final_norm == "rms"
        )

    @classmethod
    def common_from_hf(
        cls, cfg: dict[str, Any], arch: str, model_type: str, qkv_bias: bool = False, qk_norm: bool = False
    ) -> ArchConfig:
        """The fields every architecture shares, read from config.json, with the Llama layer;
        the architecture's module (server/models/archs/) then sets its own (registry.arch_from_hf).
        `qkv_bias`: q/k/v carry a bias by default (Qwen2); `qk_norm`: per-head q/k norms (Qwen3)."""
        window, layer_types = _sliding_window(arch, cfg)
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        rope = rope_spec_from_hf(cfg, head_dim)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        default_qkv_bias = qkv_bias
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope.theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=default_qkv_bias or attention_bias,
            o_bias=attention_bias and not default_qkv_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            rope_scaling=rope.scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            qk_norm=qk_norm,
            model_type=model_type,
            # the rope as read (a partial rotary dimension included), not rebuilt from the fields above
            layers=tuple(
                LayerSpec(
                    rope,
                    head_dim**-0.5,
                    qk_norm="head" if qk_norm else "none",
                    sliding_window=window if layer_types is None or kind == "sliding_attention" else None,
                )
                for kind in (layer_types or ("full_attention",) * int(cfg["num_hidden_layers"]))
            ),
        )


def _sliding_window(arch: str, cfg: dict[str, Any]) -> tuple[int | None, tuple[str, ...] | None]:
    """(window, layer_types) as transformers reads them for the Llama-layer families: Mistral (and
    Mixtral) windows every layer by `sliding_window` (null in v0.2+ configs: none); Qwen2/Qwen3 only with
    `use_sliding_window`, then the layers from `max_window_layers` on unless `layer_types` says which;
    Llama has none. (Gemma's modules read their own pattern: server/models/archs/gemma.py.)"""
    raw = cfg.get("sliding_window")
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return (int(raw) if raw is not None else None), None
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("use_sliding_window") and raw is not None:
        n = int(cfg["num_hidden_layers"])
        types = cfg.get("layer_types")
        if types is None:
            first = int(cfg.get("max_window_layers", 28))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        if len(types) != n:
            raise UnsupportedModelError(f"layer_types has {len(types)} entries for {n} layers")
        bad = sorted(set(types) - set(LAYER_TYPES))
        if bad:
            raise UnsupportedModelError(f"unsupported layer_types {bad}; expected {list(LAYER_TYPES)}")
        return int(raw), tuple(types)
    return None, None


def rope_spec_from_hf(cfg: dict[str, Any], head_dim: int, params: dict[str, Any] | None = None) -> RopeSpec:
    """A RopeSpec from config.json: transformers 5's `rope_parameters` (rope_theta, rope_type,
    partial_rotary_factor and the kind's keys in one dict) or the older top-level `rope_theta`,
    `partial_rotary_factor` and `rope_scaling` ({"type" or "rope_type", ...}). `params`: one entry of
    a per-layer-type `rope_parameters` (Gemma 3)."""
    rope = params if params is not None else (cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in rope.values()):  # per layer type: the caller picks
        rope = {}
    theta = float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    factor = float(rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0)
    rotary_dim = int(head_dim * factor)
    kind = rope.get("rope_type") or rope.get("type") or "default"
    scaling = None
    if kind != "default":
        items = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
        if kind in ("longrope", "yarn") and "original_max_position_embeddings" not in items:
            orig = cfg.get("original_max_position_embeddings")
            if orig is not None:
                items["original_max_position_embeddings"] = orig
        scaling = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in items.items()))
    return RopeSpec(theta, rotary_dim, scaling)
