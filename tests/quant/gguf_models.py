"""Tiny random GGUF models written with the `gguf` package, the way llama.cpp's convert_hf_to_gguf.py
writes them (ggml tensor names, q/k rows permuted for ggml's rotary layout, SmolLM2's tokenizer
metadata copied from the embedded GGUF), so transformers' GGUF reader can load them as a reference."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(hf_folder: Path, out: Path, fmt: str, embedding_fmt: str | None = None) -> Path:
    """The fp32 model in `hf_folder` (tests/conftest.py build_tiny_model, llama) as a GGUF whose 2-D
    tensors are `fmt` (Q4_0, Q4_1 or Q8_0), the token embedding `embedding_fmt` (default: fmt)."""
    import gguf
    from safetensors.torch import load_file

    from server.models.loader import embedded_gguf_path

    cfg = json.loads((hf_folder / "config.json").read_text())
    state = load_file(str(hf_folder / "model.safetensors"))
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(out.stem)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    writer.add_vocab_size(cfg["vocab_size"])
    source = gguf.GGUFReader(str(embedded_gguf_path()))
    for key, field in source.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, field.contents(), vtype)
    for name, t in state.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        w = t.float().numpy()
        if name == "model.embed_tokens.weight":
            gname, kind = "token_embd.weight", embedding_fmt or fmt
        elif name == "model.norm.weight":
            gname, kind = "output_norm.weight", fmt
        elif name == "lm_head.weight":
            gname, kind = "output.weight", fmt
        else:
            parts = name.split(".")  # model.layers.N.<module...>.weight
            module = ".".join(parts[3:-1])
            gname, kind = f"blk.{parts[2]}.{HF_TO_GGUF[module]}.{parts[-1]}", fmt
            if module == "self_attn.q_proj":
                w = _permute(w, n_head)
            elif module == "self_attn.k_proj":
                w = _permute(w, n_kv)
        if w.ndim == 1:
            writer.add_tensor(gname, np.ascontiguousarray(w, dtype=np.float32))
            continue
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(gname, gguf.quants.quantize(np.ascontiguousarray(w), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def hf_reference_greedy(gguf_path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' own reading of the GGUF (dequantized to fp32), greedy."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = hf.generate(
                torch.tensor([p]), max_new_tokens=n, do_sample=False, min_new_tokens=n, eos_token_id=None
            )
            outs.append(ids[0, len(p) :].tolist())
    return outs
