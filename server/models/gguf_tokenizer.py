"""The tokenizer of a GGUF file: transformers' GGUF tokenizer builder (it reads only the `tokenizer.*`
keys), corrected where it departs from the SentencePiece model the vocabulary came from and from
llama.cpp, which defines what the keys mean.

A `tokenizer.ggml.model = llama` vocabulary (SentencePiece BPE: Llama 2, Mistral v0.1, Phi-3, Gemma;
convert_hf_to_gguf.py's `_set_vocab_sentencepiece`) is served as llama.cpp's SPM tokenizer reads it
(src/llama-vocab.cpp, `LLAMA_VOCAB_TYPE_SPM`): every space is `▁`, and where
`tokenizer.ggml.add_space_prefix` is true (its default; Gemma's converters write false) one `▁` is put
before every run of text, also one that starts with a space and one that follows a special token.
transformers builds a `Metaspace(prepend_scheme="first")` pre-tokenizer instead, which prepends
nothing to text that already starts with a space (" Hello" lost a space: `▁Hello`, decoded "Hello")
and ignores the flag; Hugging Face's own Llama 2 `tokenizer.json` prepends with a normalizer, as here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SPACE = "\u2581"  # SentencePiece's visible space
# llama.cpp architectures whose vocabulary is another's that transformers' builder knows by name (it
# picks Gemma's SentencePiece builder, with merges in the file's token order and spaces respelled, by
# architecture): EmbeddingGemma's is Gemma 3's
SAME_VOCABULARY = {"gemma-embedding": "gemma3"}


def build_as(gguf: Path, architecture: str) -> Any:
    """transformers' GGUF tokenizer of `gguf` built as if its architecture were `architecture`: the
    same steps as `from_pretrained(gguf_file=...)` (the file's `tokenizer.*` keys; special tokens,
    BOS/EOS flags and chat template as its tokenizer config)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer,
        get_gguf_tokenizer,
    )

    _, vocabulary, tokenizer_config = get_gguf_tokenizer(str(gguf))
    backend, extra = convert_gguf_tokenizer(architecture, vocabulary)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)


def _metadata(gguf: Path) -> dict[str, Any]:
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    out: dict[str, Any] = {}
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.add_space_prefix"):
        field = reader.fields.get(key)
        out[key] = None if field is None else field.contents()
    return out


def fix_sentencepiece(tok: Any, gguf: Path) -> None:
    """Sets the normalizer, pre-tokenizer and decoder of `tok` (a transformers fast tokenizer built
    from `gguf`) to llama.cpp's SPM reading when the file's vocabulary is SentencePiece (`llama`);
    other vocabularies are left as built. The model (pieces, merges, byte fallback) is kept."""
    from tokenizers import decoders, normalizers

    meta = _metadata(gguf)
    if meta["tokenizer.ggml.model"] != "llama":
        return
    prefix = meta["tokenizer.ggml.add_space_prefix"]
    prefix = True if prefix is None else bool(prefix)  # llama.cpp's default for SPM vocabularies
    backend = tok.backend_tokenizer
    replace = normalizers.Replace(" ", SPACE)
    # A normalizer runs on each piece of text between added tokens: the prefix follows special
    # tokens too, as llama.cpp's `is_prev_special`.
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), replace]) if prefix else replace
    backend.pre_tokenizer = None
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1))  # the prefix's space, as SentencePiece
    backend.decoder = decoders.Sequence(steps)
