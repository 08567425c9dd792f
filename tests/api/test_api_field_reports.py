"""Field reports, round 3 (issue 50) and the pooling routes' body parser (issue 45 item 3): what real
clients sent that today's main read wrongly, held over real HTTP on an embedding server (MiniLM), a
score server (a tiny random cross-encoder) and the shared generative live server.

- every POST route reads its body through the one hardened parser (json_body.py): the test walks the
  app's routes, so a new route cannot skip it;
- a null for an optional field is the field left out, on every request model of every route;
- TEI's `/predict` reads `["q", "d"]` as one pair, `[["q", "d"], ...]` as a batch of pairs;
- TEI's `POST /` and `/invocations` route by the served task; huggingface_hub's InferenceClient works;
- `/tokenize` and `/detokenize` serve on pooling servers.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import SERVED_NAME
from fastapi.routing import APIRoute
from pydantic import BaseModel
from test_api_embeddings import _serve, cross_encoder_dir, minilm_dir  # noqa: F401 (fixtures)
from test_api_hostile import KeepAlive


@pytest.fixture(scope="module")
def embed_url(minilm_dir: Path) -> Iterator[tuple[str, Any]]:  # noqa: F811
    yield from _serve(minilm_dir, "minilm")


@pytest.fixture(scope="module")
def score_url(cross_encoder_dir: Path) -> Iterator[tuple[str, Any]]:  # noqa: F811
    yield from _serve(cross_encoder_dir, "tiny-reranker")


# ---- issue 45 item 3: one parser for every body ------------------------------------------------------
_HOSTILE = {
    "deep": b"[" * 100_000 + b"]" * 100_000,
    "deep-in-object": b'{"input": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "surrogate": b'{"input": "a \\ud800 b", "inputs": "a \\ud800 b", "query": "\\udfff", "texts": ["x"]}',
    "surrogate-key": b'{"\\udfff": 1}',
    "huge-int": b'{"input": [' + b"1" * 10_000 + b"]}",
}
# Routes that read no body: what they are sent does not matter (vLLM's and SGLang's cache flushes).
_BODYLESS = frozenset({"/flush_cache", "/reset_prefix_cache"})


def _post_routes(state: Any) -> list[str]:
    from server.api.app import create_app

    app = create_app(state, load_on_startup=False)  # the same routes as the served app; never started
    found: set[str] = set()
    todo = list(app.routes)
    while todo:  # included routers nest (FastAPI keeps them as routes holding `original_router`)
        route = todo.pop()
        if isinstance(route, APIRoute):
            if "POST" in (route.methods or ()) and "{" not in route.path:
                found.add(route.path)
        elif hasattr(route, "original_router"):
            todo.extend(route.original_router.routes)
    return sorted(found)


@pytest.mark.parametrize("server", ["embed_url", "score_url"])
def test_every_post_route_parses_hostile_json_as_4xx(server: str, request: pytest.FixtureRequest) -> None:
    url, state = request.getfixturevalue(server)
    routes = _post_routes(state)
    assert {"/v1/embeddings", "/embed", "/rerank", "/score", "/predict", "/classify", "/generate"} <= set(
        routes
    )
    conn = KeepAlive(int(url.rsplit(":", 1)[1]))
    try:
        for path in routes:
            for what, raw in _HOSTILE.items():
                status, headers, body = conn.post(path, raw)
                if path in _BODYLESS:
                    assert status < 500, (path, what, status)
                    continue
                assert status in (400, 422), (path, what, status, body[:300])
                err = json.loads(body)
                assert err["error_type" if status == 422 else "error"], (path, what)
                assert headers.get("connection") != "close", (path, what)
    finally:
        conn.close()


def test_no_route_reads_the_body_around_the_parser() -> None:
    """`request.json()` / `request.body()` skip json_body.py's limits: no route module calls them."""
    import server.api as api_pkg

    folder = Path(api_pkg.__file__).parent
    offenders = [
        p.name
        for p in folder.glob("*.py")
        if any(s in p.read_text() for s in ("await request.json()", "await request.body()"))
    ]
    assert offenders == []


