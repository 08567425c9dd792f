"""Nested request objects are closed by name (issue 50 items 1 and 5's kind): a key inside a tool
definition, a content part, a replayed tool call, `tool_choice`, `stream_options`, TGI's `grammar`,
`structured_outputs` or a Responses input item is served or refused with a 400/422 whose `param`
is its path, on every route that reads it; what the real clients send (the `openai` SDK's strict
function tools and replayed assistant messages, huggingface_hub's and text-generation's chat calls,
multimodal-shaped text parts) still passes. Refusals never reach the engine, so these are fast."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pydantic
import pytest
from conftest import SERVED_NAME, LiveServer

_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "enum": [7]}},
    "required": ["answer"],
    "additionalProperties": False,
}
_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
_USER: dict[str, Any] = {"role": "user", "content": "hi"}
_CALL: dict[str, Any] = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": SERVED_NAME, "messages": [_USER], "max_tokens": 2, **extra}


def _with_fn(**keys: Any) -> dict[str, Any]:
    return {"type": "function", "function": {**_TOOL["function"], **keys}}


def _replay(call: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        _USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]


# (route, body, the path the refusal names)
_REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", _chat(tools=[{**_TOOL, "foo": 1}]), "tools[0].foo"),
    ("/v1/chat/completions", _chat(tools=[_with_fn(foo=1)]), "tools[0].function.foo"),
    ("/v1/chat/completions", _chat(tools=[{**_TOOL, "type": "retrieval"}]), "tools[0].type"),
    ("/v1/chat/completions", _chat(tools=[_with_fn(strict="yes")]), "tools[0].function.strict"),
    (
        "/v1/chat/completions",
        _chat(tools=[_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather", "x": 1}}),
        "tool_choice.function.x",
    ),
    (
        "/v1/chat/completions",
        _chat(tools=[_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}, "x": 1}),
        "tool_choice.x",
    ),
    (
        "/v1/chat/completions",
        _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]}]),
        "messages[0].content[0].cache_control",
    ),
    (
        "/v1/chat/completions",
        _chat(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "hi"},
                        {"type": "image_url", "image_url": {"url": "x"}},
                    ],
                }
            ]
        ),
        "messages[0].content[1].type",
    ),
    ("/v1/chat/completions", _chat(messages=_replay({**_CALL, "foo": 1})), "messages[1].tool_calls[0].foo"),
    (
        "/v1/chat/completions",
        _chat(messages=_replay({**_CALL, "function": {**_CALL["function"], "foo": 1}})),
        "messages[1].tool_calls[0].function.foo",
    ),
    (
        "/v1/chat/completions",
        _chat(messages=_replay({**_CALL, "function": {"name": "get_weather", "arguments": "{"}})),
        "messages[1].tool_calls[0].function.arguments",
    ),
    (
        "/v1/chat/completions",
        _chat(stream=True, stream_options={"include_usage": True, "x": 1}),
        "stream_options.x",
    ),
    (
        "/v1/chat/completions",
        _chat(structured_outputs={"json_object": True, "foo": False}),
        "structured_outputs.foo",
    ),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream_options": {"x": True}}, "stream_options.x"),
    (
        "/tokenize",
        {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
        "messages[0].content[0].type",
    ),
    (
        "/generate",
        {"inputs": "hi", "parameters": {"grammar": {"type": "json", "value": _SCHEMA, "x": 1}}},
        "parameters.grammar.x",
    ),
    (
        "/generate",
        {
            "inputs": "hi",
            "parameters": {"grammar": {"type": "json_schema", "value": {"schema": _SCHEMA, "x": 1}}},
        },
        "parameters.grammar.value.x",
    ),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f", "x": 1}]}, "tools[0].x"),
    ("/v1/responses", {"input": [{"role": "user", "content": "hi", "x": 1}]}, "input[0].x"),
    (
        "/v1/responses",
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi", "x": 1}]}]},
        "input[0].content[0].x",
    ),
    (
        "/v1/responses",
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0].type",
    ),
    (
        "/v1/responses",
        {"input": [{"type": "reasoning", "content": [{"type": "summary_text", "text": "x"}]}, _USER]},
        "input[0].content[0].type",
    ),
    (
        "/v1/responses",
        {
            "input": "hi",
            "tools": [{"type": "function", "name": "f"}],
            "tool_choice": {"type": "function", "name": "f", "x": 1},
        },
        "tool_choice.x",
    ),
    (
        "/v1/responses",
        {"input": "hi", "text": {"format": {"type": "json_object", "schema": _SCHEMA}}},
        "text.format.schema",
    ),
]


@pytest.mark.parametrize(("route", "body", "path"), _REFUSED, ids=[f"{r}:{p}" for r, _, p in _REFUSED])
def test_nested_keys_refused_by_path(
    live_server: LiveServer, route: str, body: dict[str, Any], path: str
) -> None:
    r = httpx.post(f"{live_server.url}{route}", json=body, timeout=60)
    if route == "/generate":  # TGI's family: 422 {"error", "error_type"}
        assert r.status_code == 422, r.text
        assert path in r.json()["error"] and r.json()["error_type"] == "validation", r.text
    else:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == path and path in r.json()["error"]["message"], r.text


def test_tgi_json_schema_grammar_reads_name_and_schema(live_server: LiveServer) -> None:
    """TGI 3's `{"type": "json_schema", "value": {"name", "schema"}}`: the schema is `value.schema`
    (was read as the schema itself: any JSON with a 200)."""
    grammar = {"type": "json_schema", "value": {"name": "a", "schema": _SCHEMA}}
    r = httpx.post(
        f"{live_server.url}/generate",
        json={"inputs": "Reply:", "parameters": {"max_new_tokens": 24, "grammar": grammar}},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["generated_text"]) == {"answer": 7}


def test_clients_nested_shapes_still_pass(live_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the clients send: the openai SDK's strict function tools (`pydantic_function_tool`) and a
    replayed assistant message (`model_dump()`), text parts, `strict: false`, `"type": "function"`,
    `name` on messages; huggingface_hub's chat_completion with tools and text parts; text-generation's
    Client.chat with tools (its tool calls replay an integer id and object arguments)."""
    url = live_server.url

    class GetWeather(pydantic.BaseModel):
        city: str

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    tool = openai.pydantic_function_tool(GetWeather, name="get_weather")
    assert tool["function"].get("strict") is True
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[
            {"role": "user", "name": "ann", "content": [{"type": "text", "text": "Weather in Paris?"}]}
        ],
        tools=[tool, _with_fn(name="get_time", strict=False)],  # type: ignore[list-item]
        tool_choice=named,
        max_tokens=30,
        temperature=0.0,
    )
    (call,) = first.choices[0].message.tool_calls or []
    GetWeather.model_validate_json(call.function.arguments)  # type: ignore[union-attr]
    replay: list[Any] = [
        {"role": "user", "content": "Weather in Paris?"},
        first.choices[0].message.model_dump(),  # nulls and all, as clients replay it
        {"role": "tool", "tool_call_id": call.id, "content": "18C"},
    ]
    second = client.chat.completions.create(
        model=SERVED_NAME, messages=replay, tools=[tool], max_tokens=4, temperature=0.0, tool_choice="none"
    )
    assert second.choices[0].message.content

    import huggingface_hub.constants
    from huggingface_hub import InferenceClient

    monkeypatch.setattr(huggingface_hub.constants, "is_offline_mode", lambda: False)
    hf = InferenceClient(base_url=url)
    out = hf.chat_completion(  # type: ignore[call-overload]
        model="tgi",
        messages=[{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}],
        tools=[_TOOL],
        tool_choice="required",
        max_tokens=30,
    )
    assert out.choices[0].message.tool_calls

    from text_generation import Client

    tgi = Client(url, timeout=120)
    done = tgi.chat(
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": 0,
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": {"city": "Paris"},
                            "description": None,
                        },
                    }
                ],
            },
            {"role": "user", "content": "Thanks."},  # its Message has no tool_call_id
        ],
        tools=[_TOOL],  # type: ignore[list-item]
        tool_choice="none",
        max_tokens=4,
    )
    assert done.choices[0].message.content


