"""An EmbeddingGemma-style folder served over HTTP (one server for the module): OpenAI /v1/embeddings
applies the folder's default_prompt_name and refuses a `prompt_name` (neither OpenAI nor vLLM has one),
TEI /embed takes `prompt_name`, truncation on both routes; every vector against sentence-transformers'
encode on the same folder (embedding_models.build_embedding_gemma)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from embedding_models import build_embedding_gemma
from test_api_embeddings import _serve

TEXTS = [
    "Hello world",
    "Kubernetes runs containers in pods on nodes it schedules.",
    "The cat sat on the mat.",
]
LONG = "a sentence about pods and nodes and the scheduler that places them, " * 20  # > 128 tokens
ATOL = 2e-5  # fp32 both sides: --dtype float32 (auto multiplies in bf16 where native), tests/pooling/test_pooling_gemma.py


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return build_embedding_gemma(smollm2_dir, tmp_path_factory.mktemp("embeddinggemma-api") / "eg")


@pytest.fixture(scope="module")
def server(gemma_dir: Path) -> Iterator[tuple[str, Any]]:
    yield from _serve(gemma_dir, "embeddinggemma", dtype="float32")


@pytest.fixture(scope="module")
def st(gemma_dir: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gemma_dir), device="cpu")


def _close(got: Any, ref: Any) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.as_tensor(ref).float(), atol=ATOL, rtol=0)


def test_openai_embeddings_use_the_default_prompt(server: tuple[str, Any], st: Any) -> None:
    import openai

    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    resp = client.embeddings.create(model="embeddinggemma", input=TEXTS)
    _close([d.embedding for d in resp.data], st.encode(TEXTS))  # default_prompt_name "query"
    assert len(resp.data[0].embedding) == 48  # after the Dense stack
    # vLLM's /pooling `embed`: the same vectors as /v1/embeddings, default prompt included
    r = httpx.post(f"{url}/pooling", json={"input": TEXTS, "task": "embed"}, timeout=60)
    assert r.status_code == 200, r.text
    _close([d["data"] for d in r.json()["data"]], st.encode(TEXTS))
    r = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS, "prompt_name": "document"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt_name" and "/embed" in err["message"], err
    # truncate_prompt_tokens: the prompt and the text's start, as sentence-transformers' max_seq_length cuts
    r = httpx.post(f"{url}/v1/embeddings", json={"input": LONG}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    r = httpx.post(f"{url}/v1/embeddings", json={"input": LONG, "truncate_prompt_tokens": 40}, timeout=60)
    assert r.status_code == 200, r.text
    st.max_seq_length = 40
    try:
        ref = st.encode([LONG])
    finally:
        st.max_seq_length = 128
    _close([r.json()["data"][0]["embedding"]], ref)


def test_tei_embed_prompt_names_and_truncate(server: tuple[str, Any], st: Any) -> None:
    url, _ = server
    for name in ("document", "query"):
        r = httpx.post(f"{url}/embed", json={"inputs": TEXTS, "prompt_name": name}, timeout=60)
        assert r.status_code == 200, r.text
        _close(r.json(), st.encode(TEXTS, prompt_name=name))
    r = httpx.post(f"{url}/embed", json={"inputs": TEXTS[0], "prompt_name": "passage"}, timeout=60)
    assert r.status_code == 422 and r.json()["error_type"] == "validation", r.text
    assert "'passage'" in r.json()["error"] and "document, query" in r.json()["error"]
    r = httpx.post(f"{url}/embed", json={"inputs": [LONG], "truncate": True}, timeout=60)
    assert r.status_code == 200, r.text
    _close(r.json(), st.encode([LONG]))  # both cut at the folder's max_seq_length, 128