# ---- item 7: null is unset ---------------------------------------------------------------------------
# A minimal valid body of every request model; a model missing here fails the test (add its row).
_MINIMAL: dict[str, dict[str, Any]] = {
    "TGIParameters": {},
    "TGIRequest": {"inputs": "x"},
    "TGITokenizeRequest": {"inputs": "x"},
    "StreamOptions": {},
    "SamplingFields": {},
    "CompletionRequest": {"prompt": "x"},
    "ChatMessage": {"role": "user"},
    "ChatCompletionRequest": {"messages": [{"role": "user", "content": "x"}]},
    "TokenizeCompletionRequest": {"prompt": "x"},
    "TokenizeChatRequest": {"messages": [{"role": "user", "content": "x"}]},
    "DetokenizeRequest": {"tokens": [1]},
    "EmbeddingRequest": {"input": "x"},
    "TEIEmbedRequest": {"inputs": "x"},
    "ScoreRequest": {"text_1": "a", "text_2": "b"},  # or queries/documents
    "RerankRequest": {"query": "q", "documents": ["d"]},
    "TEIRerankRequest": {"query": "q", "texts": ["d"]},
    "ClassifyRequest": {"input": "x"},
    "TEIPredictRequest": {"inputs": "x"},
    "TEIEmbedAllRequest": {"inputs": "x"},
    "PoolingRequest": {"input": "x"},
    "TEIDecodeRequest": {"ids": [1]},
    "TEISimilarityInput": {"source_sentence": "a", "sentences": ["b"]},
    "TEISimilarityParameters": {},
    "TEISimilarityRequest": {"inputs": {"source_sentence": "a", "sentences": ["b"]}},
}


def _request_models() -> list[type[BaseModel]]:
    """Every pydantic model the route modules declare (request bodies and their nested parts)."""
    import server.api.embeddings
    import server.api.protocol

    return [
        cls
        for module in (server.api.protocol, server.api.embeddings)
        for cls in vars(module).values()
        if inspect.isclass(cls) and issubclass(cls, BaseModel) and cls.__module__ == module.__name__
    ]


def _admits_none(annotation: Any) -> bool:
    import types
    import typing

    if annotation is Any or annotation is type(None):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_admits_none(a) for a in typing.get_args(annotation))
    return False


def test_null_for_every_optional_field_is_the_field_left_out() -> None:
    """OpenAI, vLLM and TGI read `"field": null` as unset (text_generation.Client.chat sends `"n":
    null`, `"logprobs": null`; the openai client can send any optional field as null)."""
    models = _request_models()
    names = {m.__name__ for m in models}
    assert {"ChatCompletionRequest", "TEIPredictRequest", "RerankRequest"} <= names
    checked = 0
    for model in models:
        if model.__name__ in ("NullIsUnset", "RequestModel", "_Lenient", "_Body"):
            continue
        assert model.__name__ in _MINIMAL, f"add a minimal body of {model.__name__} to _MINIMAL"
        base = _MINIMAL[model.__name__]
        default = model.model_validate(base)
        for name, field in model.model_fields.items():
            if field.is_required():
                continue
            got = model.model_validate({**base, name: None})
            if not _admits_none(field.annotation):  # else null is one of the field's own values
                assert getattr(got, name) == getattr(default, name), (model.__name__, name)
            checked += 1
    assert checked > 80, checked


def test_text_generation_chat_and_nulls_over_http(live_server: Any) -> None:
    from text_generation import Client

    url = live_server.url
    out = Client(url, timeout=120).chat(
        messages=[{"role": "user", "content": "Say hi"}], max_tokens=3, temperature=None
    )
    assert out.choices[0].message.content and out.model == SERVED_NAME
    chat = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for extra in ({"n": None}, {"logprobs": None, "top_logprobs": None}, {"stream_options": None}):
        r = httpx.post(f"{url}/v1/chat/completions", json={**chat, **extra}, timeout=120)
        assert r.status_code == 200, (extra, r.text)
    comp = {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 2}
    for extra in ({"echo": None}, {"n": None, "ignore_eos": None, "min_tokens": None}):
        r = httpx.post(f"{url}/v1/completions", json={**comp, **extra}, timeout=120)
        assert r.status_code == 200, (extra, r.text)
    r = httpx.post(
        f"{url}/generate",
        json={"inputs": "hi", "parameters": {"max_new_tokens": 2, "details": None, "do_sample": None}},
        timeout=120,
    )
    assert r.status_code == 200, r.text


