"""Mixture-of-experts GGUF files (llama.cpp's layouts, convert_hf_to_gguf.py): the config.json fields
transformers' GGUF reader leaves out, and the block tensors assembled into `SparseMoeBlock`s.

Layouts: Mixtral is the `llama` architecture with `llama.expert_count` / `expert_used_count`,
`feed_forward_length` the experts' size; `qwen2moe` / `qwen3moe` carry `expert_feed_forward_length`
(the experts' size; `feed_forward_length` is the dense MLP's), and qwen2moe
`expert_shared_feed_forward_length`. Per MoE layer: `ffn_gate_inp` (router [E, H]),
`ffn_{gate,up,down}_exps` (stacked [E, N, K]), and qwen2moe's `ffn_{gate,up,down}_shexp` +
`ffn_gate_inp_shexp` ({H}); gpt-oss's router and expert biases (`ffn_gate_inp.bias`,
`ffn_{gate,up,down}_exps.bias`) and MXFP4 experts (`gpt-oss.expert_feed_forward_length` their size).
llama.cpp renormalises the top-k for qwen3moe and not for qwen2moe (its
`norm_w` in models/qwen2moe.cpp / qwen3moe.cpp), Mixtral always; a layer without `ffn_gate_inp` keeps a
dense MLP (Qwen's `mlp_only_layers`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from server.models.moe.block import SparseMoeBlock
from server.models.moe.mxfp4 import Mxfp4Experts, Mxfp4Tensor
from server.models.moe.quant import BlockQuantExperts
from server.quant.block_linear import BlockQuantLinear
from server.quant.cpu_mxfp4 import Mxfp4Kernel, dequantize_mxfp4
from server.quant.cpu_qlinear import BlockQuantWeight, QLinearKernel, dequantize_reference, file_format
from server.quant.gguf_checkpoint import DequantizedTensor, GgufCheckpoint

log = logging.getLogger(__name__)

_ROUTER = re.compile(r"^blk\.(\d+)\.ffn_gate_inp\.weight$")
_SHARED_GATE = re.compile(r"^blk\.\d+\.ffn_gate_shexp\.weight$")


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return None
    value = f.parts[f.data[0]]
    return bytes(value).decode() if f.types and f.types[0].name == "STRING" else value[0].item()


def gguf_moe_fields(path: Path) -> dict[str, Any]:
    """The config.json fields of a MoE GGUF that transformers' reader does not write (empty for a
    dense file): the architecture (Mixtral for a `llama` file with experts), expert counts and sizes,
    renormalisation, which layers are dense. Raises ValueError for a layout we do not map."""
    from server.gguf_file import open_gguf

    reader = open_gguf(path)
    arch = _field(reader, "general.architecture") or "llama"
    experts = _field(reader, f"{arch}.expert_count")
    if not experts:
        return {}
    layers = int(_field(reader, f"{arch}.block_count"))
    sparse = {int(m.group(1)) for t in reader.tensors if (m := _ROUTER.match(t.name))}
    dense = [i for i in range(layers) if i not in sparse]
    used = int(_field(reader, f"{arch}.expert_used_count"))
    if arch == "llama":
        if dense:
            raise ValueError(f"{path.name}: a llama (Mixtral) file with experts on only some layers")
        return {
            "model_type": "mixtral",
            "architectures": ["MixtralForCausalLM"],
            "num_local_experts": int(experts),
            "num_experts_per_tok": used,
        }
    if arch == "gpt-oss":  # the rest of its config: server/models/gguf_config.py
        return {
            "num_local_experts": int(experts),
            "num_experts_per_tok": used,
            "intermediate_size": int(_field(reader, f"{arch}.expert_feed_forward_length")),
        }
    if arch not in ("qwen2moe", "qwen3moe"):
        raise ValueError(
            f"{path.name}: MoE GGUF architecture {arch!r} is not mapped (llama, qwen2moe, qwen3moe, gpt-oss)"
        )
    fields: dict[str, Any] = {
        "num_experts": int(experts),
        "num_experts_per_tok": used,
        "moe_intermediate_size": int(_field(reader, f"{arch}.expert_feed_forward_length")),
        "norm_topk_prob": arch == "qwen3moe",
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
    }
    if arch == "qwen2moe":
        shared = _field(reader, f"{arch}.expert_shared_feed_forward_length")
        if shared is None:  # older files: the shared expert's gate rows
            t = next((t for t in reader.tensors if _SHARED_GATE.match(t.name)), None)
            shared = int(t.shape[1]) if t is not None else 0
        fields["shared_expert_intermediate_size"] = int(shared)
    return fields


def _dense(t: Tensor | BlockQuantWeight) -> Tensor:  # fp32
    return dequantize_reference(t) if isinstance(t, BlockQuantWeight) else t.float()


@dataclass(frozen=True)
class GgufMoeTensors:
    """What assemble_gguf_moe leaves for the loader."""

    state: dict[str, Tensor]  # the blocks' float tensors under their parameter names (load_state_dict)
    quantized: dict[str, str]  # module name -> format of the blocks' projections kept quantized


def _listed(
    ckpt: GgufCheckpoint, gguf_name: str, gguf_type: str, file_bytes: int, resident_bytes: int
) -> None:
    """A block tensor served dequantized to fp32, listed in `ckpt.dequantized` with what it costs (the
    log, /info), as the reader lists the types it cannot keep."""
    d = DequantizedTensor(gguf_name, gguf_type, file_bytes, resident_bytes)
    ckpt.dequantized.append(d)
    log.warning(
        "%s (%s) is served as fp32: %d bytes more than in the file", gguf_name, gguf_type, d.extra_bytes
    )


def _file_bytes(ws: list[BlockQuantWeight]) -> int:
    """The bytes `ws` take in the file: their GGUF type's blocks (gguf-py's GGML_QUANT_SIZES), not the
    held layout's (a repacked Q5_K holds 8-bit groups)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    total = 0
    for w in ws:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[file_format(w.fmt).upper()]]
        total += w.out_features * w.in_features // block * type_size
    return total


