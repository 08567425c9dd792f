"""The architecture of a Llama-family checkpoint, read from its config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# architecture name in config.json -> whether q/k/v projections carry a bias by default
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
    "Qwen3ForCausalLM": False,
}
# architectures whose attention RMS-normalizes each q and k head (q_norm, k_norm over head_dim) before RoPE
QK_NORM_ARCHITECTURES = {"Qwen3ForCausalLM"}
# base models without an LM head (a sentence-transformers folder around a decoder saves these): served as
# embedders only (server/pooling/model.py), never for generation
BASE_MODEL_ARCHITECTURES = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}
# config.json's layer_types values (transformers' ALLOWED_LAYER_TYPES subset we serve)
LAYER_TYPES = ("full_attention", "sliding_attention")
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class UnsupportedModelError(ValueError):
    pass


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
    # Sliding-window attention: the window W in tokens (None: none) of the layers that layer_types marks
    # "sliding_attention" (None: every layer, Mistral's case). See `layer_sliding_window`.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.sliding_window is not None and (
            isinstance(self.sliding_window, bool)
            or not isinstance(self.sliding_window, int)
            or self.sliding_window < 1
        ):
            raise UnsupportedModelError(f"sliding_window must be a positive int, got {self.sliding_window!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise UnsupportedModelError(
                    f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
                )
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise UnsupportedModelError(f"unsupported layer_types {bad}; expected {list(LAYER_TYPES)}")

    def layer_sliding_window(self, layer: int) -> int | None:
        """The sliding window W of decoder layer `layer` (the attention backends' `sliding_window`: the
        query at position p sees keys p - W + 1 .. p), or None where the layer attends globally."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def all_layers_windowed(self) -> bool:
        """Every layer has a window (Mistral-style): blocks out of the window can be freed."""
        return all(self.layer_sliding_window(i) is not None for i in range(self.num_layers))

    @property
    def num_parameters(self) -> int:
        """Logical parameter count, the same whether the weights are dense or packed."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
        mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        layer = attn + mlp + 2 * h + (2 * d if self.qk_norm else 0)
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * layer + h

    @property
    def model_type(self) -> str:
        return {v: k for k, v in _MODEL_TYPES.items()}.get(self.architecture, "llama")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], base_model_ok: bool = False) -> ArchConfig:
        """`base_model_ok`: a headless base model (Qwen3Model, ...) reads as its causal-LM architecture
        (the pooling loader's case); otherwise it is refused: it has no LM head to generate with."""
        archs = cfg.get("architectures") or []
        if not archs:
            archs = [a for a in [_MODEL_TYPES.get(cfg.get("model_type") or "")] if a]
        base = next((a for a in archs if a in BASE_MODEL_ARCHITECTURES), None)
        if base is not None and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            if not base_model_ok:
                raise UnsupportedModelError(
                    f"{base} is a base model without an LM head: it cannot generate; serve it as an "
                    "embedding model (--task embed)"
                )
            archs = [BASE_MODEL_ARCHITECTURES[base]]
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"expected one of {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        window, layer_types = _sliding_window(arch, cfg)
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type not in ("default", "linear", "llama3"):
            raise UnsupportedModelError(
                f"unsupported rope type {rope_type!r}; expected default, linear or llama3"
            )
        scaling = None
        if rope_type != "default":
            scaling = tuple(sorted((k, v) for k, v in rope.items() if k != "rope_theta"))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        default_qkv_bias = SUPPORTED_ARCHITECTURES[arch]
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=default_qkv_bias or attention_bias,
            o_bias=attention_bias and not default_qkv_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            qk_norm=arch in QK_NORM_ARCHITECTURES,
            sliding_window=window,
            layer_types=layer_types,
        )


def _sliding_window(arch: str, cfg: dict[str, Any]) -> tuple[int | None, tuple[str, ...] | None]:
    """(window, layer_types) as transformers reads them: Mistral windows every layer by `sliding_window`
    (null in v0.2+ configs: none); Qwen2/Qwen3 only with `use_sliding_window`, then the layers from
    `max_window_layers` on unless `layer_types` says which; Llama has none."""
    raw = cfg.get("sliding_window")
    if arch == "MistralForCausalLM":
        return (int(raw) if raw is not None else None), None
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("use_sliding_window") and raw is not None:
        types = cfg.get("layer_types")
        if types is None:
            first = int(cfg.get("max_window_layers", 28))
            n = int(cfg["num_hidden_layers"])
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        return int(raw), tuple(types)
    return None, None
