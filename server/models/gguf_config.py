"""A GGUF file's metadata as a Hugging Face config.json, for the architectures transformers' GGUF
reader does not read (granite, olmo2, smollm3, gemma) or reads short (qwen3: `attention.key_length`,
its head_dim; gemma2/3: no soft-caps, sliding pattern or local RoPE base). Our own reading of
llama.cpp's keys (gguf-py constants.py `Keys`; convert_hf_to_gguf.py writes them, llama-model.cpp
reads them), per `general.architecture`:

- common: `{arch}.context_length`, `embedding_length`, `feed_forward_length`, `block_count`,
  `attention.head_count`, `attention.head_count_kv`, `attention.key_length` (head_dim where it is not
  hidden / heads), `attention.layer_norm_rms_epsilon`, `rope.freq_base`, `rope.scaling.type` /
  `.factor` / `.original_context_length` (linear, yarn); the vocabulary size is the token embedding's
  rows, the LM head is tied where the file has no `output.weight`; token ids from `tokenizer.ggml.*`.
- granite: `attention.scale`, `embedding_scale`, `residual_scale`, `logit_scale` (the multipliers).
- smollm3: no key; llama.cpp fixes every 4th layer as NoPE (`n_no_rope_layer_step = 4`).
- phi3: `rope.dimension_count` (partial rotary), `attention.sliding_window` (0: none), LongRoPE's factors
  as the tensors `rope_factors_long` / `rope_factors_short` with `rope.scaling.original_context_length`.
- gemma2: `attn_logit_softcapping`, `final_logit_softcapping`, `attention.sliding_window`; every other
  layer windowed (llama.cpp's swa pattern 2).
- gemma3: `attention.sliding_window`, `rope.freq_base_swa` (default 10000, as llama.cpp), the pattern
  `attention.sliding_window_pattern` (default 6: five windowed layers, then a global one).
- gemma-embedding (EmbeddingGemma): gemma3's keys, bidirectional attention, query_pre_attn_scalar =
  head_dim (llama.cpp's fixed scale); its pooling and Dense tensors: models/gguf_embedder.py.
- gpt-oss: `expert_count`, `expert_used_count`, `expert_feed_forward_length` (the experts' size),
  `attention.sliding_window` on even layers (llama.cpp's swa pattern 2), q/k/v/o biases, YaRN's
  `rope.scaling.yarn_beta_fast` / `yarn_beta_slow` (default 32 / 1) without truncation and the SwiGLU
  limit 7 as gpt-oss's config.json has them (the file has no key for either).
- Gemma 2/3's query_pre_attn_scalar is not stored: llama.cpp scales by head_dim**-0.5, except for the
  27B shapes (46 / 62 layers), where it is (hidden / heads)**-0.5; we read it the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from server.models.layer_spec import UnsupportedModelError

Get = Callable[[str, Any], Any]  # "{arch}." key suffix, default -> value


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def _rope_scaling(get: Get) -> dict[str, Any] | None:
    kind = get("rope.scaling.type", None)
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise UnsupportedModelError(f"GGUF rope.scaling.type {kind!r} is not read (linear, yarn)")
    out: dict[str, Any] = {"rope_type": kind, "factor": float(get("rope.scaling.factor", 1.0))}
    orig = get("rope.scaling.original_context_length", None)
    if orig:
        out["original_max_position_embeddings"] = int(orig)
    return out


def _granite(cfg: dict[str, Any], get: Get, tensors: dict[str, Any]) -> None:
    cfg["attention_multiplier"] = float(get("attention.scale", 1.0))
    cfg["embedding_multiplier"] = float(get("embedding_scale", 1.0))
    cfg["residual_multiplier"] = float(get("residual_scale", 1.0))
    cfg["logits_scaling"] = float(get("logit_scale", 1.0))


def _smollm3(cfg: dict[str, Any], get: Get, tensors: dict[str, Any]) -> None:
    cfg["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in range(cfg["num_hidden_layers"])]


def _phi3(cfg: dict[str, Any], get: Get, tensors: dict[str, Any]) -> None:
    rope_dims = int(get("rope.dimension_count", cfg["head_dim"]))
    cfg["partial_rotary_factor"] = rope_dims / cfg["head_dim"]
    window = int(get("attention.sliding_window", 0) or 0)
    cfg["sliding_window"] = window or None
    long, short = tensors.get("rope_factors_long.weight"), tensors.get("rope_factors_short.weight")
    if long is not None and short is not None:
        orig = int(get("rope.scaling.original_context_length", cfg["max_position_embeddings"]))
        cfg["original_max_position_embeddings"] = orig
        cfg["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": [float(x) for x in long.data],
            "short_factor": [float(x) for x in short.data],
            "original_max_position_embeddings": orig,
        }


def _gemma_scalar(cfg: dict[str, Any], big_layers: int) -> None:
    big = cfg["num_hidden_layers"] == big_layers
    cfg["query_pre_attn_scalar"] = (
        cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"]
    )


def _gemma(cfg: dict[str, Any], get: Get, tensors: dict[str, Any]) -> None:
    cfg["hidden_activation"] = "gelu_pytorch_tanh"


def _gemma2(cfg: dict[str, Any], get: Get, tensors: dict[str, Any]) -> None:
    _gemma(cfg, get, tensors)
    _gemma_scalar(cfg, 46)
    cfg["attn_logit_softcapping"] = get("attn_logit_softcapping", None)
    cfg["final_logit_softcapping"] = get("final_logit_softcapping", None)
    cfg["sliding_window"] = get("attention.sliding_window", None)
    n = cfg["num_hidden_layers"]
    cfg["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


def _gemma3(cfg: dict[str, Any], get: Get, tensors: dict[str, Any]) -> None:
    _gemma(cfg, get, tensors)
    _gemma_scalar(cfg, 62)
    cfg["sliding_window"] = get("attention.sliding_window", None)
    cfg["rope_local_base_freq"] = float(get("rope.freq_base_swa", 10000.0))
    n = cfg["num_hidden_layers"]
    pattern = get("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # per layer: true where the layer is windowed
        if len(pattern) != n:
            raise UnsupportedModelError(
                f"attention.sliding_window_pattern has {len(pattern)} entries for {n}"
            )
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(n)]
    cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    cfg["final_logit_softcapping"] = get("final_logit_softcapping", None)


def _gemma_embedding(cfg: dict[str, Any], get: Get, tensors: dict[str, Any]) -> None:
    _gemma3(cfg, get, tensors)
    # llama.cpp: causal_attn false, LLAMA_SWA_TYPE_SYMMETRIC (|i - j| <= window / 2), the window as
    # config.json has it: what transformers reads with use_bidirectional_attention
    cfg["use_bidirectional_attention"] = True
    cfg["query_pre_attn_scalar"] = cfg["head_dim"]  # llama.cpp's f_attention_scale, whatever the shape


# gpt-oss's clamped SwiGLU limit: llama.cpp's gpt-oss graph fixes it (no key), as every shipped config
GPT_OSS_SWIGLU_LIMIT = 7.0


def _gpt_oss(cfg: dict[str, Any], get: Get, tensors: dict[str, Any]) -> None:
    n = cfg["num_hidden_layers"]
    cfg["num_local_experts"] = int(get("expert_count", 0))
    cfg["num_experts_per_tok"] = int(get("expert_used_count", 0))
    cfg["intermediate_size"] = int(get("expert_feed_forward_length", cfg["intermediate_size"]))
    cfg["attention_bias"] = True
    cfg["swiglu_limit"] = GPT_OSS_SWIGLU_LIMIT
    window = int(get("attention.sliding_window", 0) or 0)
    cfg["sliding_window"] = window or None
    # llama.cpp's swa pattern 2 for gpt-oss: even layers windowed (transformers' default layer_types)
    kinds = ("sliding_attention", "full_attention") if window else ("full_attention", "full_attention")
    cfg["layer_types"] = [kinds[i % 2] for i in range(n)]
    scaling = cfg.get("rope_scaling")
    if scaling is not None and scaling["rope_type"] == "yarn":
        scaling["beta_fast"] = float(get("rope.scaling.yarn_beta_fast", 32.0))
        scaling["beta_slow"] = float(get("rope.scaling.yarn_beta_slow", 1.0))
        scaling["truncate"] = False  # gpt-oss's config.json (the file has no key for it)


def _none(cfg: dict[str, Any], get: Get, tensors: dict[str, Any]) -> None:
    pass


# llama.cpp architecture -> (HF architecture, model_type, its own keys)
READERS: dict[str, tuple[str, str, Callable[[dict[str, Any], Get, dict[str, Any]], None]]] = {
    "qwen3": ("Qwen3ForCausalLM", "qwen3", _none),
    "granite": ("GraniteForCausalLM", "granite", _granite),
    "smollm3": ("SmolLM3ForCausalLM", "smollm3", _smollm3),
    "olmo2": ("Olmo2ForCausalLM", "olmo2", _none),
    "phi3": ("Phi3ForCausalLM", "phi3", _phi3),
    "gemma": ("GemmaForCausalLM", "gemma", _gemma),
    "gemma2": ("Gemma2ForCausalLM", "gemma2", _gemma2),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", _gemma3),
    "gpt-oss": ("GptOssForCausalLM", "gpt_oss", _gpt_oss),
    # EmbeddingGemma: a headless bidirectional Gemma 3 (served by the pooling loader: gguf_embedder.py)
    "gemma-embedding": ("Gemma3TextModel", "gemma3_text", _gemma_embedding),
}


def gguf_architecture(path: Path) -> str:
    """`general.architecture` of the file (llama.cpp's name: llama, qwen2, gemma3, ...)."""
    from server.gguf_file import open_gguf

    return str(_field(open_gguf(path, long_arrays=False), "general.architecture") or "llama")


def hf_config_from_gguf(path: Path, reader: Any | None = None) -> dict[str, Any]:
    """config.json for a GGUF of one of READERS' architectures (UnsupportedModelError otherwise, or
    where a key our layers cannot express is set: a per-layer KV head count, another RoPE scaling).
    `reader`: the caller's open of `path` (server/gguf_file.py), else the file is opened here."""
    from server.gguf_file import open_gguf

    if reader is None:
        reader = open_gguf(path, long_arrays=False)
    arch = str(_field(reader, "general.architecture") or "llama")
    if arch not in READERS:
        raise UnsupportedModelError(f"{path.name}: GGUF architecture {arch!r} has no config reader")
    hf_arch, model_type, extra = READERS[arch]

    def get(key: str, default: Any) -> Any:
        value = _field(reader, f"{arch}.{key}")
        return default if value is None else value

    tensors = {t.name: t for t in reader.tensors}
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise UnsupportedModelError(f"{path.name} has no token_embd.weight")
    heads = int(get("attention.head_count", 0))
    kv = get("attention.head_count_kv", heads)
    if isinstance(kv, list):
        if len(set(kv)) != 1:
            raise UnsupportedModelError(
                f"{path.name}: per-layer KV head counts {sorted(set(kv))} are not served"
            )
        kv = kv[0]
    hidden = int(get("embedding_length", 0))
    if not heads or not hidden:
        raise UnsupportedModelError(f"{path.name} lacks {arch}.attention.head_count or embedding_length")
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModelError(f"{path.name}: key_length and value_length differ")
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(embd.shape[1]),  # ggml order: [hidden, vocab]
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", 0)),
        "num_hidden_layers": int(get("block_count", 0)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(get),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "_name_or_path": path.stem,
    }
    extra(cfg, get, tensors)
    return cfg
