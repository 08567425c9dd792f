"""Logprobs under a grammar (vLLM's --logprobs-mode, default raw_logprobs): the first generated
token's top alternatives are the model's own distribution, equal to the same request's without a
constraint, on OpenAI chat and completions (streamed and not) and TGI's details/top_n_tokens; no
masked token ever shows at the mask's fill value (-9999.0), and prompt logprobs are unaffected."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from conftest import SERVED_NAME, LiveServer

CHOICES = ["Paris", "Lyon"]  # few allowed first tokens: a top-20 list would hold masked ones
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France? One word."}]
FILL = -9999.0


def _post(live_server: LiveServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{live_server.url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _stream(live_server: LiveServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with httpx.stream("POST", f"{live_server.url}{path}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                events.append(json.loads(line[5:]))
    return events


def _assert_same(constrained: dict[str, float], free: dict[str, float]) -> None:
    assert FILL not in constrained.values(), constrained
    assert constrained.keys() == free.keys(), (constrained, free)
    for k, v in free.items():
        assert constrained[k] == pytest.approx(v, abs=1e-4), k


def _chat_first(content: list[dict[str, Any]]) -> dict[str, float]:
    return {t["token"]: t["logprob"] for t in content[0]["top_logprobs"]}


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_api_logprobs_raw_under_grammar_chat(live_server: LiveServer, stream: bool) -> None:
    body = {
        "model": SERVED_NAME,
        "messages": MESSAGES,
        "max_tokens": 3,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 20,
    }

    def first(extra: dict[str, Any]) -> tuple[dict[str, float], list[dict[str, Any]]]:
        if not stream:
            r = _post(live_server, "/v1/chat/completions", {**body, **extra})
            content = r["choices"][0]["logprobs"]["content"]
        else:
            content = [
                c
                for e in _stream(live_server, "/v1/chat/completions", {**body, **extra})
                for ch in e["choices"]
                for c in (ch.get("logprobs") or {}).get("content") or []
            ]
        return _chat_first(content), content

    free, _ = first({})
    for extra in ({"guided_choice": CHOICES}, {"response_format": {"type": "json_object"}}):
        constrained, content = first(extra)
        _assert_same(constrained, free)
        for tok in content:  # every position: no fill value, chosen token finite
            assert tok["logprob"] > FILL and all(t["logprob"] > FILL for t in tok["top_logprobs"])


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_api_logprobs_raw_under_grammar_completions(live_server: LiveServer, stream: bool) -> None:
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 5}

    def tops(extra: dict[str, Any]) -> list[dict[str, float]]:
        if not stream:
            r = _post(live_server, "/v1/completions", {**body, **extra})
            return list(r["choices"][0]["logprobs"]["top_logprobs"])
        return [
            t
            for e in _stream(live_server, "/v1/completions", {**body, **extra})
            for ch in e["choices"]
            for t in (ch.get("logprobs") or {}).get("top_logprobs") or []
        ]

    free = tops({})
    constrained = tops({"guided_regex": "(Paris|Lyon)"})
    # The chosen token may join the top list (OpenAI's completions shape): compare the shared keys.
    shared = {k: v for k, v in constrained[0].items() if k in free[0]}
    assert len(shared) >= 5
    _assert_same(shared, {k: free[0][k] for k in shared})
    assert all(v > FILL for t in constrained for v in t.values())


def test_api_logprobs_prompt_logprobs_unaffected_by_grammar(live_server: LiveServer) -> None:
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3}
    free = _post(live_server, "/v1/completions", body)["choices"][0]["prompt_logprobs"]
    constrained = _post(live_server, "/v1/completions", {**body, "guided_choice": CHOICES})
    assert constrained["choices"][0]["prompt_logprobs"] == free


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_api_logprobs_raw_under_grammar_tgi(live_server: LiveServer, stream: bool) -> None:
    params = {"max_new_tokens": 3, "details": True, "top_n_tokens": 5, "decoder_input_details": False}

    def tops(grammar: dict[str, Any] | None) -> list[list[dict[str, Any]]]:
        p = {**params, **({"grammar": grammar} if grammar else {})}
        if not stream:
            return list(
                _post(live_server, "/generate", {"inputs": PROMPT, "parameters": p})["details"]["top_tokens"]
            )
        return [
            e["top_tokens"]
            for e in _stream(live_server, "/generate_stream", {"inputs": PROMPT, "parameters": p})
        ]

    free = tops(None)
    constrained = tops({"type": "regex", "value": "(Paris|Lyon)"})
    _assert_same(
        {str(t["id"]): t["logprob"] for t in constrained[0]}, {str(t["id"]): t["logprob"] for t in free[0]}
    )
    assert all(t["logprob"] > FILL for step in constrained for t in step)
