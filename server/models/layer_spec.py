"""The layer contract: what one decoder layer of any supported architecture computes, as data.

Every architecture module (server/models/archs/) turns its config.json into one `LayerSpec` per layer
plus model-level fields on `ArchConfig`; the shared layers (server/models/layers.py) read only these, so
an architecture is a config translation (and, where its checkpoint fuses tensors, a weight renaming),
never a flag threaded through the layer code. Plain Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

# "rms": w * norm(x) (Llama); "rms_one_plus": (1 + w) * norm(x) in fp32 (Gemma's zero-centred weight)
NormKind = Literal["rms", "rms_one_plus"]
# "silu": SwiGLU, silu(gate) * up; "gelu_tanh": GeGLU with the tanh GELU (Gemma's gelu_pytorch_tanh)
Activation = Literal["silu", "gelu_tanh"]
# "pre": x + f(norm(x)) (Llama); "post": x + norm(f(x)) (OLMo 2); "sandwich": x + norm(f(norm(x))) (Gemma 2/3)
NormPlacement = Literal["pre", "post", "sandwich"]
# "head": one [head_dim] RMSNorm per q/k head (Qwen3, Gemma 3); "full": one over the whole q / k projection
# output ([Hq * D], [Hkv * D]: OLMo 2)
QKNorm = Literal["none", "head", "full"]
# "dense": the gated MLP (gate/up/down); "moe": a mixture-of-experts block (server/models/moe/block.py)
# configured by the model-level `ArchConfig.moe` (Mixtral's every layer; Qwen2/3-MoE's sparse layers)
MlpKind = Literal["dense", "moe"]

ROPE_KINDS = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


class UnsupportedModelError(ValueError):
    """A config asks for something the layer contract cannot express or our kernels cannot honour."""


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one layer. `rotary_dim`: the leading channels of each head that rotate
    (head_dim * partial_rotary_factor, even); `scaling`: the config's rope_scaling / rope_parameters
    items other than rope_theta (sorted key/value pairs, hashable), None for plain RoPE."""

    theta: float
    rotary_dim: int
    scaling: tuple[tuple[str, Any], ...] | None = None

    def __post_init__(self) -> None:
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise UnsupportedModelError(f"rotary dimension must be even and positive, got {self.rotary_dim}")
        kind = self.kind
        if kind not in ROPE_KINDS:
            raise UnsupportedModelError(f"unsupported rope type {kind!r}; expected one of {ROPE_KINDS}")

    @property
    def kind(self) -> str:
        s = dict(self.scaling or ())
        return str(s.get("rope_type") or s.get("type") or "default")


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer. `attn_scale`: the softmax scale (head_dim**-0.5 unless the family says
    otherwise: Granite's attention_multiplier, Gemma 2/3's query_pre_attn_scalar**-0.5);
    `attn_softcap`: tanh soft-capping of attention scores (Gemma 2), None for none; `sliding_window`:
    the layer attends to at most this many previous tokens (passed to the attention call), None for
    full attention; `residual_multiplier`: each sub-block's output is scaled by it before the residual
    add (Granite); `rope`: None for a layer without positional rotation (SmolLM3's no_rope_layers);
    `mlp`: the feed-forward kind ("moe": the block `ArchConfig.moe` describes, same for every such layer);
    `attn_sinks`: the layer has gpt-oss's attention sinks (a learned `self_attn.sinks` logit per query
    head, [num_heads], joining each softmax's denominator; every attention backend takes them)."""

    rope: RopeSpec | None
    attn_scale: float
    norm: NormKind = "rms"
    activation: Activation = "silu"
    norm_placement: NormPlacement = "pre"
    qk_norm: QKNorm = "none"
    attn_softcap: float | None = None
    sliding_window: int | None = None
    residual_multiplier: float = 1.0
    mlp: MlpKind = "dense"
    attn_sinks: bool = False

    def __post_init__(self) -> None:
        if self.attn_sinks and self.attn_softcap is not None:
            raise UnsupportedModelError("attention sinks with attn_logit_softcapping are not supported")
        if self.attn_softcap is not None and self.attn_softcap <= 0:
            raise UnsupportedModelError(f"attn_logit_softcapping must be positive, got {self.attn_softcap}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise UnsupportedModelError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.mlp not in ("dense", "moe"):
            raise UnsupportedModelError(f"unknown MLP kind {self.mlp!r}; expected 'dense' or 'moe'")

    def is_llama(self, head_dim: int) -> bool:
        """Whether this is the Llama/Qwen layer that tensor parallelism and calibrated quantization run:
        pre-norm w * RMSNorm, SwiGLU, full-width RoPE, no soft-capping, no window, no multiplier,
        per-head q/k norms at most, a dense MLP, no attention sinks. (The fused CPU ops and the decode
        graph read every field as data: ArchConfig.fused_cpu, decode_graph.layer_refusal.)"""
        return (
            self.mlp == "dense"
            and self.norm == "rms"
            and self.activation == "silu"
            and self.norm_placement == "pre"
            and self.qk_norm in ("none", "head")
            and self.attn_softcap is None
            and self.sliding_window is None
            and self.residual_multiplier == 1.0
            and self.rope is not None
            and self.rope.rotary_dim == head_dim
            and self.attn_scale == head_dim**-0.5
            and not self.attn_sinks
        )
