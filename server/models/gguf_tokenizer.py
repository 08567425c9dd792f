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
    from server.gguf_file import open_gguf

    reader = open_gguf(gguf)
    out: dict[str, Any] = {}
    keys = ["tokenizer.ggml.model", "tokenizer.ggml.add_space_prefix"]
    if _field(reader, "tokenizer.ggml.model") == "t5":
        keys += [
            "tokenizer.ggml.remove_extra_whitespaces",
            "tokenizer.ggml.precompiled_charsmap",
            "tokenizer.ggml.scores",
            "tokenizer.ggml.token_type",
            "tokenizer.ggml.unknown_token_id",
        ]
    for key in keys:
        out[key] = _field(reader, key)
    return out


def unigram(gguf: Path) -> bool:
    """Whether the file's vocabulary is a SentencePiece unigram model (`tokenizer.ggml.model = t5`)."""
    from server.gguf_file import open_gguf

    return bool(_field(open_gguf(gguf, long_arrays=False), "tokenizer.ggml.model") == "t5")


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def fix_sentencepiece(tok: Any, gguf: Path) -> None:
    """Sets the normalizer, pre-tokenizer and decoder of `tok` (a transformers fast tokenizer built
    from `gguf`) to llama.cpp's SPM reading when the file's vocabulary is SentencePiece (`llama`);
    other vocabularies are left as built. The model (pieces, merges, byte fallback) is kept."""
    from tokenizers import decoders, normalizers

    meta = _metadata(gguf)
    if meta["tokenizer.ggml.model"] == "t5":
        _fix_unigram(tok, meta)
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


def _fix_unigram(tok: Any, meta: dict[str, Any]) -> None:
    """A SentencePiece unigram vocabulary (`tokenizer.ggml.model = t5`: T5, XLM-R; convert_hf_to_gguf.py
    writes every unigram model so) read as the SentencePiece model reads it (llama.cpp's UGM tokenizer
    follows the same keys): the `precompiled_charsmap` normalization (NFKC for most), the extra
    whitespace removed only where `remove_extra_whitespaces`, the `add_space_prefix`, and byte fallback
    where the vocabulary has `<0xNN>` pieces (type 6). transformers' builder applies none of the
    charsmap, always collapses whitespace, and maps unknown characters to <unk> instead of bytes."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers

    backend = tok.backend_tokenizer
    prefix = meta["tokenizer.ggml.add_space_prefix"]
    prefix = True if prefix is None else bool(prefix)
    steps: list[Any] = []
    charsmap = meta["tokenizer.ggml.precompiled_charsmap"]
    if charsmap:
        steps.append(normalizers.Precompiled(bytes(charsmap)))
    if meta["tokenizer.ggml.remove_extra_whitespaces"]:
        steps += [normalizers.Replace(Regex("^ +| +$"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if prefix:
        steps.append(normalizers.Prepend(SPACE))
    steps.append(normalizers.Replace(" ", SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    # pieces never cross a space (SentencePiece's split_by_whitespace): split before each one
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="never", split=True)
    scores, types = meta["tokenizer.ggml.scores"], meta["tokenizer.ggml.token_type"] or []
    size = backend.get_vocab_size(with_added_tokens=False)
    vocab = [(backend.id_to_token(i), float(scores[i])) for i in range(size)]
    unk = meta["tokenizer.ggml.unknown_token_id"]
    byte_fallback = 6 in types  # BYTE
    backend.model = models.Unigram(
        vocab, unk_id=None if unk is None else int(unk), byte_fallback=byte_fallback
    )
    decode = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        decode.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(decode)