# ---- item 2: /tokenize and /detokenize on pooling servers -----------------------------------------------
@pytest.mark.parametrize("server", ["embed_url", "score_url"])
def test_tokenize_routes_serve_on_pooling_servers(server: str, request: pytest.FixtureRequest) -> None:
    from transformers import AutoTokenizer

    url, state = request.getfixturevalue(server)
    assert httpx.get(f"{url}/ready", timeout=10).status_code == 200
    ref = AutoTokenizer.from_pretrained(state.config.engine.model.model)
    text = "Kubernetes runs containers."
    ids = ref(text)["input_ids"]
    r = httpx.post(f"{url}/tokenize", json={"inputs": text}, timeout=30)
    assert r.status_code == 200, r.text
    assert [t["id"] for t in r.json()] == ids
    r = httpx.post(f"{url}/tokenize", json={"prompt": text, "model": state.model_name}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == ids and r.json()["count"] == len(ids)
    r = httpx.post(f"{url}/detokenize", json={"tokens": ids[1:-1]}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["prompt"] == ref.decode(ids[1:-1])
    r = httpx.post(f"{url}/detokenize", json={"tokens": [1], "model": "no-such-model"}, timeout=30)
    assert r.status_code == 404
    for path in ("/flush_cache", "/reset_prefix_cache"):  # nothing cached: done, not a 503 for ever
        assert httpx.post(f"{url}{path}", timeout=30).status_code == 200


# ---- item 4: TGI's placeholder model names ---------------------------------------------------------------
def test_tgi_placeholder_model_names_and_unknown_names(live_server: Any, embed_url: tuple[str, Any]) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for name in ("tgi", "dummy", SERVED_NAME):
        r = httpx.post(f"{live_server.url}/v1/chat/completions", json={**chat, "model": name}, timeout=120)
        assert r.status_code == 200, (name, r.text)
        assert r.json()["model"] == SERVED_NAME
    r = httpx.post(f"{live_server.url}/v1/chat/completions", json={**chat, "model": "gpt-4o"}, timeout=120)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    url, _ = embed_url
    assert (
        httpx.post(f"{url}/v1/embeddings", json={"input": "hi", "model": "tgi"}, timeout=60).status_code
        == 200
    )
    assert (
        httpx.post(f"{url}/v1/embeddings", json={"input": "hi", "model": "gpt-4o"}, timeout=60).status_code
        == 404
    )


# ---- item 3: TEI's /predict reads a pair as one pair ------------------------------------------------------
def test_tei_predict_reads_pairs_as_tei(score_url: tuple[str, Any]) -> None:
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    url, state = score_url
    folder = state.config.engine.model.model
    hf = BertForSequenceClassification.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)

    def logit(*texts: str) -> float:
        with torch.no_grad():
            return float(hf(**tok(*texts, return_tensors="pt")).logits[0, 0])

    def post(inputs: Any) -> Any:
        r = httpx.post(f"{url}/predict", json={"inputs": inputs, "raw_scores": True}, timeout=60)
        assert r.status_code == 200, (inputs, r.text)
        return r.json()

    one = post(["what runs containers?", "Kubernetes runs pods."])  # ONE pair: one list of predictions
    assert isinstance(one[0], dict)
    assert one[0]["score"] == pytest.approx(logit("what runs containers?", "Kubernetes runs pods."), abs=1e-4)
    batch = post([["q one", "doc one"], ["q two", "doc two"]])
    assert [b[0]["score"] for b in batch] == pytest.approx(
        [logit("q one", "doc one"), logit("q two", "doc two")], abs=1e-4
    )
    singles = post(["a", "b", "c"])  # not a pair: a batch of three texts
    assert [s[0]["score"] for s in singles] == pytest.approx([logit("a"), logit("b"), logit("c")], abs=1e-4)
    mixed = post([["q", "d"], "alone"])
    assert [s[0]["score"] for s in mixed] == pytest.approx([logit("q", "d"), logit("alone")], abs=1e-4)
    r = httpx.post(f"{url}/predict", json={"inputs": [["a", "b", "c"]]}, timeout=60)
    assert r.status_code == 422 and "inputs" in r.json()["error"]


# ---- item 1: TEI's POST / and /invocations by the served task; huggingface_hub's InferenceClient ----------
def test_tei_root_routes_by_task_and_inference_client(
    embed_url: tuple[str, Any], score_url: tuple[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants
    import numpy as np
    from huggingface_hub import InferenceClient
    from sentence_transformers import SentenceTransformer

    # The tests run with HF_HUB_OFFLINE=1, which also blocks the client's calls to this local server.
    monkeypatch.setattr(huggingface_hub.constants, "is_offline_mode", lambda: False)

    url, state = embed_url
    st = SentenceTransformer(state.config.engine.model.model, device="cpu")
    client = InferenceClient(base_url=url)
    got = client.feature_extraction("Hello world")
    ref = st.encode(["Hello world"], normalize_embeddings=True)
    assert got.shape == (1, 384) and float(np.dot(got[0], ref[0])) > 0.9999
    for path in ("/", "/invocations"):
        r = httpx.post(f"{url}{path}", json={"inputs": ["Hello world", "hi"]}, timeout=60)
        assert r.status_code == 200, (path, r.text)
        assert len(r.json()) == 2 and len(r.json()[0]) == 384
    sims = client.sentence_similarity("Hello world", ["Hello world", "The cat sat on the mat."])
    e = st.encode(["Hello world", "Hello world", "The cat sat on the mat."], normalize_embeddings=True)
    # bf16 GEMMs under --dtype auto (vectors within cosine 0.9999 of the reference's): 2e-3 on a cosine
    assert sims == pytest.approx([float(e[0] @ e[1]), float(e[0] @ e[2])], abs=2e-3)
    r = httpx.post(
        f"{url}/similarity", json={"inputs": {"source_sentence": "a", "sentences": ["a"]}}, timeout=60
    )
    assert r.status_code == 200 and r.json() == pytest.approx([1.0], abs=1e-3)

    surl, _ = score_url
    tei = {"query": "what runs containers?", "texts": ["Kubernetes runs pods.", "bread"]}
    want = httpx.post(f"{surl}/rerank", json=tei, timeout=60).json()
    for path in ("/", "/invocations"):
        r = httpx.post(f"{surl}{path}", json=tei, timeout=60)
        assert r.status_code == 200, (path, r.text)
        assert r.json() == want


# ---- items 5 and 6: response_format is closed; TGI's grammar shapes on the Messages API -------------------
_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "enum": [7]}},
    "required": ["answer"],
    "additionalProperties": False,
}


