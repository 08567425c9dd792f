"""Error contracts of both APIs (status codes and bodies each client family expects). None of these
requests reaches the engine, except the injected sampling fault, which must come back as TGI's
`generation` error (424, or an in-stream event) and OpenAI's 500."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import text_generation
from conftest import SERVED_NAME, TGI_PROMPT, LiveServer


def _tgi(r: httpx.Response, status: int, error_type: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error", "error_type"} and body["error_type"] == error_type
    return str(body["error"])


def _oai(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return dict(err)


@pytest.fixture
def no_engine_traffic(live_server: LiveServer) -> Iterator[None]:
    """Asserts that the test's requests never reached the engine."""
    before = (
        live_server.llm.scheduler.stats().num_prompt_tokens,
        live_server.metric("vllm:request_success_total", 0.0),
    )
    yield
    after = (
        live_server.llm.scheduler.stats().num_prompt_tokens,
        live_server.metric("vllm:request_success_total", 0.0),
    )
    assert before == after


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"inputs": TGI_PROMPT, "parameters": {"temperature": 0}}, "temperature"),
        ({"inputs": TGI_PROMPT, "parameters": {"top_p": 1.5}}, "top_p"),
        ({"inputs": TGI_PROMPT, "parameters": {"top_k": 0}}, "top_k"),
        ({"inputs": TGI_PROMPT, "parameters": {"max_new_tokens": 0}}, "max_new_tokens"),
        ({"inputs": TGI_PROMPT, "parameters": {"max_new_tokens": "many"}}, "max_new_tokens"),
        ({"inputs": TGI_PROMPT, "parameters": {"best_of": 2}}, "sampling"),
        ({"inputs": TGI_PROMPT, "parameters": {"best_of": 2, "do_sample": True, "seed": 1}}, "seed"),
        ({"inputs": TGI_PROMPT, "parameters": {"best_of": 9, "do_sample": True}}, "best_of"),
        ({"inputs": TGI_PROMPT, "parameters": {"top_n_tokens": 6}}, "top_n_tokens"),
        ({"inputs": TGI_PROMPT, "parameters": {"stop": ["a", "b", "c", "d", "e"]}}, "stop"),
        ({"inputs": TGI_PROMPT, "parameters": {"repetition_penalty": -1}}, "repetition_penalty"),
        ({"inputs": TGI_PROMPT, "parameters": {"truncate": 0}}, "truncate"),
        ({"inputs": TGI_PROMPT, "parameters": {"grammar": {"type": "regex", "value": "a(b"}}}, "grammar"),
        (
            {"inputs": TGI_PROMPT, "parameters": {"grammar": {"type": "json", "value": {"type": "foo"}}}},
            "grammar",
        ),
        ({"inputs": ""}, "inputs"),
        ({"inputs": 5}, "inputs"),
        ({"parameters": {}}, "inputs"),
    ],
)
def test_api_tgi_validation_422(
    live_server: LiveServer, no_engine_traffic: None, body: dict, fragment: str
) -> None:
    msg = _tgi(httpx.post(f"{live_server.url}/generate", json=body, timeout=60), 422, "validation")
    assert fragment in msg


def test_api_tgi_malformed_and_stream_rules(live_server: LiveServer, no_engine_traffic: None) -> None:
    url = live_server.url
    _tgi(
        httpx.post(
            f"{url}/generate", content=b"{not json", headers={"content-type": "application/json"}, timeout=60
        ),
        422,
        "validation",
    )
    body = {"inputs": TGI_PROMPT, "parameters": {"best_of": 2, "do_sample": True}}
    assert "stream" in _tgi(httpx.post(f"{url}/generate_stream", json=body, timeout=60), 422, "validation")
    body = {"inputs": TGI_PROMPT, "parameters": {"decoder_input_details": True}}
    _tgi(httpx.post(f"{url}/generate_stream", json=body, timeout=60), 422, "validation")
    assert 'err="validation"' in httpx.get(f"{url}/metrics", timeout=60).text  # tgi_request_failure{err}
    # The text-generation client maps error_type to its exception classes.
    with pytest.raises(text_generation.errors.ValidationError):
        text_generation.Client(url).generate(TGI_PROMPT, max_new_tokens=10**6)


