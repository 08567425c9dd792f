"""Tiny MoE GGUF files written with gguf-py from a Hugging Face folder (tests/moe/moe_models.py), in
llama.cpp's layouts (convert_hf_to_gguf.py): Mixtral as the `llama` architecture with `expert_count`,
q/k rows permuted for ggml's rotary; `qwen2moe` and `qwen3moe` unpermuted. Per MoE layer the router is
`ffn_gate_inp` (F32, as the converter keeps it), the experts `ffn_{gate,up,down}_exps` (E stacked
matrices, ggml shape {K, N, E}); Qwen2-MoE's shared expert `ffn_{gate,up,down}_shexp` and its gate
`ffn_gate_inp_shexp` ({H}). SmolLM2's tokenizer metadata is copied from the embedded GGUF.

`write_moe_gguf` also returns the weights the file holds, dequantized by gguf-py, under the HF
checkpoint's names, so a reference folder with exactly those weights can be written (`save_dequantized`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from gguf_vocab import add_embedded_tokenizer
from quant.gguf_models import K_QUANTIZERS  # tests/quant/gguf_models.py
from safetensors.torch import load_file, save_file

_ATTN = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute: q/k rows into ggml's rotary layout
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _encode(w: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, object]:
    """(bytes or floats to write, gguf-py's dequantization of them [same shape as w], raw ggml type)."""
    import gguf

    if kind == "F32":
        w32 = np.ascontiguousarray(w, dtype=np.float32)
        return w32, w32, None
    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F16":
        w16 = np.ascontiguousarray(w, dtype=np.float16)
        return w16, w16.astype(np.float32), None
    flat = np.ascontiguousarray(w.reshape(-1, w.shape[-1]), dtype=np.float32)
    data = K_QUANTIZERS[kind](flat) if kind in K_QUANTIZERS else gguf.quants.quantize(flat, qtype)
    back = gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(w.shape)
    return data.reshape(*w.shape[:-1], -1), back, qtype


def write_moe_gguf(
    hf_folder: Path, out: Path, fmt: str, down_fmt: str | None = None, up_fmt: str | None = None
) -> tuple[Path, dict[str, torch.Tensor]]:
    """The fp32 MoE model in `hf_folder` as a GGUF whose 2-D and expert tensors are `fmt` (F16, Q8_0,
    Q4_K: k-quants need dimensions that are multiples of 256), the experts' down projections `down_fmt`
    (default fmt: Q4_K_M files mix Q4_K and Q6_K) and up projections `up_fmt` (default fmt), norms and
    routers F32. Returns (path, the file's weights dequantized under the HF names)."""
    import gguf

    cfg = json.loads((hf_folder / "config.json").read_text())
    state = load_file(str(hf_folder / "model.safetensors"))
    kind = cfg["model_type"]
    arch = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}[kind]
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    experts = cfg.get("num_local_experts") or cfg["num_experts"]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(out.stem)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_expert_count(experts)
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if kind != "mixtral":
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if kind == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if kind == "qwen3_moe":
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    add_embedded_tokenizer(writer)
    block = "block_sparse_moe" if kind == "mixtral" else "mlp"
    names = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    deq: dict[str, torch.Tensor] = {}

    def add(gname: str, w: np.ndarray, kind_: str, hf_names: list[str], split: int = 0) -> None:
        data, back, qtype = _encode(w, kind_)
        writer.add_tensor(gname, data, raw_dtype=qtype)  # type: ignore[arg-type]
        parts = [back] if not split else list(back)  # experts: one HF tensor per expert
        for name, b in zip(hf_names, parts, strict=True):
            deq[name] = torch.from_numpy(np.ascontiguousarray(b))

    for name, t in state.items():
        w = t.float().numpy()
        if name == "model.embed_tokens.weight":
            add("token_embd.weight", w, fmt, [name])
        elif name == "model.norm.weight":
            add("output_norm.weight", w, "F32", [name])
        elif name == "lm_head.weight":
            add("output.weight", w, fmt, [name])
    for n in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{n}."
        for module, gname in _ATTN.items():
            for suffix in ("weight", "bias"):
                name = f"{pre}{module}.{suffix}"
                if name not in state:
                    continue
                w = state[name].float().numpy()
                if module == "self_attn.q_proj" and arch == "llama":
                    w = _permute(w, n_head)
                elif module == "self_attn.k_proj" and arch == "llama":
                    w = _permute(w, n_kv)
                add(f"blk.{n}.{gname}.{suffix}", w, fmt if w.ndim == 2 else "F32", [name])
                if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                    perm = _unpermute_rows(w.shape[0], n_head if "q_proj" in module else n_kv)
                    deq[name] = deq[name][perm].contiguous()
        router = f"{pre}{block}.gate.weight"
        if router not in state:
            continue  # a dense layer
        add(f"blk.{n}.ffn_gate_inp.weight", state[router].float().numpy(), "F32", [router])
        for i, (gname, part) in enumerate(
            zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), names, strict=True)
        ):
            hf = [f"{pre}{block}.experts.{e}.{part}.weight" for e in range(experts)]
            stacked = np.stack([state[h].float().numpy() for h in hf])
            kind_ = {1: up_fmt or fmt, 2: down_fmt or fmt}.get(i, fmt)
            add(f"blk.{n}.{gname}.weight", stacked, kind_, hf, split=1)
        shared_gate = f"{pre}mlp.shared_expert_gate.weight"
        if shared_gate in state:
            add(
                f"blk.{n}.ffn_gate_inp_shexp.weight",
                state[shared_gate].float().numpy()[0],
                "F32",
                [shared_gate],
            )
            deq[shared_gate] = deq[shared_gate].reshape(1, -1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out, deq


def _unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    from server.quant.gguf_checkpoint import rotary_unpermute

    return rotary_unpermute(n_rows, n_head)


def save_dequantized(hf_folder: Path, out: Path, weights: dict[str, torch.Tensor]) -> Path:
    """A copy of `hf_folder` whose weights are `weights` (write_moe_gguf's second result)."""
    shutil.copytree(hf_folder, out)
    state = load_file(str(out / "model.safetensors"))
    assert set(weights) == set(state), sorted(set(state) ^ set(weights))[:4]
    save_file({k: v.float().contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    return out