def _chat(url: str, response_format: Any, stream: bool = False) -> httpx.Response:
    body = {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": "Reply."}],
        "max_tokens": 24,
        "response_format": response_format,
        "stream": stream,
    }
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def _text(r: httpx.Response, stream: bool) -> str:
    assert r.status_code == 200, r.text
    if not stream:
        return str(r.json()["choices"][0]["message"]["content"])
    parts = []
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                parts.append(c["delta"].get("content") or "")
    return "".join(parts)


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_schema_shapes_are_constrained(live_server: Any, stream: bool) -> None:
    """huggingface_hub sends a json_schema as {"type": "json_object", "value": SCHEMA}; TGI's grammar
    shapes (json, regex, json_schema with value) are served by the structured-output engine."""
    url = live_server.url
    for fmt in (
        {"type": "json_object", "value": _SCHEMA},
        {"type": "json", "value": _SCHEMA},
        {"type": "json_schema", "value": {"name": "a", "schema": _SCHEMA}},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": _SCHEMA, "strict": True}},
    ):
        assert json.loads(_text(_chat(url, fmt, stream), stream)) == {"answer": 7}, fmt
    text = _text(_chat(url, {"type": "regex", "value": "(yes|no)!"}, stream), stream)
    assert text in ("yes!", "no!"), text


def test_response_format_unknown_keys_refused_by_name(live_server: Any) -> None:
    url = live_server.url
    for fmt, name in (
        ({"type": "json_object", "schema": _SCHEMA}, "response_format.schema"),
        ({"type": "text", "value": "x"}, "response_format.value"),
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": _SCHEMA, "x": 1}},
            "response_format.json_schema.x",
        ),
    ):
        r = _chat(url, fmt)
        assert r.status_code == 400, (fmt, r.text)
        assert name in r.json()["error"]["message"] and r.json()["error"]["param"] == name, r.text
    assert _chat(url, {"type": "json_object", "value": None}).status_code == 200  # null asks for nothing


