"""Fuzzing: schemathesis against the server's own OpenAPI document (no 5xx, every response as
documented), and hypothesis on sampling parameters, at the engine (SamplingParams + LLMEngine on a
tiny model) and through both HTTP APIs: invalid parameters are rejected cleanly, valid ones run."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from rel_support import InProcServer, engine_config
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

FUZZ_SETTINGS = settings(
    deadline=None,
    derandomize=True,  # the same cases on every run: a CI failure reproduces locally
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
    database=None,
)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
GENERATION_ROUTES = [
    "/generate",
    "/generate_stream",
    "/",
    "/tokenize",
    "/v1/completions",
    "/v1/chat/completions",
]


# ---- schemathesis ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def openapi_doc(rel_server: InProcServer) -> Any:
    return schemathesis.openapi.from_url(f"{rel_server.url}/openapi.json")


def test_rel_fuzz_openapi_documents_bodies_and_errors(rel_server: InProcServer) -> None:
    """Without request bodies in the document, a fuzzer would only ever send empty bodies."""
    doc = httpx.get(f"{rel_server.url}/openapi.json", timeout=60).json()
    for path in GENERATION_ROUTES:
        op = doc["paths"][path]["post"]
        assert "requestBody" in op, path
        assert {"200", "413", "429"} <= set(op["responses"]) or path == "/tokenize", path
    assert "text/event-stream" in doc["paths"]["/generate_stream"]["post"]["responses"]["200"]["content"]
    assert {"400", "404", "500"} <= set(doc["paths"]["/v1/completions"]["post"]["responses"])
    assert {"422", "424"} <= set(doc["paths"]["/generate"]["post"]["responses"])


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("path", GENERATION_ROUTES)
def test_rel_fuzz_schemathesis_generation_routes(
    rel_server: InProcServer, openapi_doc: Any, path: str, mode: GenerationMode
) -> None:
    op = openapi_doc[path]["POST"]
    statuses: list[int] = []

    @settings(FUZZ_SETTINGS, max_examples=15 if mode is GenerationMode.POSITIVE else 10)
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        response = case.call_and_validate(
            base_url=rel_server.url, headers=rel_server.auth, checks=CHECKS, timeout=120
        )
        statuses.append(response.status_code)

    run()
    print(f"\n{path} {mode.value}: statuses {sorted(Counter(statuses).items())}")
    assert statuses and max(statuses) < 500, statuses


# The pooling routes' bodies are in the document too (server/api/openapi_doc.py); on this generative
# server their parsers and refusals run (a pooling request is a 400/422 naming the task).
POOLING_ROUTES = ["/v1/embeddings", "/embed", "/embed_all", "/rerank", "/predict", "/pooling", "/decode"]


@pytest.mark.parametrize("path", POOLING_ROUTES)
def test_rel_fuzz_schemathesis_pooling_routes(rel_server: InProcServer, openapi_doc: Any, path: str) -> None:
    doc = httpx.get(f"{rel_server.url}/openapi.json", timeout=60).json()
    assert "requestBody" in doc["paths"][path]["post"], path
    op = openapi_doc[path]["POST"]
    statuses: list[int] = []

    @settings(FUZZ_SETTINGS, max_examples=8)
    @given(case=op.as_strategy(generation_mode=GenerationMode.POSITIVE))
    def run(case: Any) -> None:
        response = case.call_and_validate(
            base_url=rel_server.url, headers=rel_server.auth, checks=CHECKS, timeout=120
        )
        statuses.append(response.status_code)

    run()
    assert statuses and max(statuses) < 500, statuses


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics", "/info", "/v1/models"])
def test_rel_fuzz_schemathesis_read_routes(rel_server: InProcServer, openapi_doc: Any, path: str) -> None:
    op = openapi_doc[path]["GET"]

    @settings(FUZZ_SETTINGS, max_examples=3)
    @given(case=op.as_strategy())
    def run(case: Any) -> None:
        response = case.call_and_validate(base_url=rel_server.url, headers=rel_server.auth, checks=CHECKS)
        assert response.status_code == 200

    run()


# ---- hypothesis: sampling parameters at the engine --------------------------------------------------
_weird_floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-9, 1.0, 2.0, 100.0, 100.0001, -1e-9]),
)
SAMPLING_KWARGS = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.integers(-2, 6),
        "temperature": st.one_of(st.floats(0.0, 3.0), _weird_floats),
        "top_k": st.one_of(st.integers(-2, 5), st.integers(0, 60000)),
        "top_p": st.one_of(st.floats(0.0, 1.0), _weird_floats),
        "min_p": st.one_of(st.floats(0.0, 1.0), _weird_floats),
        "repetition_penalty": st.one_of(st.floats(0.0, 3.0), _weird_floats),
        "presence_penalty": st.one_of(st.floats(-2.5, 2.5), _weird_floats),
        "frequency_penalty": st.one_of(st.floats(-2.5, 2.5), _weird_floats),
        "seed": st.one_of(st.none(), st.integers(-1, 2**64)),
        "stop": st.lists(st.text(max_size=3), max_size=3).map(tuple),
        "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3).map(tuple),
        "ignore_eos": st.booleans(),
        "min_tokens": st.integers(-1, 6),
        "logprobs": st.one_of(st.none(), st.integers(-1, 22)),
        "prompt_logprobs": st.one_of(st.none(), st.integers(0, 3)),
        "include_stop_str_in_output": st.booleans(),
        "skip_special_tokens": st.booleans(),
    },
)


@pytest.fixture(scope="module")
def offline_engine(rel_model: Path) -> Iterator[Any]:
    """An engine of its own (the served one belongs to its loop thread), stepped synchronously."""
    from server.engine import LLMEngine

    yield LLMEngine(engine_config(rel_model, num_kv_blocks=32))


@settings(FUZZ_SETTINGS, max_examples=40)
# A repetition penalty near 0 turns a seen token's positive logit into +inf (CI, 2026-12-07: the compiled
# sampler refused the row, where the row's distribution is its +inf tokens).
@example(
    batch=[({"max_tokens": 1}, [46037]), ({"repetition_penalty": 1.4e-193, "seed": 6, "top_p": 0.86}, [1277])]
)
@given(
    batch=st.lists(
        st.tuples(SAMPLING_KWARGS, st.lists(st.integers(0, 49151), min_size=1, max_size=40)),
        min_size=1,
        max_size=3,
    )
)
def test_rel_fuzz_sampling_params_never_crash_the_engine(
    offline_engine: Any, batch: list[tuple[dict, list[int]]]
) -> None:
    from server.request import FinishReason, SamplingParams

    llm = offline_engine
    vocab = llm.loaded.arch.vocab_size
    admitted: dict[str, tuple[SamplingParams, list[int]]] = {}
    for i, (kwargs, prompt) in enumerate(batch):
        try:
            params = SamplingParams(**kwargs)
        except ValueError:
            continue  # the only way a bad value may be refused
        rid = f"fuzz-{i}-{id(batch)}"
        try:
            llm.add_request(rid, prompt, params)
        except ValueError:
            continue
        admitted[rid] = (params, prompt)
    outs: dict[str, list[Any]] = {rid: [] for rid in admitted}
    for _ in range(100):
        if not llm.has_unfinished():
            break
        for out in llm.step():
            outs[out.request_id].append(out)
    assert not llm.has_unfinished(), "requests did not finish"

    for rid, (params, prompt) in admitted.items():
        seq = outs[rid]
        assert seq and seq[-1].finished
        last = seq[-1]
        assert last.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), (
            last.finish_reason,
            last.error,
        )
        tokens = [t for o in seq for t in o.new_token_ids]
        assert 1 <= len(tokens) <= params.max_tokens
        assert all(0 <= t < vocab for t in tokens)
        if last.finish_reason is FinishReason.LENGTH:
            assert len(tokens) == params.max_tokens
        if params.logprobs is not None:
            lps = [lp for o in seq for lp in o.new_logprobs]
            assert len(lps) == len(tokens)
            for lp, tok in zip(lps, tokens, strict=True):
                assert lp.chosen.token_id == tok
                assert len(lp.top) == params.logprobs
                for value in (lp.chosen.logprob, *(a.logprob for a in lp.top)):
                    assert not math.isnan(value) and value <= 1e-4
        if params.prompt_logprobs is not None:
            plps = next(o.prompt_logprobs for o in seq if o.prompt_logprobs is not None)
            assert len(plps) == len(prompt) and plps[0] is None
            for plp, tok in zip(plps[1:], prompt[1:], strict=True):
                assert plp is not None and plp.chosen.token_id == tok
                assert not math.isnan(plp.chosen.logprob) and len(plp.top) == params.prompt_logprobs
    stats = llm.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0


# ---- hypothesis: sampling parameters through HTTP ------------------------------------------------
_json_any = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.lists(st.integers(-3, 3), max_size=3),
)
_TGI_FIELDS = [
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "do_sample",
    "details",
    "top_n_tokens",
    "truncate",
    "best_of",
    "typical_p",
    "return_full_text",
    "decoder_input_details",
]
_OPENAI_FIELDS = [
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "best_of",
    "echo",
    "stream",
]


def _small_valid(name: str) -> st.SearchStrategy[Any]:
    """In-range values, so that a good share of the cases is accepted and really generates."""
    table: dict[str, st.SearchStrategy[Any]] = {
        "max_new_tokens": st.integers(1, 4),
        "max_tokens": st.integers(1, 4),
        "temperature": st.floats(0.05, 2.0),
        "top_k": st.integers(1, 50),
        "top_p": st.floats(0.05, 0.95),
        "min_p": st.floats(0.0, 0.5),
        "n": st.integers(1, 3),
        "seed": st.integers(0, 2**31),
        "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
        "repetition_penalty": st.floats(0.5, 2.0),
        "frequency_penalty": st.floats(-2.0, 2.0),
        "presence_penalty": st.floats(-2.0, 2.0),
        "logprobs": st.integers(0, 3),
        "top_n_tokens": st.integers(0, 3),
    }
    return table.get(name, st.booleans())


def _params(fields: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(st.sampled_from(fields), st.none(), max_size=6).flatmap(
        lambda keys: st.fixed_dictionaries(
            {k: st.one_of(_small_valid(k), _small_valid(k), _json_any) for k in keys}
        )
    )


def _check_response(r: httpx.Response, openai: bool) -> None:
    assert r.status_code < 500, r.text[:300]
    if r.status_code == 200:
        return
    body = r.json()
    if openai:
        assert r.status_code in (400, 404), r.text[:300]
        assert isinstance(body["error"]["message"], str) and body["error"]["code"] == r.status_code
    else:
        assert r.status_code == 422, r.text[:300]
        assert body["error_type"] == "validation" and isinstance(body["error"], str)


@settings(FUZZ_SETTINGS, max_examples=30)
@given(params=_params(_TGI_FIELDS), stream=st.booleans())
def test_rel_fuzz_tgi_parameters_over_http(
    rel_server: InProcServer, params: dict[str, Any], stream: bool
) -> None:
    path = "/generate_stream" if stream else "/generate"
    body = {"inputs": "fuzz the sampler", "parameters": {"max_new_tokens": 3, **params}}
    with httpx.stream(
        "POST", f"{rel_server.url}{path}", json=body, headers=rel_server.auth, timeout=120
    ) as r:
        r.read()
    _check_response(r, openai=False)
    if r.status_code == 200 and stream:
        last = r.text.strip().splitlines()[-1]
        assert '"error"' not in last, last


@settings(FUZZ_SETTINGS, max_examples=30)
@given(params=_params(_OPENAI_FIELDS), chat=st.booleans())
def test_rel_fuzz_openai_parameters_over_http(
    rel_server: InProcServer, params: dict[str, Any], chat: bool
) -> None:
    body: dict[str, Any] = {"max_tokens": 3, **params}
    if chat:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": "fuzz the sampler"}]
        body.pop("echo", None)
    else:
        path = "/v1/completions"
        body["prompt"] = "fuzz the sampler"
    with httpx.stream(
        "POST", f"{rel_server.url}{path}", json=body, headers=rel_server.auth, timeout=120
    ) as r:
        r.read()
    _check_response(r, openai=True)
    if r.status_code == 200 and body.get("stream") is True:
        frames = [ln for ln in r.text.splitlines() if ln.startswith("data:")]
        assert frames[-1] == "data: [DONE]" and '"error"' not in frames[-2], frames[-2:]