def test_api_payload_limit_413(live_server: LiveServer, no_engine_traffic: None) -> None:
    big = "x" * (live_server.state.config.max_payload_bytes + 10)
    _tgi(
        httpx.post(f"{live_server.url}/generate", json={"inputs": big}, timeout=60), 413, "payload_too_large"
    )
    _oai(
        httpx.post(
            f"{live_server.url}/v1/completions", json={"model": SERVED_NAME, "prompt": big}, timeout=60
        ),
        413,
    )


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, None),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, None),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
        ("/v1/completions", {"prompt": [], "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1.0}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"prompt": [10**9], "max_tokens": 2}, None),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages.0.role"),
        ("/v1/chat/completions", {"messages": "hello"}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0].type",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**7},
            "max_tokens",
        ),
    ],
)
def test_api_openai_validation_400(
    live_server: LiveServer, no_engine_traffic: None, path: str, body: dict, param: str | None
) -> None:
    err = _oai(httpx.post(f"{live_server.url}{path}", json={"model": SERVED_NAME, **body}, timeout=60), 400)
    assert err["type"] == "BadRequestError"
    if param is not None:
        assert err["param"] == param


def test_api_openai_malformed_unknown_model(live_server: LiveServer, no_engine_traffic: None) -> None:
    url = live_server.url
    _oai(
        httpx.post(
            f"{url}/v1/completions", content=b"[1,", headers={"content-type": "application/json"}, timeout=60
        ),
        400,
    )
    err = _oai(httpx.post(f"{url}/v1/completions", json={"model": "gpt-17", "prompt": "hi"}, timeout=60), 404)
    assert "gpt-17" in err["message"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": "hi"}], temperature=9e9
        )


@pytest.fixture
def failing_sampler(live_server: LiveServer) -> Iterator[int]:
    """Makes sampling fail for requests seeded with the yielded seed (the batch's other rows go on)."""
    runner = live_server.llm.runner
    original = runner.sampler
    marker = 424242

    def sampler(logits: Any, rows: list) -> Any:
        if any(row.params.seed == marker for row in rows):
            raise RuntimeError("injected sampling fault")
        return original(logits, rows)

    runner.sampler = sampler
    yield marker
    runner.sampler = original


def test_api_engine_failure_maps_to_generation_error(live_server: LiveServer, failing_sampler: int) -> None:
    url = live_server.url
    params = {"max_new_tokens": 3, "do_sample": True, "seed": failing_sampler}
    msg = _tgi(
        httpx.post(f"{url}/generate", json={"inputs": TGI_PROMPT, "parameters": params}, timeout=60),
        424,
        "generation",
    )
    assert "injected sampling fault" in msg
    with httpx.stream(
        "POST", f"{url}/generate_stream", json={"inputs": TGI_PROMPT, "parameters": params}, timeout=60
    ) as s:
        assert s.status_code == 200
        frames = [json.loads(line.removeprefix("data:")) for line in s.iter_lines() if line]
    assert frames[-1]["error_type"] == "generation" and "injected" in frames[-1]["error"]
    with pytest.raises(text_generation.errors.GenerationError):
        list(
            text_generation.Client(url).generate_stream(
                TGI_PROMPT, max_new_tokens=3, do_sample=True, seed=failing_sampler
            )
        )
    body = {"model": SERVED_NAME, "prompt": TGI_PROMPT, "max_tokens": 3, "seed": failing_sampler}
    err = _oai(httpx.post(f"{url}/v1/completions", json=body, timeout=60), 500)
    assert "injected" in err["message"]
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        frames = [line for line in s.iter_lines() if line]
    assert (
        frames[-1] == "data: [DONE]"
        and "injected" in json.loads(frames[-2].removeprefix("data: "))["error"]["message"]
    )
    # The server keeps serving.
    assert httpx.get(f"{url}/health", timeout=60).status_code == 200
    ok = httpx.post(
        f"{url}/generate", json={"inputs": TGI_PROMPT, "parameters": {"max_new_tokens": 2}}, timeout=60
    )
    assert ok.status_code == 200