# ---- item 2: text-generation's Client.chat(stream=True) and the openai SDK's streams --------------------------
def test_text_generation_chat_stream_and_openai_streams(
    live_server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """text-generation's `ChatCompletionChunk` (TGI 2's Messages API) needs `role` and `tool_calls`
    in every delta: a request naming TGI's placeholder model ("tgi", what that client sends) gets
    TGI's delta shape; the same text as unary. The openai SDK's streams still parse and add up:
    chunk iteration with model "tgi" and the `.stream()` helper (which concatenates every string
    field of the deltas, so a role in every delta would read "assistantassistant...") with the
    served name; huggingface_hub's stream reads both shapes."""
    from text_generation import Client

    url = live_server.url
    messages: Any = [{"role": "user", "content": "Name a fruit."}]
    unary = Client(url, timeout=120).chat(messages=messages, max_tokens=8, temperature=0.0)
    chunks: list[Any] = list(
        Client(url, timeout=120).chat(messages=messages, max_tokens=8, temperature=0.0, stream=True)
    )
    assert all(c.choices[0].delta.role == "assistant" for c in chunks if c.choices)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == unary.choices[0].message.content and streamed
    assert chunks[-1].choices[0].finish_reason == "length"

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    tgi_text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="tgi",
            messages=messages,
            max_tokens=8,
            temperature=0.0,
            stream=True,  # type: ignore[arg-type]
        )
        if c.choices
    )
    assert tgi_text == streamed
    import huggingface_hub.constants
    from huggingface_hub import InferenceClient

    monkeypatch.setattr(huggingface_hub.constants, "is_offline_mode", lambda: False)
    hf = InferenceClient(base_url=url)  # kept: the stream reads through the client's session
    for name in ("dummy", "tgi"):  # its default name (OpenAI's chunks, [DONE]) and TGI's (TGI's chunks)
        chunks_hf = hf.chat_completion(messages, model=name, max_tokens=8, temperature=0.0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks_hf if c.choices) == streamed, name
    with client.chat.completions.stream(
        model=SERVED_NAME,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0.0,
    ) as s:
        for _ in s:
            pass
        snap = s.current_completion_snapshot  # get_final_completion refuses a length finish
    assert snap.choices[0].message.role == "assistant" and snap.choices[0].message.content == streamed
