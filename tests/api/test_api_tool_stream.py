"""Tool calls are the same streamed and not, on the live server: for the same greedy tokens, the
unary reply's `tool_calls` and content equal what the stream's deltas rebuild, for every tool_choice
mode (required with parallel calls, named, auto with the hermes parser) and for outputs cut by
max_tokens at many points (complete calls, a call cut inside its arguments, one cut before its name).
The rule for an unfinished call is in server/api/tool_parsers.py's docstring."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import SERVED_NAME, LiveServer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "maxLength": 20}},
            "required": ["tz"],
        },
    },
}
MESSAGES = [
    {"role": "user", "content": "What's the weather in Paris and the time in Tokyo? Call both tools."}
]
MODES: dict[str, Any] = {
    "required": "required",
    "named": {"type": "function", "function": {"name": "get_weather"}},
    "auto": "auto",
}


@pytest.fixture
def hermes(live_server: LiveServer) -> Iterator[None]:
    state = live_server.state
    saved = state.config
    state.config = dataclasses.replace(saved, enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield
    state.config = saved


def _unary(
    live_server: LiveServer, body: dict[str, Any]
) -> tuple[str | None, list[tuple[str, str]], str, int]:
    r = httpx.post(f"{live_server.url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    msg = choice["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in msg.get("tool_calls") or [])
    return msg["content"], calls, choice["finish_reason"], r.json()["usage"]["completion_tokens"]


def _streamed(live_server: LiveServer, body: dict[str, Any]) -> tuple[str | None, list[tuple[str, str]], str]:
    content, calls, finish = "", {}, None
    with httpx.stream(
        "POST", f"{live_server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=300
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            for ch in json.loads(line[5:])["choices"]:
                finish = ch["finish_reason"] or finish
                delta = ch["delta"]
                content += delta.get("content") or ""
                for tc in delta.get("tool_calls") or []:
                    c = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                    if tc.get("id"):
                        assert not c["name"], "a call's id and name are sent once"
                        c["name"] = tc["function"]["name"]
                    c["arguments"] += tc["function"].get("arguments") or ""
    assert finish is not None
    return content or None, [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)], finish


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_api_tool_calls_same_streamed_and_unary_at_every_cut(
    live_server: LiveServer, hermes: None, mode: str
) -> None:
    body: dict[str, Any] = {
        "model": SERVED_NAME,
        "messages": MESSAGES,
        "tools": [WEATHER, TIME],
        "tool_choice": MODES[mode],
        "temperature": 1.0,
        "max_tokens": 80,
    }
    # Seeded sampling gives the same tokens streamed and not; for `required`, a seed whose reply makes
    # parallel calls (the report's case: a cut falls inside the second call).
    for seed in range(12):
        _, full_calls, full_finish, n = _unary(live_server, {**body, "seed": seed})
        if mode != "required" or len(full_calls) >= 2:
            break
    else:
        raise AssertionError("no seed gave parallel calls")
    body["seed"] = seed
    cuts = sorted({n // 4, n // 2, (3 * n) // 4, n - 1, n} - {0})
    seen_cut_call = False
    for cut in cuts:
        b = {**body, "max_tokens": cut}
        content, calls, finish, _ = _unary(live_server, b)
        assert _streamed(live_server, b) == (content, calls, finish), cut
        if finish == "length" and mode != "auto":
            # What was generated as calls is returned as calls, never as raw JSON content.
            assert content is None
            seen_cut_call |= bool(calls) and calls != full_calls
        assert not (calls and finish == "stop"), "a reply with calls ends with tool_calls"
    if mode != "auto":
        assert full_finish == "tool_calls"
        assert seen_cut_call  # some cut fell inside a call and returned it, streamed and not
