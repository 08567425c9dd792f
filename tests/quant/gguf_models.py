"""Tiny random GGUF models written with the `gguf` package, the way llama.cpp's convert_hf_to_gguf.py
writes them (ggml tensor names, q/k rows permuted for ggml's rotary layout, SmolLM2's tokenizer
metadata copied from the embedded GGUF), so transformers' GGUF reader can load them as a reference."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf_quant import K_QUANTIZERS, quantize_q4_k, quantize_q6_k  # noqa: F401  (re-exported: test_cpu_qlinear)
from gguf_vocab import add_embedded_tokenizer

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


def write_tiny_gguf(
    hf_folder: Path,
    out: Path,
    fmt: str,
    embedding_fmt: str | None = None,
    raw: dict[str, tuple[str, np.ndarray]] | None = None,
    tokenizer: bool = True,
) -> Path:
    """The fp32 model in `hf_folder` (tests/conftest.py build_tiny_model, llama) as a GGUF whose 2-D
    tensors are `fmt` (Q4_0, Q4_1, Q8_0, Q4_K or Q6_K: hidden sizes a multiple of 256), the token embedding
    `embedding_fmt` (default: fmt). `raw`: HF name -> (GGUF type, block bytes in the file's row order)
    written as they are instead (random_block_model). tokenizer=False leaves out the tokenizer (3 s of
    writing, and the server's conversion of it): for load_gguf_model given the HF folder's config."""
    import gguf
    from safetensors.torch import load_file

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
    if tokenizer:
        add_embedded_tokenizer(writer)
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
        if raw is not None and name in raw:
            kind, blocks = raw[name]
            writer.add_tensor(gname, blocks, raw_dtype=gguf.GGMLQuantizationType[kind])
            continue
        if w.ndim == 1:
            writer.add_tensor(gname, np.ascontiguousarray(w, dtype=np.float32))
            continue
        qtype = gguf.GGMLQuantizationType[kind]
        data = (
            K_QUANTIZERS[kind](w)
            if kind in K_QUANTIZERS
            else gguf.quants.quantize(np.ascontiguousarray(w), qtype)
        )
        writer.add_tensor(gname, data, raw_dtype=qtype)
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
            ids = hf.generate(  # type: ignore[misc]
                torch.tensor([p]), max_new_tokens=n, do_sample=False, min_new_tokens=n, eos_token_id=None
            )
            outs.append(ids[0, len(p) :].tolist())
    return outs


# Byte offset and magnitude of each fp16 field (d, dmin or m) of a block, chosen so that random blocks
# give weights of about the size build_tiny_model draws (|w| up to ~0.05-0.12): ggml-common.h's layouts.
RANDOM_BLOCK_F16: dict[str, list[tuple[int, float]]] = {
    "Q5_0": [(0, 3e-3)],
    "Q5_1": [(0, 3e-3), (2, -0.05)],
    "Q5_K": [(0, 3e-5), (2, 8e-4)],
    "Q4_K": [(0, 6e-5), (2, 8e-4)],
    "Q3_K": [(108, 1e-3)],
    "Q2_K": [(80, 3e-3), (82, 3e-3)],
    "IQ4_NL": [(0, 4e-4)],
    "IQ4_XS": [(0, 1.5e-5)],
    "IQ2_XXS": [(0, 2e-3)],
}


def random_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[N, K / block * bytes] uint8: valid GGUF blocks of `kind` from random bytes, their fp16 scales
    replaced by positive values of RANDOM_BLOCK_F16's magnitude (random bytes would be NaN/inf/huge)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    b = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    for off, mag in RANDOM_BLOCK_F16[kind]:
        d = (mag * rng.uniform(0.5, 1.0, size=(b.shape[0], 1))).astype(np.float16)
        b[:, off : off + 2] = d.view(np.uint8)
    return b.reshape(n, -1)


def random_block_model(
    template: Path, out: Path, kinds: dict[str, str], seed: int = 0
) -> dict[str, tuple[str, np.ndarray]]:
    """A copy of the HF folder `template` (llama) in `out` whose 2-D tensors are gguf-py's dequantization
    of random blocks: `kinds` maps an HF name to its GGUF type ("*" for every other 2-D tensor). Returns
    write_tiny_gguf's `raw` (q/k blocks in the file's permuted row order), so the GGUF written from `out`
    holds exactly the weights of `out` (kinds F32/F16 stay the template's, written as write_tiny_gguf's
    `fmt`/`embedding_fmt` say)."""
    import shutil

    import gguf
    from safetensors.torch import load_file, save_file

    from server.quant.gguf_checkpoint import rotary_unpermute

    cfg = json.loads((template / "config.json").read_text())
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    shutil.copytree(template, out)
    state = load_file(str(out / "model.safetensors"))
    rng = np.random.default_rng(seed)
    raw: dict[str, tuple[str, np.ndarray]] = {}
    for name, t in state.items():
        if t.dim() != 2 or (name == "lm_head.weight" and cfg.get("tie_word_embeddings")):
            continue
        kind = kinds.get(name, kinds["*"])
        if kind in ("F32", "F16"):  # left to write_tiny_gguf's fmt / embedding_fmt
            continue
        n, k = t.shape
        blocks = random_blocks(kind, n, k, rng)
        dense = torch.from_numpy(
            gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind]).astype(np.float32)
        ).reshape(n, k)
        if ".q_proj." in name or ".k_proj." in name:
            dense = dense[rotary_unpermute(n, n_head if ".q_proj." in name else n_kv)].contiguous()
        state[name] = dense
        raw[name] = (kind, blocks)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return raw
