"""OpenAI gpt-oss (gpt-oss-20b, gpt-oss-120b): GQA attention with q/k/v/o biases (`attention_bias`),
YaRN RoPE (`rope_parameters`, `truncate` false), a learned attention sink per query head on every layer
(`self_attn.sinks`, LayerSpec.attn_sinks), sliding-window (`sliding_window`, 128) and full layers
alternating as `layer_types` says (transformers' default: even layers windowed), and a mixture of
experts on every layer: a biased router (`mlp.router`), top `num_experts_per_tok` of
`num_local_experts` softmaxed over the chosen, clamped SwiGLU experts with `swiglu_alpha` and
`swiglu_limit` and biases (server/models/moe/config.py). Source: transformers' modeling_gpt_oss.py.

Shipped checkpoints hold the experts in MXFP4 (`quantization_config.quant_method` "mxfp4";
`mlp.experts.{gate_up_proj,down_proj}_{blocks,scales}`, server/models/moe/mxfp4.py). On CPU they stay
packed (`attach_weights`: each layer's block serves `Mxfp4Experts`, whose chosen experts multiply
straight from their packed bytes through the MXFP4 CPU kernel, so memory holds 4.25 bits per expert
weight and a step reads only its chosen experts' bytes); elsewhere `rename_weights` dequantizes them
exactly (e2m1 times a power of two is exact in bf16 and fp32) into transformers' dense layout. Either
way the router, the expert biases and everything outside the experts load as usual. llama.cpp's
`gpt-oss` GGUF files load too (server/models/gguf_config.py, server/quant/gguf_names.py,
server/models/moe/gguf.py), their MXFP4 experts kept MXFP4 on the same kernel.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from server.models.arch import ArchConfig
from server.models.architecture import Architecture
from server.models.archs.mixtral import moe_config
from server.models.layer_spec import UnsupportedModelError
from server.models.moe.block import SparseMoeBlock, block_state
from server.models.moe.mxfp4 import dequantize_mxfp4, load_mxfp4_experts
from server.models.moe.weights import load_expert_weights

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

_TYPES = ("sliding_attention", "full_attention")


def configure(cfg: dict[str, Any], base: ArchConfig) -> ArchConfig:
    n = base.num_layers
    types = cfg.get("layer_types") or [_TYPES[i % 2] for i in range(n)]
    if len(types) != n or any(t not in _TYPES for t in types):
        raise UnsupportedModelError(
            f"layer_types must name sliding_attention or full_attention for {n} layers"
        )
    window = cfg.get("sliding_window")
    if "sliding_attention" in types and not window:
        raise UnsupportedModelError("layer_types has sliding_attention layers but sliding_window is not set")
    spec = replace(base.layers[0], attn_sinks=True, mlp="moe", sliding_window=None)
    sliding = replace(spec, sliding_window=int(window)) if window else spec
    layers = tuple(sliding if t == "sliding_attention" else spec for t in types)
    return replace(base, layers=layers, moe=moe_config(cfg))


def dequantize_experts(state: dict[str, Tensor], num_layers: int) -> dict[str, Tensor]:
    """Each layer's MXFP4 `mlp.experts.{gate_up_proj,down_proj}_{blocks,scales}` -> the dense
    `mlp.experts.{gate_up_proj,down_proj}` in transformers' [E, in, out] layout (fp32, exact; the
    loader casts it to the model's dtype). Folders with dense experts pass through."""
    out = dict(state)
    for n in range(num_layers):
        p = f"model.layers.{n}.mlp.experts."
        for name in ("gate_up_proj", "down_proj"):
            if p + name + "_blocks" not in out:
                continue
            blocks, scales = out.pop(p + name + "_blocks"), out.pop(p + name + "_scales", None)
            if scales is None:
                raise KeyError(f"checkpoint tensor {p + name + '_scales'!r} missing")
            # [E, out, in / 32, 16] -> [E, out, in] -> [E, in, out]
            out[p + name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
    return out


_PACKED = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")


def attach_weights(
    model: nn.Module, state: dict[str, Tensor], arch: ArchConfig, device: torch.device
) -> dict[str, Tensor]:
    """On CPU, each layer's MXFP4 experts go to its block as `Mxfp4Experts` (their `*_blocks` /
    `*_scales` leave the state; the block then has no dense w13 / w2 to load)."""
    if device.type != "cpu" or arch.moe is None:
        return state
    out = dict(state)
    layers: Any = model.model.layers  # type: ignore[union-attr]
    for n in range(arch.num_layers):
        p = f"model.layers.{n}.mlp"
        if f"{p}.experts.gate_up_proj_blocks" not in out:
            continue
        block = layers[n].mlp
        assert isinstance(block, SparseMoeBlock)
        block.set_experts(load_mxfp4_experts(out, p, arch.moe))
        for name in _PACKED:
            del out[f"{p}.experts.{name}"]
    return out


# what load_expert_weights reads of a gpt-oss block (replaced by the block's own names)
_READ = (
    "router.weight",
    "router.bias",
    "experts.gate_up_proj",
    "experts.down_proj",
    "experts.gate_up_proj_bias",
    "experts.down_proj_bias",
)


def rename_weights(state: dict[str, Tensor], arch: ArchConfig) -> dict[str, Tensor]:
    """The experts under SparseMoeBlock's names: dense (a dense checkpoint, or MXFP4 dequantized off
    CPU), or only router and biases where `attach_weights` gave the block its packed experts."""
    assert arch.moe is not None
    out = dequantize_experts(state, arch.num_layers)
    for n in range(arch.num_layers):
        p = f"model.layers.{n}.mlp"
        if f"{p}.router" in out:
            continue  # already under SparseMoeBlock's names: a GGUF file's (server/models/moe/gguf.py)
        w = load_expert_weights(out, p, arch.moe, dense_experts=f"{p}.experts.gate_up_proj" in out)
        for name in _READ:
            out.pop(f"{p}.{name}", None)
        out.update(block_state(w, p))
    return out


GPT_OSS = Architecture(
    "GptOssForCausalLM",
    "gpt_oss",
    configure,
    (
        "attention sinks",
        "q/k/v/o bias",
        "sliding window (alternating)",
        "YaRN RoPE",
        "mixture of experts (biased router, clamped SwiGLU)",
        "MXFP4 experts (packed on CPU, our MXFP4 kernel; GGUF MXFP4 too)",
    ),
    gguf=True,
    rename_weights=rename_weights,
    attach_weights=attach_weights,
)
