"""GGUF files of the tiny random models of test_arch_parity.py, written with gguf-py the way llama.cpp's
convert_hf_to_gguf.py writes each architecture (its tensor names, metadata keys, q/k row permutation for
the Llama-converted families, Gemma's norm weights + 1, Phi-3's fused tensors and LongRoPE factor
tensors), plus the Hugging Face folder that holds exactly the file's weights (each quantized tensor
dequantized by gguf-py): the reference transformers runs. Written independently of server/ (its own
name tables), so a mapping error on our side shows as a mismatch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

# llama.cpp architecture per model_type, and whether its converter permutes q/k (LlamaModel subclasses)
GGUF_ARCH = {
    "qwen3": ("qwen3", False),
    "granite": ("granite", True),
    "smollm3": ("smollm3", True),
    "olmo2": ("olmo2", False),
    "phi3": ("phi3", False),
    "gemma": ("gemma", False),
    "gemma2": ("gemma2", False),
    "gemma3_text": ("gemma3", False),
}
_LLAMA = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
_POST = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_PHI3 = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}


def _names(model_type: str) -> dict[str, str]:
    if model_type in ("gemma2", "gemma3_text", "olmo2"):
        return {**_LLAMA, **_POST}
    if model_type == "phi3":
        return {**_LLAMA, **_PHI3}
    return _LLAMA


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:  # convert_hf_to_gguf.py's LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return params.get("full_attention", params)


def _metadata(writer: Any, cfg: dict[str, Any], arch: str) -> None:
    import gguf

    n_head = cfg["num_attention_heads"]
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = _rope(cfg)
    writer.add_rope_freq_base(float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    if arch in ("qwen3", "gemma", "gemma2", "gemma3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "granite":
        writer.add_attention_scale(cfg["attention_multiplier"])
        writer.add_embedding_scale(cfg["embedding_multiplier"])
        writer.add_residual_scale(cfg["residual_multiplier"])
        writer.add_logit_scale(cfg["logits_scaling"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma3" and rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if arch == "phi3":
        rot = rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0
        writer.add_rope_dimension_count(int(rot * cfg["hidden_size"]) // n_head)
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_sliding_window(cfg.get("sliding_window") or 0)


# A tiny byte-level BPE vocabulary (GPT-2's byte alphabet, a few merges, ChatML's control tokens): the
# tokenizer and chat template our loader builds from the file's `tokenizer.*` keys, at a size whose
# writing and reading take milliseconds (SmolLM2's 49152 tokens took ~20 s per file here).
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "o n", "e r"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_vocab() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    merged = ["".join(m.split(" ")) for m in MERGES]
    return alphabet + merged + SPECIALS


def _tokenizer(writer: Any) -> None:
    tokens = tiny_vocab()
    eos = tokens.index("<|endoftext|>")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])  # 3: CONTROL, 1: NORMAL
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(eos)
    writer.add_eos_token_id(eos)
    writer.add_pad_token_id(eos)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def _encode(w: np.ndarray, fmt: str) -> tuple[np.ndarray, Any, np.ndarray]:
    """(file data, GGML type, gguf-py's dequantization of it). A K-quant asked for a row length that
    is not a multiple of 256 falls back to Q8_0, as llama.cpp's quantizer does."""
    if w.shape[1] % 32:
        fmt = "F16"
    import gguf
    from gguf_quant import K_QUANTIZERS

    if fmt in K_QUANTIZERS and w.shape[1] % 256:
        fmt = "Q8_0"
    qtype = gguf.GGMLQuantizationType[fmt]
    if fmt == "F16":
        data = w.astype(np.float16)
        return data, qtype, data.astype(np.float32)
    data = (
        K_QUANTIZERS[fmt](w) if fmt in K_QUANTIZERS else gguf.quants.quantize(np.ascontiguousarray(w), qtype)
    )
    return data, qtype, gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(w.shape)


def write_arch_gguf(hf_folder: Path, out: Path, ref_folder: Path, fmts: dict[str, str]) -> Path:
    """`hf_folder` (fp32, vocabulary tiny_vocab()) as a GGUF whose 2-D tensors take the type `fmts`
    gives their GGUF stem (attn_q, ffn_down, token_embd, ...; "*" for the rest: F16, Q8_0, Q4_K,
    Q6_K), as llama.cpp's mixed Q4_K_M files do; `ref_folder`: a copy of `hf_folder` holding the
    file's weights."""
    import gguf
    from safetensors.torch import load_file, save_file

    cfg = json.loads((hf_folder / "config.json").read_text())
    arch, permute = GGUF_ARCH[cfg["model_type"]]
    names = _names(cfg["model_type"])
    shift = 1.0 if arch.startswith("gemma") else 0.0
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    state = load_file(str(hf_folder / "model.safetensors"))
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(out.stem)
    _metadata(writer, cfg, arch)
    _tokenizer(writer)
    ref: dict[str, torch.Tensor] = {}
    tied = cfg.get("tie_word_embeddings")
    for name, t in state.items():
        if name == "lm_head.weight" and tied:
            continue
        w = t.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            parts = name.split(".")  # model.layers.N.<module...>.weight
            gname = f"blk.{parts[2]}.{names['.'.join(parts[3:-1])]}.{parts[-1]}"
        heads = n_head if ".q_proj." in name else n_kv
        rotary = permute and (".q_proj." in name or ".k_proj." in name)
        if w.ndim == 1:
            stored = np.ascontiguousarray(w + shift if name.endswith("norm.weight") else w, dtype=np.float32)
            writer.add_tensor(gname, stored)
            ref[name] = t.float()
            continue
        stem = gname.split(".")[-2]
        data, qtype, dense = _encode(_permute(w, heads) if rotary else w, fmts.get(stem, fmts["*"]))
        writer.add_tensor(gname, data, raw_dtype=qtype)
        ref[name] = torch.from_numpy(np.ascontiguousarray(_unpermute(dense, heads) if rotary else dense))
    if arch == "phi3":
        rope = _rope(cfg)
        writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    shutil.copytree(hf_folder, ref_folder)
    save_file(ref, str(ref_folder / "model.safetensors"), metadata={"format": "pt"})
    return out