def assemble_gguf_moe(
    blocks: dict[int, SparseMoeBlock],
    ckpt: GgufCheckpoint,
    kernel: QLinearKernel | None,
    file: str,
    mxfp4_kernel: Mxfp4Kernel | None = None,
) -> GgufMoeTensors:
    """Moves each MoE layer's tensors out of `ckpt` into its block: experts kept quantized (a kept
    type, gate and up alike) become the block's `BlockQuantExperts`, MXFP4 ones (gpt-oss) its
    `Mxfp4Experts` over `mxfp4_kernel` (only the chosen experts' bytes are read per step); others are
    dequantized into `w13`/`w2`. Qwen2-MoE's shared expert (`ffn_*_shexp`, quantized by llama-quantize
    like any projection) stays in its blocks as the block's two BlockQuantLinear projections where
    gate and up share a format; otherwise it is held fp32 and listed in `ckpt.dequantized`. Router (and
    its bias), expert biases and the shared expert's gate are fp32 (F32 in llama.cpp's files). Raises
    ValueError naming a missing tensor."""
    out = GgufMoeTensors({}, {})
    state = out.state
    for n, block in blocks.items():
        pre = f"model.layers.{n}.mlp"

        def take(name: str, pre: str = pre) -> Tensor | BlockQuantWeight:
            try:
                return ckpt.tensors.pop(f"{pre}.{name}")
            except KeyError:
                raise ValueError(f"{file}: {pre} lacks its MoE tensor {name}") from None

        state[f"{pre}.router"] = _dense(take("router"))
        if block.cfg.router_bias:
            state[f"{pre}.router_bias"] = _dense(take("router_bias"))
        b13 = b2 = None
        if block.cfg.expert_bias:  # gpt-oss: [E, I] gate and up biases, [E, H] down's
            b13 = torch.cat([_dense(take("experts.gate_bias")), _dense(take("experts.up_bias"))], dim=1)
            b2 = _dense(take("experts.down_bias"))
            state[f"{pre}.b13"], state[f"{pre}.b2"] = b13, b2
        if block.cfg.shared_expert_intermediate_size:
            state[f"{pre}.shared_gate"] = _dense(take("shared_expert_gate")).reshape(1, -1)
            sg, su, sd = (take(f"shared_expert.{p}") for p in ("gate", "up", "down"))
            if (
                isinstance(sg, BlockQuantWeight)
                and isinstance(su, BlockQuantWeight)
                and isinstance(sd, BlockQuantWeight)
                and sg.fmt == su.fmt
            ):  # llama-quantize quantizes ffn_*_shexp like any projection: kept in their blocks
                shared_gu = BlockQuantWeight.concat_rows([sg, su])
                block.set_shared_expert(
                    BlockQuantLinear(shared_gu, kernel=kernel), BlockQuantLinear(sd, kernel=kernel)
                )
                out.quantized[f"{pre}.shared_gate_up"] = file_format(shared_gu.fmt)
                out.quantized[f"{pre}.shared_down"] = file_format(sd.fmt)
            else:  # float tensors (F32; F16 and others are listed by the reader), or gate and up differ
                state[f"{pre}.shared_w13"] = torch.cat([_dense(sg), _dense(su)])
                state[f"{pre}.shared_w2"] = _dense(sd)
                for part, t in zip(("gate", "up", "down"), (sg, su, sd), strict=True):
                    if isinstance(t, BlockQuantWeight):
                        fmt = file_format(t.fmt).upper()
                        resident = 4 * t.out_features * t.in_features
                        _listed(ckpt, f"blk.{n}.ffn_{part}_shexp.weight", fmt, _file_bytes([t]), resident)
        names = [f"{pre}.experts.{p}" for p in ("gate", "up", "down")]
        mx = [ckpt.mxfp4_experts.pop(k, None) for k in names]
        if all(m is not None for m in mx):
            mg, mu, md = mx
            assert mg is not None and mu is not None and md is not None
            gate_up = Mxfp4Tensor(torch.cat([mg[0], mu[0]], dim=1), torch.cat([mg[1], mu[1]], dim=1))
            block.set_experts(Mxfp4Experts(gate_up, Mxfp4Tensor(*md), b13, b2, mxfp4_kernel))
            continue
        for k, m in zip(names, mx, strict=True):  # some MXFP4, some not: served dense
            if m is not None:
                held = dequantize_mxfp4(*m)
                ckpt.tensors[k] = held
                gguf_name = f"blk.{n}.ffn_{k.rsplit('.', 1)[1]}_exps.weight"
                _listed(ckpt, gguf_name, "MXFP4", sum(t.numel() for t in m), 4 * held.numel())
        quant = [ckpt.experts.pop(k, None) for k in names]
        if all(q is not None for q in quant) and quant[0][0].fmt == quant[1][0].fmt:  # type: ignore[index]
            g, u, d = quant
            assert g is not None and u is not None and d is not None
            w13 = [BlockQuantWeight.concat_rows([a, b]) for a, b in zip(g, u, strict=True)]
            block.set_experts(BlockQuantExperts(w13, d, b13, b2, kernel=kernel))
            continue
        dense = []
        for k, q in zip(names, quant, strict=True):
            if q is not None:
                dense.append(torch.stack([dequantize_reference(w) for w in q]))
                gguf_name = f"blk.{n}.ffn_{k.rsplit('.', 1)[1]}_exps.weight"
                fmt = file_format(q[0].fmt).upper()
                _listed(ckpt, gguf_name, fmt, _file_bytes(q), 4 * dense[-1].numel())
            else:
                dense.append(_dense(take(k.removeprefix(pre + "."))))
        state[f"{pre}.w13"] = torch.cat([dense[0], dense[1]], dim=1)  # [E, 2I, H]
        state[f"{pre}.w2"] = dense[2]  # [E, H, I]
        if any(q is not None for q in quant):
            log.warning("%s: layer %d's experts mix quantization types: served dequantized (fp32)", file, n)
    return out
