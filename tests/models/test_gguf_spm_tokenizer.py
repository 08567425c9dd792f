"""SentencePiece vocabularies in GGUF files (`tokenizer.ggml.model = llama`: Llama 2, Phi-3, Gemma),
read by our loader as llama.cpp reads them. A SentencePiece BPE model with byte fallback is trained here
(the `sentencepiece` package) and written with gguf-py the way convert_hf_to_gguf.py's
`_set_vocab_sentencepiece` writes it (pieces, scores, token types from the model; the folder's
tokenizer_config.json `added_tokens_decoder` turning its special tokens CONTROL and the others
USER_DEFINED with score -1000; Gemma's converters add `add_space_prefix = false`).

The reference is the SentencePiece model itself, over llama.cpp's split of the text: control and
user-defined tokens are matched whole first (llama-vocab.cpp `tokenizer_st_partition`), each run of
text between them is encoded by SentencePiece (its dummy prefix then stands for llama.cpp's
`add_space_prefix` before each run). Our tokenizer is the one the server loads: the GGUF's metadata
folder (`gguf_metadata_folder`) read by `server.tokenizer.Tokenizer`.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

spm = pytest.importorskip("sentencepiece")
gguf = pytest.importorskip("gguf")

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today?",
    "Once upon a time, in a small village by the sea, there lived an old fisherman.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "The year 2024 had 366 days; 3.14159 is pi.",
    "Café, naïve, résumé, Übermäßig, 東京, Привет мир",
    "  leading spaces and   multiple   spaces\tand tabs\n\nnewlines",
] * 20
CONTROL = ["<start_of_turn>", "<end_of_turn>"]  # special: true in tokenizer_config.json
USER = ["<think>", "</think>"]  # special: false
TEXTS = [
    "Hello world",
    " Hello  world ",
    "  two leading spaces",
    "The year 2024; pi=3.14159",
    "Café 東京 Привет",
    "emoji 🦊 and ☃ and ǅ",  # not in the training text: byte fallback
    "line1\nline2\n\n\tindent",
    "x  y   z",
    "   ",
    "a<think>b</think> c",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    " <end_of_turn> spaced",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# (file name, general.architecture, SentencePiece dummy prefix = the file's add_space_prefix)
FILES = [
    ("llama2", "llama", True),
    ("phi3", "phi3", True),
    ("gemma3", "gemma3", False),
    ("gemma", "gemma", False),
    ("embeddinggemma", "gemma-embedding", False),  # transformers' builder does not know it by name
]


def _train(prefix: bool) -> Any:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=model,
        model_type="bpe",
        vocab_size=600,
        byte_fallback=True,
        character_coverage=0.9995,
        normalization_rule_name="identity",  # Llama 2's and Gemma's: llama.cpp normalizes nothing
        remove_extra_whitespaces=False,
        add_dummy_prefix=prefix,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
        unk_piece="<unk>",
        control_symbols=CONTROL,
        user_defined_symbols=USER,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def _write(sp: Any, arch: str, prefix: bool, path: Path) -> None:
    """convert_hf_to_gguf.py's `_set_vocab_sentencepiece` (+ Gemma's `add_add_space_prefix(False)`),
    with a tiny token embedding and the sizes our config readers need."""
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        kind = 1  # NORMAL
        if sp.IsUnknown(i):
            kind = 2
        elif sp.IsControl(i):
            kind = 3
        elif sp.IsUnused(i):
            kind = 5
        elif sp.IsByte(i):
            kind = 6
        piece = sp.IdToPiece(i)
        if piece in CONTROL + USER:  # tokenizer_config.json's added_tokens_decoder
            kind, score = (3 if piece in CONTROL else 4), -1000.0
        elif arch.startswith("gemma"):
            # Gemma's files: scores that do not follow the merge order (the token order does), which
            # transformers' Gemma builder knows; a tokenizer merging by these scores differs
            score = float((i * 7919) % 613)
        else:
            score = sp.GetScore(i)
        tokens.append(piece.encode())
        scores.append(score)
        types.append(kind)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(4)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_pad_token_id(sp.pad_id())
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    if not prefix:
        w.add_add_space_prefix(False)
    if arch in ("gemma3", "gemma-embedding"):
        w.add_sliding_window(8)  # the converter always writes it
    w.add_tensor("token_embd.weight", np.zeros((sp.vocab_size(), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _reference(sp: Any, text: str) -> list[int]:
    """llama.cpp's SPM tokenization (parse_special): whole control/user-defined tokens, SentencePiece
    between them."""
    whole = CONTROL + USER
    pattern = "(" + "|".join(re.escape(t) for t in sorted(whole, key=len, reverse=True)) + ")"
    ids: list[int] = []
    for part in re.split(pattern, text):
        if part in whole:
            ids.append(sp.PieceToId(part))
        elif part:
            ids.extend(sp.encode(part))
    return ids


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Any, Path]]:
    """name -> (SentencePiece model, our Tokenizer over the metadata folder, the GGUF)."""
    from server.models.loader import gguf_metadata_folder
    from server.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("spm")
    models = {prefix: _train(prefix) for prefix in (True, False)}
    out = {}
    for name, arch, prefix in FILES:
        path = root / f"{name}.gguf"
        _write(models[prefix], arch, prefix, path)
        out[name] = (models[prefix], Tokenizer(gguf_metadata_folder(path, root / "cache")), path)
    return out


@pytest.mark.parametrize("name", [f[0] for f in FILES])
def test_encode_decode_equal_sentencepiece(served: dict[str, tuple[Any, Any, Path]], name: str) -> None:
    sp, tok, _ = served[name]
    for text in TEXTS:
        want = _reference(sp, text)
        assert tok.encode(text, add_special_tokens=False) == want, (name, text)
        assert tok.encode(text) == [sp.bos_id(), *want], (name, text)  # add_bos_token
        # SentencePiece skips control tokens; user-defined ones are text
        assert tok.decode(want) == sp.decode(want), (name, text)
        if not any(c in text for c in CONTROL + USER):  # after those, the prefix is a space more
            assert tok.decode(want) == text, (name, text)
    assert any(sp.IsByte(i) for i in _reference(sp, TEXTS[5]))  # the byte fallback was exercised


@pytest.mark.parametrize(("name", "prefix"), [(f[0], f[2]) for f in FILES])
def test_token_bytes_join_to_text(served: dict[str, tuple[Any, Any, Path]], name: str, prefix: bool) -> None:
    sp, tok, _ = served[name]
    for text in TEXTS:
        if not any(c in text for c in CONTROL + USER):
            joined = b"".join(tok.token_bytes(i) for i in _reference(sp, text)).decode()
            assert joined == (" " if prefix else "") + text, (name, text)  # the prefix is a space too


@pytest.mark.parametrize("name", [f[0] for f in FILES])
def test_chat_template(served: dict[str, tuple[Any, Any, Path]], name: str) -> None:
    sp, tok, _ = served[name]
    messages = [{"role": "user", "content": "Hello  world"}, {"role": "model", "content": " 2024 🦊"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    text = (
        "<start_of_turn>user\nHello  world<end_of_turn>\n<start_of_turn>model\n 2024 🦊<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    assert ids == [sp.bos_id(), *_reference(sp, text)]


@pytest.mark.parametrize("name", [f[0] for f in FILES])
def test_transformers_gguf_loader_agrees_where_it_prepends(
    served: dict[str, tuple[Any, Any, Path]], name: str
) -> None:
    """transformers' own GGUF tokenizer agrees on text that does not start with a space and has no
    special tokens; otherwise its Metaspace pre-tokenizer drops the prefix SentencePiece and llama.cpp
    put before such text (our reason to correct it)."""
    from transformers import PreTrainedTokenizerFast

    _, tok, path = served[name]
    if name == "embeddinggemma":
        pytest.skip("transformers builds gemma-embedding's vocabulary by its scores: wrong for Gemma's")
    theirs = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TEXTS:
        if not text[:1].isspace() and not any(c in text for c in CONTROL + USER):
            assert theirs.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)


# SentencePiece unigram models, written as convert_hf_to_gguf.py's T5Model writes them
# (`tokenizer.ggml.model = t5`, the normalizer spec's add_dummy_prefix / remove_extra_whitespaces /
# precompiled_charsmap): one with byte fallback and the identity rule, one as T5's (NFKC, extra
# whitespace removed, no byte pieces: unknown characters are <unk>)
UNIGRAM = {"bytes": ("identity", False, True), "t5": ("nmt_nfkc", True, False)}
NFKC_TEXTS = ["ﬁne ＡＢＣ ① x²", "  two   spaces  ", "tab\tand\nnewline"]


def _unigram_gguf(kind: str, path: Path) -> Any:
    from sentencepiece import sentencepiece_model_pb2

    rule, remove, byte_fallback = UNIGRAM[kind]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=model,
        model_type="unigram",
        vocab_size=350 if byte_fallback else 100,
        byte_fallback=byte_fallback,
        character_coverage=0.9995,
        normalization_rule_name=rule,
        remove_extra_whitespaces=remove,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model.getvalue())
    types = [
        2 if sp.IsUnknown(i) else 3 if sp.IsControl(i) else 5 if sp.IsUnused(i) else 6 if sp.IsByte(i) else 1
        for i in range(sp.vocab_size())
    ]
    w = gguf.GGUFWriter(str(path), "t5")
    w.add_tokenizer_model("t5")
    w.add_tokenizer_pre("default")
    w.add_token_list([sp.IdToPiece(i).encode() for i in range(sp.vocab_size())])
    w.add_token_scores([sp.GetScore(i) for i in range(sp.vocab_size())])
    w.add_token_types(types)
    w.add_add_space_prefix(proto.normalizer_spec.add_dummy_prefix)
    w.add_remove_extra_whitespaces(proto.normalizer_spec.remove_extra_whitespaces)
    w.add_precompiled_charsmap(proto.normalizer_spec.precompiled_charsmap)
    w.add_pad_token_id(0)
    w.add_eos_token_id(1)
    w.add_unk_token_id(2)
    w.add_add_bos_token(False)
    w.add_add_eos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sp


@pytest.mark.parametrize("kind", list(UNIGRAM))
def test_unigram_vocabulary_equal_sentencepiece(tmp_path: Path, kind: str) -> None:
    from server.models.loader import gguf_tokenizer
    from server.tokenizer import Tokenizer

    sp = _unigram_gguf(kind, tmp_path / f"{kind}.gguf")
    gguf_tokenizer(tmp_path / f"{kind}.gguf").save_pretrained(str(tmp_path / "folder"))
    tok = Tokenizer(tmp_path / "folder")  # as the server loads it: the saved folder
    for text in [t for t in TEXTS if not any(c in t for c in CONTROL + USER)] + NFKC_TEXTS:
        want = sp.encode(text)
        assert tok.encode(text, add_special_tokens=False) == want, (kind, text)
        assert tok.encode(text) == [*want, sp.eos_id()], (kind, text)  # add_eos_token
        if sp.unk_id() not in want:  # SentencePiece writes <unk> as " ⁇ "; ours skips it as special
            assert tok.decode(want) == sp.decode(want), (kind, text)
    if UNIGRAM[kind][2]:
        assert any(sp.IsByte(i) for i in sp.encode(TEXTS[5]))