def test_huggingface_hub_chat_completion_json_schema(
    live_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants
    from huggingface_hub import InferenceClient

    monkeypatch.setattr(huggingface_hub.constants, "is_offline_mode", lambda: False)
    client = InferenceClient(base_url=live_server.url)
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "a", "schema": _SCHEMA}}
    out = client.chat_completion(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": "Reply."}],
        max_tokens=24,
        response_format=fmt,
    )
    assert json.loads(out.choices[0].message.content or "") == {"answer": 7}


# ---- item 8: TEI's /rerank honours top_n -------------------------------------------------------------------
def test_tei_rerank_top_n(score_url: tuple[str, Any]) -> None:
    url, _ = score_url
    body = {"query": "what runs containers?", "texts": ["Kubernetes runs pods.", "bread", "cats", "hi"]}
    full = httpx.post(f"{url}/rerank", json=body, timeout=60).json()
    r = httpx.post(f"{url}/rerank", json={**body, "top_n": 2}, timeout=60)
    assert r.status_code == 200, r.text
    assert _same_ranking(r.json(), full[:2], "score")
    r = httpx.post(f"{url}/rerank", json={**body, "top_n": 0}, timeout=60)
    assert r.status_code == 422 and "top_n" in r.json()["error"]
    # vLLM's body: top_n 0 is vLLM's default, every document (was a 400)
    vbody = {"query": body["query"], "documents": body["texts"]}
    every = httpx.post(f"{url}/v1/rerank", json=vbody, timeout=60).json()["results"]
    r = httpx.post(f"{url}/v1/rerank", json={**vbody, "top_n": 0}, timeout=60)
    assert r.status_code == 200 and _same_ranking(r.json()["results"], every) and len(every) == 4
    r = httpx.post(f"{url}/v1/rerank", json={**vbody, "top_n": 1}, timeout=60)
    assert _same_ranking(r.json()["results"], every[:1])


def _same_ranking(
    got: list[dict[str, Any]], want: list[dict[str, Any]], key: str = "relevance_score"
) -> bool:
    """The same documents in the same order with the same scores up to fp32 summation order: the pooling
    engine picks each step's thread count by measurement (core/step_threads.py), and oneDNN's sums differ
    in their last bits between counts, so two identical requests need not be bit-equal."""
    strip = [{k: v for k, v in d.items() if k != key} for d in got]
    return strip == [{k: v for k, v in d.items() if k != key} for d in want] and all(
        abs(g[key] - w[key]) <= 1e-5 for g, w in zip(got, want, strict=True)
    )


# ---- item 9: GET /v1/models/{id} (the openai client's models.retrieve) -------------------------------------
def test_models_retrieve(live_server: Any, embed_url: tuple[str, Any]) -> None:
    import openai

    for url, name in ((live_server.url, SERVED_NAME), (embed_url[0], "minilm")):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        card = client.models.retrieve(name)
        assert card.id == name and card.object == "model"
        assert card.model_dump() == next(m.model_dump() for m in client.models.list().data if m.id == name)
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("no-such-model")


