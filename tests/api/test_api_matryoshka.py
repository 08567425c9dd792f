"""Matryoshka `dimensions` over HTTP (OpenAI /v1/embeddings, TEI /embed, vLLM /pooling): a model whose
config.json declares `matryoshka_dimensions` (or `is_matryoshka`, as vLLM's ModelConfig reads them)
returns the first `dimensions` values of its embedding, normalized again (vLLM's order); a size it does
not list, or any size on a model that declares neither key, is a 4xx naming the field. References are
computed here from sentence-transformers' full vectors on the same folder."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from test_api_embeddings import _serve

TEXTS = ["Hello world", "Kubernetes runs containers in pods on nodes it schedules."]
ATOL = 2e-5  # fp32 both sides (test_api_embeddings.py's Qwen3-Embedding parity)


def _with_config(src: Path, dst: Path, **keys: Any) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **keys}))
    return dst


@pytest.fixture(scope="module")
def listed_dir(qwen3_embed_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _with_config(qwen3_embed_dir, tmp_path_factory.mktemp("mrl") / "m", matryoshka_dimensions=[8, 16])


@pytest.fixture(scope="module")
def listed(listed_dir: Path) -> Iterator[tuple[str, Any]]:
    yield from _serve(listed_dir, "mrl", dtype="float32")


@pytest.fixture(scope="module")
def reference(qwen3_embed_dir: Path) -> np.ndarray:  # [len(TEXTS), hidden] unit rows
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(qwen3_embed_dir), device="cpu").encode(TEXTS)


def _truncated(ref: np.ndarray, d: int) -> np.ndarray:  # [n, d]: first d values, unit length again
    cut = ref[:, :d]
    return cut / np.linalg.norm(cut, axis=1, keepdims=True)


def _close(got: Any, ref: np.ndarray) -> None:
    torch.testing.assert_close(torch.tensor(got).float(), torch.as_tensor(ref).float(), atol=ATOL, rtol=0)


def test_listed_dimensions_truncate_then_normalize(listed: tuple[str, Any], reference: np.ndarray) -> None:
    import openai

    url, _ = listed
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    for d in (8, 16):
        resp = client.embeddings.create(model="mrl", input=TEXTS, dimensions=d)
        _close([e.embedding for e in resp.data], _truncated(reference, d))
    full = client.embeddings.create(model="mrl", input=TEXTS)  # unset: the whole vector
    _close([e.embedding for e in full.data], reference)
    r = httpx.post(f"{url}/embed", json={"inputs": TEXTS, "dimensions": 8}, timeout=60)  # TEI
    assert r.status_code == 200, r.text
    _close(r.json(), _truncated(reference, 8))
    # TEI's normalize false: the pooled vector's first 8 values, never normalized
    r = httpx.post(f"{url}/embed", json={"inputs": TEXTS, "dimensions": 8, "normalize": False}, timeout=60)
    assert r.status_code == 200, r.text
    raw = np.asarray(r.json())
    assert raw.shape == (len(TEXTS), 8) and np.abs(np.linalg.norm(raw, axis=1) - 1).min() > 1e-2
    _close(_truncated(raw, 8), _truncated(reference, 8))
    r = httpx.post(f"{url}/pooling", json={"input": TEXTS, "task": "embed", "dimensions": 16}, timeout=60)
    assert r.status_code == 200, r.text
    _close([d["data"] for d in r.json()["data"]], _truncated(reference, 16))


@pytest.mark.parametrize("route", ["/v1/embeddings", "/embed", "/pooling"])
def test_unlisted_dimensions_are_refused_by_name(listed: tuple[str, Any], route: str) -> None:
    url, _ = listed
    key = "inputs" if route == "/embed" else "input"
    extra = {"task": "embed"} if route == "/pooling" else {}
    for d in (12, 0, -1, 10_000):
        r = httpx.post(f"{url}{route}", json={key: TEXTS[0], "dimensions": d, **extra}, timeout=60)
        assert r.status_code in (400, 422), (d, r.text)
        assert "dimensions" in r.text and "[8, 16]" in r.text, r.text


def test_is_matryoshka_takes_any_size_up_to_the_width(
    qwen3_embed_dir: Path, tmp_path: Path, reference: np.ndarray
) -> None:
    folder = _with_config(qwen3_embed_dir, tmp_path / "m", is_matryoshka=True)
    hidden = reference.shape[1]
    for url, _ in _serve(folder, "mrl-any", dtype="float32"):
        r = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS, "dimensions": 5}, timeout=60)
        assert r.status_code == 200, r.text
        _close([e["embedding"] for e in r.json()["data"]], _truncated(reference, 5))
        r = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS, "dimensions": hidden}, timeout=60)
        _close([e["embedding"] for e in r.json()["data"]], reference)
        r = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS, "dimensions": hidden + 1}, timeout=60)
        assert r.status_code == 400 and "dimensions" in r.text, r.text
        assert f"1..{hidden}" in r.text


def test_a_model_without_matryoshka_refuses_dimensions(qwen3_embed_dir: Path) -> None:
    for url, _ in _serve(qwen3_embed_dir, "plain", dtype="float32"):
        for route, key in (("/v1/embeddings", "input"), ("/embed", "inputs")):
            r = httpx.post(f"{url}{route}", json={key: TEXTS[0], "dimensions": 8}, timeout=60)
            assert r.status_code in (400, 422), r.text
            assert "dimensions" in r.text and "Matryoshka" in r.text, r.text
