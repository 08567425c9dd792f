"""llama.cpp's tensor layout per GGUF architecture (`general.architecture`), as convert_hf_to_gguf.py
writes it (gguf-py's constants.py MODEL_TENSORS and tensor_mapping.py): which GGUF tensor is which
Hugging Face tensor, whether q/k rows were permuted for ggml's rotary layout, and what the converter
added to the norm weights. Plain data; gguf_checkpoint.py applies it.

- q/k rows are permuted only by the converter's LlamaModel and its subclasses (llama, mistral files,
  granite, smollm3): llama.cpp runs those with LLAMA_ROPE_TYPE_NORM. Qwen2/3, Gemma, Phi-3 and OLMo 2
  keep transformers' row order (NEOX rotary).
- Gemma's converters store every `*norm.weight` as w + 1 (llama.cpp's RMSNorm multiplies by w, Gemma's
  by 1 + w): `norm_shift` 1.0 is subtracted back, so our (1 + w) layers read the checkpoint's w.
- The same GGUF name means different HF tensors per family: `ffn_norm` is Llama's
  post_attention_layernorm (the norm before the MLP) but Gemma 2/3's pre_feedforward_layernorm, and
  `post_attention_norm` is Gemma's and OLMo 2's post_attention_layernorm (after attention).
- Phi-3 keeps its fused tensors: `attn_qkv` (q, k, v rows) and `ffn_up` (gate rows, then up rows).
- gpt-oss (`gpt-oss`, convert_hf_to_gguf.py's GptOssModel): q/k/v/o with biases, `post_attention_norm`
  is its post_attention_layernorm (the norm before the MoE block), `attn_sinks.weight` its
  `self_attn.sinks` parameter (`parameters`: the HF name has no `.weight`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

_LLAMA_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_SANDWICH = {
    **_LLAMA_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_OLMO2 = {
    **{k: v for k, v in _LLAMA_LAYER.items() if k not in ("attn_norm", "ffn_norm")},
    **_QK_NORM,
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3 = {**_LLAMA_LAYER, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_GPT_OSS = {
    **{k: v for k, v in _LLAMA_LAYER.items() if k != "ffn_norm"},
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks": "self_attn.sinks",
}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class GgufLayout:
    """One llama.cpp architecture's tensor layout. `layer`: GGUF block tensor stem (blk.N.<stem>) ->
    HF module under model.layers.N; `permute_qk`: q/k rows are in ggml's rotary order; `norm_shift`:
    added to every norm weight by the converter (subtracted at load); `parameters`: stems whose HF
    name is a bare parameter (gpt-oss's sinks: `blk.N.attn_sinks.weight` -> `self_attn.sinks`)."""

    layer: dict[str, str] = field(default_factory=lambda: dict(_LLAMA_LAYER))
    permute_qk: bool = False
    norm_shift: float = 0.0
    parameters: frozenset[str] = frozenset()


LAYOUTS: dict[str, GgufLayout] = {
    "llama": GgufLayout(permute_qk=True),
    "qwen2": GgufLayout(),
    "qwen3": GgufLayout({**_LLAMA_LAYER, **_QK_NORM}),
    # MoE blocks' tensors (ffn_*_exps, *_shexp) are gguf_checkpoint._MOE_NAMES', in every layout
    "qwen2moe": GgufLayout(),
    "qwen3moe": GgufLayout({**_LLAMA_LAYER, **_QK_NORM}),
    "granite": GgufLayout(permute_qk=True),
    "smollm3": GgufLayout(permute_qk=True),
    "olmo2": GgufLayout(_OLMO2),
    "phi3": GgufLayout(_PHI3),
    "gemma": GgufLayout(norm_shift=1.0),
    "gemma2": GgufLayout(_SANDWICH, norm_shift=1.0),
    "gemma3": GgufLayout({**_SANDWICH, **_QK_NORM}, norm_shift=1.0),
    # EmbeddingGemma: gemma3's layers; its dense_2/dense_3 projections are models/gguf_embedder.py's
    "gemma-embedding": GgufLayout({**_SANDWICH, **_QK_NORM}, norm_shift=1.0),
    "gpt-oss": GgufLayout(_GPT_OSS, parameters=frozenset({"attn_sinks"})),
}
