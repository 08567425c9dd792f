"""Tiny sentence-transformers folders around our decoder architectures (not a test module)."""

from __future__ import annotations

import shutil
from pathlib import Path

# Qwen3-Embedding's query instruction (its config_sentence_transformers.json `prompts`)
QWEN3_QUERY_PROMPT = (
    "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
)


def build_qwen3_embedding(causal_lm: Path, out: Path, max_seq_length: int = 96) -> Path:
    """A Qwen3-Embedding-style folder as sentence-transformers saves it from a Qwen3 causal checkpoint:
    the headless Qwen3Model (config architectures ["Qwen3Model"], weights without the `model.` prefix,
    no lm_head), 1_Pooling lasttoken, 2_Normalize, and the query/document instruction prompts."""
    from sentence_transformers import SentenceTransformer, models

    # Without a chat template: given one, sentence-transformers 6 wraps each plain string in it (its
    # "message" modality), where Qwen3-Embedding and our server embed the text itself.
    source = out.with_name(out.name + "-causal")
    shutil.copytree(causal_lm, source, dirs_exist_ok=True)
    (source / "chat_template.jinja").unlink(missing_ok=True)
    transformer = models.Transformer(str(source), max_seq_length=max_seq_length)
    assert not getattr(transformer.tokenizer, "chat_template", None)
    pooling = models.Pooling(transformer.get_embedding_dimension(), pooling_mode="lasttoken")
    st = SentenceTransformer(
        modules=[transformer, pooling, models.Normalize()],
        prompts={"query": QWEN3_QUERY_PROMPT, "document": ""},
        device="cpu",
    )
    st.save(str(out))
    return out


# EmbeddingGemma's task prompts (config_sentence_transformers.json of google/embeddinggemma-300m)
GEMMA_QUERY_PROMPT = "task: search result | query: "
GEMMA_DOCUMENT_PROMPT = "title: none | text: "
# config.json's sliding_window: transformers reads a bidirectional Gemma 3's as a window of
# 8 // 2 + 1 = 5 (|query - key| < 5), so the parity texts (20+ tokens) span several windows
GEMMA_CONFIG_WINDOW = 8


def build_embedding_gemma(tokenizer_from: Path, out: Path, max_seq_length: int = 128) -> Path:
    """A tiny EmbeddingGemma-style sentence-transformers folder, google/embeddinggemma-300m's layout at
    random weights: the headless Gemma3TextModel with use_bidirectional_attention (sliding and full layers
    interleaved, separate local RoPE base, GQA), 1_Pooling mean, 2_Dense and 3_Dense (no bias, identity
    activation; 64 -> 96 -> 48), 4_Normalize, and named query/document prompts (default: query).
    SmolLM2's tokenizer (padding on the right, no chat template), so text round-trips."""
    import torch
    from engine_driver import TOKENIZER_FILES
    from sentence_transformers import SentenceTransformer, models
    from transformers import Gemma3TextConfig, Gemma3TextModel

    cfg = Gemma3TextConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=32,
        max_position_embeddings=512,
        sliding_window=GEMMA_CONFIG_WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        use_bidirectional_attention=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(5)
    model = Gemma3TextModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            else:  # zero-centred (1 + w) norms: random, so a norm read wrongly shows
                p.normal_(0.0, 0.3)
    source = out.with_name(out.name + "-transformer")
    source.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(source))
    for name in TOKENIZER_FILES:
        if name != "chat_template.jinja" and (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, source / name)
    transformer = models.Transformer(str(source), max_seq_length=max_seq_length)
    transformer.tokenizer.padding_side = "right"
    assert not getattr(transformer.tokenizer, "chat_template", None)
    dim = transformer.get_embedding_dimension()
    torch.manual_seed(6)
    dense = [
        models.Dense(dim, 96, bias=False, activation_function=torch.nn.Identity()),
        models.Dense(96, 48, bias=False, activation_function=torch.nn.Identity()),
    ]
    st = SentenceTransformer(
        modules=[transformer, models.Pooling(dim, pooling_mode="mean"), *dense, models.Normalize()],
        prompts={"query": GEMMA_QUERY_PROMPT, "document": GEMMA_DOCUMENT_PROMPT},
        default_prompt_name="query",
        device="cpu",
    )
    st.save(str(out))
    return out
