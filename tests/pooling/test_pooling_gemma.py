"""EmbeddingGemma-style embedders (issue 44 item 4): a tiny random folder in google/embeddinggemma-300m's
layout (embedding_models.build_embedding_gemma: bidirectional Gemma 3 with interleaved sliding and full
layers, mean pooling, two Dense projections, Normalize, named prompts) against sentence-transformers on
the same folder, and every real token's hidden state against transformers' Gemma3TextModel."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from embedding_models import (
    GEMMA_CONFIG_WINDOW,
    GEMMA_DOCUMENT_PROMPT,
    GEMMA_QUERY_PROMPT,
    build_embedding_gemma,
)

from server.models.arch import UnsupportedModelError
from server.pooling.model import PoolingModel, load_pooling_model, resolve_task
from server.pooling.pooler import PoolingMode, finish_embedding

# Several longer than the window (transformers reads config.json's 8 as |query - key| < 5), one short
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog while the cat watches from the fence. " * 3,
    "Kubernetes schedules pods onto nodes; the kubelet starts their containers and reports back.",
    "a",
    "Émoji 🚀 and accents: café, naïve, Zürich, and a few more words to pass the window edge.",
]
# fp32 on both sides: what is left is summation order (measured max |diff| ~1e-7 on unit vectors)
ATOL = 2e-5


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return build_embedding_gemma(smollm2_dir, tmp_path_factory.mktemp("embeddinggemma") / "eg")


@pytest.fixture(scope="module")
def ours(gemma_dir: Path) -> PoolingModel:
    return load_pooling_model(gemma_dir)


def _embed(m: PoolingModel, texts: list[str]) -> torch.Tensor:  # -> [len(texts), dim] float32
    enc = m.tokenizer(texts, padding=True, return_tensors="pt")
    out = m.forward(enc["input_ids"], torch.zeros_like(enc["input_ids"]), enc["attention_mask"])
    return finish_embedding(out, m.pooling.normalize, None)


def test_embedding_gemma_matches_sentence_transformers(gemma_dir: Path, ours: PoolingModel) -> None:
    from sentence_transformers import SentenceTransformer

    assert resolve_task(str(gemma_dir), "auto") == "embed"
    assert (ours.pooling.mode, ours.pooling.normalize, ours.max_model_len) == (PoolingMode.MEAN, True, 128)
    assert ours.hidden_size == 48  # the last Dense's out_features: what `dimensions` is checked against
    assert ours.pooling.prompt(None) == GEMMA_QUERY_PROMPT  # default_prompt_name
    st = SentenceTransformer(str(gemma_dir), device="cpu")
    for name, prefix in (("query", GEMMA_QUERY_PROMPT), ("document", GEMMA_DOCUMENT_PROMPT)):
        assert ours.pooling.prompt(name) == prefix
        ref = st.encode(TEXTS, prompt_name=name, convert_to_tensor=True).float()
        got = _embed(ours, [prefix + t for t in TEXTS])
        assert got.shape == ref.shape == (len(TEXTS), 48)
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    # no prompt named: sentence-transformers applies default_prompt_name, as our routes do
    ref = st.encode(TEXTS, convert_to_tensor=True).float()
    torch.testing.assert_close(
        _embed(ours, [ours.pooling.prompt(None) + t for t in TEXTS]), ref, atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("side", ["right", "left"])
def test_bidirectional_hidden_states_match_transformers(
    gemma_dir: Path, ours: PoolingModel, side: str
) -> None:
    """Every real token's last hidden state (TEI's /embed_all) against transformers on the unpadded row:
    bidirectional full layers, bidirectional windows on the sliding ones, padding on either side."""
    from transformers import AutoModel

    hf: Any = AutoModel.from_pretrained(str(gemma_dir), dtype=torch.float32).eval()
    assert hf.config.sliding_window == GEMMA_CONFIG_WINDOW // 2 + 1
    g = torch.Generator().manual_seed(3)
    lengths = [40, 23, 3]
    s = max(lengths)
    ids = torch.zeros(len(lengths), s, dtype=torch.int64)
    mask = torch.zeros(len(lengths), s, dtype=torch.int64)
    for i, n in enumerate(lengths):
        cols = slice(0, n) if side == "right" else slice(s - n, s)
        ids[i, cols] = torch.randint(3, 49152, (n,), generator=g)
        mask[i, cols] = 1
    with torch.no_grad():
        got = ours.module(ids, torch.zeros_like(ids), mask)
        for i in range(len(lengths)):
            real = mask[i].bool()
            ref = hf(ids[i : i + 1, real]).last_hidden_state[0]
            torch.testing.assert_close(got[i, real], ref, atol=1e-4, rtol=1e-4)


def test_bidirectional_model_is_refused_for_generation(gemma_dir: Path, tmp_path: Path) -> None:
    from server.models.loader import load_model

    with pytest.raises(UnsupportedModelError, match="base model without an LM head"):
        load_model(gemma_dir, torch.float32, torch.device("cpu"), 64)
    # the same layers under a causal-LM name: still non-causal, so never a generator
    folder = tmp_path / "causal"
    shutil.copytree(gemma_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["Gemma3ForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="bidirectional"):
        load_model(folder, torch.float32, torch.device("cpu"), 64)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"activation_function": "torch.nn.modules.activation.Softmax"}, "activation"),
        ({"use_residual": True}, "use_residual"),
        ({"in_features": 65}, "in_features"),
    ],
)
def test_dense_modules_we_cannot_run_are_refused(
    gemma_dir: Path, tmp_path: Path, change: dict[str, Any], error: str
) -> None:
    folder = tmp_path / "eg"
    shutil.copytree(gemma_dir, folder)
    path = folder / "2_Dense" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(ValueError, match=error):
        load_pooling_model(folder)


def test_include_prompt_false_is_refused_in_the_named_format(gemma_dir: Path, tmp_path: Path) -> None:
    """sentence-transformers >= 6 writes `pooling_mode` by name; its `include_prompt: false` (pool
    without the prompt's tokens, INSTRUCTOR-style) is refused, not ignored."""
    folder = tmp_path / "eg"
    shutil.copytree(gemma_dir, folder)
    path = folder / "1_Pooling" / "config.json"
    assert json.loads(path.read_text())["pooling_mode"] == "mean"
    path.write_text(json.dumps({**json.loads(path.read_text()), "include_prompt": False}))
    with pytest.raises(ValueError, match="include_prompt"):
        load_pooling_model(folder)


def test_soft_capped_gemma2_embedder_matches_sentence_transformers(tmp_path: Path, smollm2_dir: Path) -> None:
    """A Gemma 2 embedder as BAAI/bge-multilingual-gemma2 is saved (the headless Gemma2Model, last-token
    pooling, Normalize), every layer's attention soft-capped at 2.0 (small enough to bend the scores:
    uncapped, test_pooling_window's parity fails) and windows interleaved: the embedding encoder's
    attention caps as the generation backends do. It refused such models before."""
    from embedding_models import QWEN3_QUERY_PROMPT, build_qwen3_embedding
    from sentence_transformers import SentenceTransformer
    from window_models import build_window_model

    folder = build_qwen3_embedding(
        build_window_model(tmp_path / "gemma2", smollm2_dir, "gemma2"), tmp_path / "gemma2-embed"
    )
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Gemma2Model"]
    assert resolve_task(str(folder), "auto") == "embed"
    m = load_pooling_model(folder)
    assert (m.pooling.mode, m.pooling.normalize) == (PoolingMode.LAST, True)
    texts = [QWEN3_QUERY_PROMPT + t for t in TEXTS]
    ref = SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_tensor=True).float()
    torch.testing.assert_close(_embed(m, texts), ref, atol=ATOL, rtol=0)
