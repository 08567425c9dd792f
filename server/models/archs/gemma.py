"""Google Gemma, Gemma 2 and Gemma 3 (text). Source: transformers' modeling_gemma*.py.

All: RMSNorm scaling by (1 + w) in fp32, GeGLU with the tanh GELU (`hidden_activation`), embeddings
times sqrt(hidden_size), tied LM head. Gemma 2 adds pre/post norms around both sub-blocks, the softmax
scale query_pre_attn_scalar**-0.5, tanh soft-capping of attention scores (`attn_logit_softcapping`) and
of the final logits (`final_logit_softcapping`), and sliding-window layers (`layer_types`, else every
even layer). Gemma 3 drops the attention soft-cap, adds per-head q/k norms and gives its sliding layers
their own RoPE base (`rope_local_base_freq`, or `rope_parameters["sliding_attention"]`), without the
full layers' `rope_scaling`; its pattern is `layer_types` or `sliding_window_pattern`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from server.models.arch import ArchConfig, rope_spec_from_hf
from server.models.architecture import Architecture
from server.models.layer_spec import LayerSpec, RopeSpec, UnsupportedModelError

_GELU_TANH = (
    "gelu_pytorch_tanh",
    "gelu_tanh",
    "gelu",
)  # Gemma's checkpoints name the tanh GELU all three ways


def _activation(cfg: dict[str, Any]) -> None:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GELU_TANH:
        raise UnsupportedModelError(f"hidden_activation {act!r}: Gemma layers serve the tanh GELU only")


def _layer_types(cfg: dict[str, Any], n: int, default: list[str]) -> list[str]:
    types = cfg.get("layer_types") or default
    if len(types) != n or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise UnsupportedModelError(
            f"layer_types must name sliding_attention or full_attention for {n} layers"
        )
    return list(types)


def configure_gemma(cfg: dict[str, Any], base: ArchConfig) -> ArchConfig:
    _activation(cfg)
    spec = replace(base.layers[0], norm="rms_one_plus", activation="gelu_tanh")
    return replace(
        base,
        layers=(spec,) * base.num_layers,
        embedding_multiplier=base.hidden_size**0.5,
        final_norm="rms_one_plus",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )


def _sandwich(cfg: dict[str, Any], base: ArchConfig) -> LayerSpec:
    _activation(cfg)
    scalar = float(cfg.get("query_pre_attn_scalar") or base.head_dim)
    return replace(
        base.layers[0],
        norm="rms_one_plus",
        activation="gelu_tanh",
        norm_placement="sandwich",
        attn_scale=scalar**-0.5,
    )


def _finish(base: ArchConfig, cfg: dict[str, Any], layers: tuple[LayerSpec, ...]) -> ArchConfig:
    cap = cfg.get("final_logit_softcapping")
    return replace(
        base,
        layers=layers,
        embedding_multiplier=base.hidden_size**0.5,
        final_norm="rms_one_plus",
        final_logit_softcap=float(cap) if cap else None,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )


def configure_gemma2(cfg: dict[str, Any], base: ArchConfig) -> ArchConfig:
    n = base.num_layers
    types = _layer_types(cfg, n, ["full_attention" if i % 2 else "sliding_attention" for i in range(n)])
    cap = cfg.get("attn_logit_softcapping")
    spec = replace(_sandwich(cfg, base), attn_softcap=float(cap) if cap else None)
    window = cfg.get("sliding_window")
    sliding = replace(spec, sliding_window=int(window)) if window else spec
    return _finish(base, cfg, tuple(sliding if t == "sliding_attention" else spec for t in types))


def configure_gemma3(cfg: dict[str, Any], base: ArchConfig) -> ArchConfig:
    n = base.num_layers
    pattern = int(cfg.get("sliding_window_pattern") or 6)
    types = _layer_types(
        cfg, n, ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    )
    if cfg.get("attn_logit_softcapping"):
        raise UnsupportedModelError("Gemma 3 with attn_logit_softcapping is not a published configuration")
    params = cfg.get("rope_parameters")
    full_rope: RopeSpec | None
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        full_rope = rope_spec_from_hf(cfg, base.head_dim, params["full_attention"])
        local_rope = rope_spec_from_hf(cfg, base.head_dim, params.get("sliding_attention") or {})
    else:
        full_rope = base.layers[0].rope
        local_rope = RopeSpec(float(cfg.get("rope_local_base_freq") or 10000.0), base.head_dim)
    spec = replace(_sandwich(cfg, base), qk_norm="head", rope=full_rope)
    window = int(cfg["sliding_window"]) if cfg.get("sliding_window") else None
    bidirectional = bool(cfg.get("use_bidirectional_attention"))
    if bidirectional and window is not None:
        # transformers' Gemma3TextConfig reads config.json's window W of a bidirectional model as
        # |query - key| < W // 2 + 1 (and writes it back as 2 * (that - 1)): EmbeddingGemma's 512 is 257
        window = window // 2 + 1
    sliding = replace(spec, rope=local_rope, sliding_window=window)
    layers = tuple(sliding if t == "sliding_attention" else spec for t in types)
    return replace(_finish(base, cfg, layers), bidirectional=bidirectional)


_COMMON = ("(1 + w) RMSNorm", "GeGLU (tanh)", "embeddings x sqrt(hidden)")
ARCHITECTURES = [
    Architecture("GemmaForCausalLM", "gemma", configure_gemma, _COMMON, gguf=True),
    Architecture(
        "Gemma2ForCausalLM",
        "gemma2",
        configure_gemma2,
        (*_COMMON, "pre/post norms", "attention + final logit soft-capping", "sliding window"),
        gguf=True,
    ),
    Architecture(
        "Gemma3ForCausalLM",
        "gemma3_text",
        configure_gemma3,
        (
            *_COMMON,
            "pre/post norms",
            "per-head q/k norm",
            "local RoPE base",
            "sliding window",
            "bidirectional (EmbeddingGemma, embeddings only)",
        ),
        gguf=True,
    ),
]