# ---- item 9: vLLM's newer /score names -----------------------------------------------------------------------
def test_score_queries_documents(score_url: tuple[str, Any]) -> None:
    url, _ = score_url
    docs = ["Kubernetes runs pods.", "bread"]
    old = httpx.post(f"{url}/score", json={"text_1": "what runs containers?", "text_2": docs}, timeout=60)
    new = httpx.post(
        f"{url}/v1/score", json={"queries": "what runs containers?", "documents": docs}, timeout=60
    )
    assert old.status_code == new.status_code == 200, new.text
    assert [d["score"] for d in new.json()["data"]] == [d["score"] for d in old.json()["data"]]
    both = {"text_1": "q", "text_2": docs, "queries": "q", "documents": docs}
    r = httpx.post(f"{url}/v1/score", json=both, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "queries"
    r = httpx.post(f"{url}/v1/score", json={"queries": "q"}, timeout=60)
    assert r.status_code == 400
    for path, body in (("/score", {"queries": "q"}), ("/classify", {"input": []})):
        r = httpx.post(f"{url}{path}", json=body, timeout=60)  # vLLM's routes: vLLM's (OpenAI's) error shape
        assert r.status_code == 400 and isinstance(r.json()["error"], dict), (path, r.text)


# ---- item 9: vllm:iteration_tokens_total counts each engine step's tokens ---------------------------------
def _series(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(name)


def test_iteration_tokens_histogram(live_server: Any) -> None:
    """One greedy request of P uncached prompt tokens and G new tokens runs G steps (the prefill
    samples the first token) of P + G - 1 tokens in all: the histogram's count and sum say so."""
    url = live_server.url
    names = (
        "vllm:iteration_tokens_total_count",
        "vllm:iteration_tokens_total_sum",
        'vllm:iteration_tokens_total_bucket{le="1.0",model_name="' + SERVED_NAME + '"}',
        "vllm:prompt_tokens_total",
    )
    before = [_series(url, n) for n in names]
    r = httpx.post(
        f"{url}/generate",
        json={"inputs": "Iteration histogram 7f3a: count the steps.", "parameters": {"max_new_tokens": 5}},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    steps, tokens, ones, prompt = (_series(url, n) - b for n, b in zip(names, before, strict=True))
    assert prompt > 5 and steps == 5 and ones == 4  # four one-token decode steps
    assert tokens == prompt + 5 - 1


# ---- item 9: TEI /embed_all and /decode, vLLM /pooling ------------------------------------------------------
def test_tei_embed_all_decode_and_vllm_pooling(
    embed_url: tuple[str, Any], score_url: tuple[str, Any]
) -> None:
    import torch
    from sentence_transformers import SentenceTransformer

    url, state = embed_url
    texts = ["Hello world", "Kubernetes runs containers in pods."]
    st = SentenceTransformer(state.config.engine.model.model, device="cpu")
    refs = st.encode(texts, output_value="token_embeddings", convert_to_numpy=False)  # every token's state
    r = httpx.post(f"{url}/embed_all", json={"inputs": texts}, timeout=60)
    assert r.status_code == 200, r.text
    got = [torch.tensor(rows) for rows in r.json()]

    def close(a: torch.Tensor, b: torch.Tensor) -> None:  # bf16 GEMMs under --dtype auto: cosine per token
        assert a.shape == b.shape
        assert float(torch.nn.functional.cosine_similarity(a, b.float(), dim=-1).min()) > 0.999

    for g, ref in zip(got, refs, strict=True):
        close(g, ref)  # not normalized: TEI's raw hidden states
    r = httpx.post(f"{url}/pooling", json={"input": texts, "model": "minilm"}, timeout=60)  # token_embed
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and [d["object"] for d in body["data"]] == ["pooling"] * 2
    for d, ref in zip(body["data"], refs, strict=True):
        vecs = torch.tensor(d["data"])
        close(vecs, ref)
        assert torch.allclose(vecs.norm(dim=-1), torch.ones(len(vecs)), atol=1e-4)  # normalized per token
    pooled = httpx.post(f"{url}/pooling", json={"input": texts, "task": "embed"}, timeout=60).json()
    emb = httpx.post(f"{url}/v1/embeddings", json={"input": texts}, timeout=60).json()
    assert [d["data"] for d in pooled["data"]] == [d["embedding"] for d in emb["data"]]
    r = httpx.post(f"{url}/pooling", json={"input": texts, "task": "classify"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "task"

    ids = st.tokenizer(texts[1])["input_ids"]
    r = httpx.post(f"{url}/decode", json={"ids": ids}, timeout=60)
    assert r.status_code == 200 and r.json() == [st.tokenizer.decode(ids, skip_special_tokens=True)]
    r = httpx.post(f"{url}/decode", json={"ids": [ids, ids[:3]], "skip_special_tokens": False}, timeout=60)
    assert r.json() == [st.tokenizer.decode(x) for x in (ids, ids[:3])]
    r = httpx.post(f"{url}/decode", json={"ids": [10**9]}, timeout=60)
    assert r.status_code == 422 and r.json()["error_type"] == "validation"

    surl, _ = score_url
    assert httpx.post(f"{surl}/embed_all", json={"inputs": "x"}, timeout=60).status_code == 422  # TEI's
    r = httpx.post(f"{surl}/pooling", json={"input": ["a b", "c"]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "task"  # no sequence task by default
    r = httpx.post(f"{surl}/pooling", json={"input": ["a b", "c"], "task": "classify"}, timeout=60)
    cls = httpx.post(f"{surl}/classify", json={"input": ["a b", "c"]}, timeout=60).json()
    assert r.status_code == 200 and [d["data"] for d in r.json()["data"]] == [d["probs"] for d in cls["data"]]
