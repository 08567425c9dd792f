"""MoEConfig: how one mixture-of-experts block routes and activates, as data.

The four routing variants we cover, from transformers 5's modeling files (the reference the parity
tests build):
- Mixtral (`MixtralTopKRouter`): softmax over all E logits in fp32, top-k, renormalised over the chosen
  (equal to a softmax over the chosen logits);
- Qwen2-MoE (`Qwen2MoeTopKRouter`, `norm_topk_prob` false in its shipped configs): softmax over all,
  top-k, no renormalisation; plus one shared expert whose output is scaled by sigmoid(shared_expert_gate(x));
- Qwen3-MoE: as Qwen2-MoE without the shared expert, `norm_topk_prob` true;
- gpt-oss (`GptOssTopKRouter`, `GptOssExperts`): a router with a bias, top-k on the logits, softmax over
  the k chosen logits; experts with biases and a clamped SwiGLU
  `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`, `g = clamp(gate, max=limit)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROUTINGS = ("softmax_topk", "topk_softmax")  # softmax over all then top-k | top-k logits then softmax
ACTIVATIONS = ("silu", "swigluoai")  # SiLU-gated (Mixtral, Qwen) | gpt-oss's clamped SwiGLU (vLLM's name)
MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")


class MoEConfigError(ValueError):
    """A mixture-of-experts configuration that cannot run (names the field)."""


@dataclass(frozen=True)
class MoEConfig:
    """One MoE block. Sizes in elements; `model_type` names the checkpoint's weight layout
    (`server.models.moe.weights.load_expert_weights`). Raises MoEConfigError on construction."""

    model_type: str
    num_experts: int  # E
    top_k: int  # experts per token
    hidden_size: int  # H
    intermediate_size: int  # I, per expert
    routing: str = "softmax_topk"
    renormalize: bool = True  # divide the chosen weights by their sum (softmax_topk only)
    router_bias: bool = False
    activation: str = "silu"
    expert_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert; else its I, gated by sigmoid

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise MoEConfigError(f"model_type {self.model_type!r} not in {MODEL_TYPES}")
        for name in ("num_experts", "top_k", "hidden_size", "intermediate_size"):
            if getattr(self, name) < 1:
                raise MoEConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise MoEConfigError(f"top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
        if self.routing not in ROUTINGS:
            raise MoEConfigError(f"routing {self.routing!r} not in {ROUTINGS}")
        if self.activation not in ACTIVATIONS:
            raise MoEConfigError(f"activation {self.activation!r} not in {ACTIVATIONS}")
        if self.shared_expert_intermediate_size < 0:
            raise MoEConfigError("shared_expert_intermediate_size must be >= 0")
        if self.activation == "swigluoai" and not (self.swiglu_limit > 0 and self.swiglu_alpha > 0):
            raise MoEConfigError("swiglu_alpha and swiglu_limit must be > 0")

    @staticmethod
    def from_hf_config(hf: Any) -> MoEConfig:
        """From a transformers config (or anything with its attributes) of a model_type we cover."""
        kind = getattr(hf, "model_type", None)
        if kind == "mixtral":
            return MoEConfig(
                "mixtral",
                hf.num_local_experts,
                hf.num_experts_per_tok,
                hf.hidden_size,
                hf.intermediate_size,
                activation=_silu(hf),
            )
        if kind in ("qwen2_moe", "qwen3_moe"):
            shared = getattr(hf, "shared_expert_intermediate_size", 0) if kind == "qwen2_moe" else 0
            return MoEConfig(
                kind,
                hf.num_experts,
                hf.num_experts_per_tok,
                hf.hidden_size,
                hf.moe_intermediate_size,
                renormalize=bool(hf.norm_topk_prob),
                activation=_silu(hf),
                shared_expert_intermediate_size=int(shared or 0),
            )
        if kind == "gpt_oss":
            return MoEConfig(
                "gpt_oss",
                hf.num_local_experts,
                hf.num_experts_per_tok,
                hf.hidden_size,
                hf.intermediate_size,
                routing="topk_softmax",
                router_bias=True,
                activation="swigluoai",
                expert_bias=True,
                swiglu_alpha=float(getattr(hf, "swiglu_alpha", 1.702)),
                swiglu_limit=float(hf.swiglu_limit),
            )
        raise MoEConfigError(f"model_type {kind!r} has no MoE block here; covered: {MODEL_TYPES}")

    @staticmethod
    def from_config_json(cfg: dict[str, Any]) -> MoEConfig:
        """From a config.json dict: as `from_hf_config`, with the defaults transformers' config classes
        fill in (hidden_act silu, norm_topk_prob false, no shared expert) and either name of the expert
        count (`num_experts`, as Qwen's shipped configs write it, or `num_local_experts`, transformers
        5's attribute). Raises MoEConfigError, or KeyError naming a missing field."""
        view = dict(cfg)
        count = view.get("num_local_experts", view.get("num_experts"))
        if count is None:
            raise KeyError("num_local_experts")
        view["num_local_experts"] = view["num_experts"] = count
        view.setdefault("hidden_act", "silu")
        view.setdefault("norm_topk_prob", False)
        view.setdefault("shared_expert_intermediate_size", 0)
        return MoEConfig.from_hf_config(_Attrs(view))


class _Attrs:
    """A dict's keys as attributes (from_hf_config reads a transformers config's attributes); a missing
    one is a KeyError naming the config.json field."""

    def __init__(self, d: dict[str, Any]) -> None:
        self._d = d

    def __getattr__(self, name: str) -> Any:
        try:
            return self._d[name]
        except KeyError:
            if name in ("swiglu_alpha",):
                raise AttributeError(name) from None
            raise KeyError(name) from None


def _silu(hf: Any) -> str:
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu":
        raise MoEConfigError(f"hidden_act {act!r}: only silu-gated experts are supported")
    return "silu"
