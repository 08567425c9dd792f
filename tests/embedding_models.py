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
