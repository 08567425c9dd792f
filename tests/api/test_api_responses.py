"""/v1/responses through the real `openai` SDK against a live server: greedy output equals the chat
route's (the same conversation through the same template), the stream's semantic events add up to
the unary response, stored responses are retrieved, listed, deleted and continued with
previous_response_id (tool outputs included), and refused fields are 400s naming them."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
from conftest import SERVED_NAME, LiveServer

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def _client(url: str, key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def _events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The raw SSE frames: each `event:` line must name its data's type."""
    out = []
    with httpx.stream("POST", f"{url}/v1/responses", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        event = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                assert data["type"] == event
                out.append(data)
    return out


def test_api_responses_sdk_create_stream_retrieve_delete(live_server: LiveServer) -> None:
    url = live_server.url
    client = _client(url)
    chat = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}],
        max_tokens=12,
        temperature=0.0,
    )
    r = client.responses.create(
        model=SERVED_NAME,
        instructions="Be brief.",
        input="Name a fruit.",
        max_output_tokens=12,
        temperature=0.0,
        top_p=1.0,
        metadata={"run": "a"},
        store=True,
        service_tier="default",
    )
    # The same conversation through the same template: the chat route's greedy text.
    assert r.output_text == chat.choices[0].message.content
    assert r.object == "response" and r.id.startswith("resp_") and r.model == SERVED_NAME
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    if r.status == "incomplete":
        assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.metadata == {"run": "a"} and r.instructions == "Be brief." and r.store is True
    # Streamed: the semantic event sequence, numbered, adding up to the same text.
    events = _events(
        url,
        {
            "model": SERVED_NAME,
            "instructions": "Be brief.",
            "input": "Name a fruit.",
            "max_output_tokens": 12,
            "temperature": 0.0,
        },
    )
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if r.status == "completed" else "response.incomplete",
    ]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == r.output_text == events[-4]["text"]
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == r.output_text and final["usage"]["output_tokens"] > 0
    # The SDK's stream helper accepts the sequence and rebuilds the same response.
    with client.responses.stream(
        model=SERVED_NAME,
        instructions="Be brief.",
        input="Name a fruit.",
        max_output_tokens=12,
        temperature=0.0,
    ) as stream:
        got = "".join(ev.delta for ev in stream if ev.type == "response.output_text.delta")
        assert got == r.output_text and stream.get_final_response().output_text == r.output_text
    # Stored: retrieve, list the input items, delete; then 404 in OpenAI's shape.
    again = client.responses.retrieve(r.id)
    assert again.output_text == r.output_text and again.id == r.id
    items = client.responses.input_items.list(r.id, order="asc")
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Name a fruit.")]
    assert client.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(r.id)
    assert e.value.body["param"] == "response_id"  # type: ignore[index]
    # store: false keeps nothing.
    r2 = client.responses.create(model=SERVED_NAME, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r2.id)
    # vLLM's sampling extras: ignore_eos runs to max_output_tokens, stop ends the text before its
    # stop string, seed repeats a sampled output.
    long = client.responses.create(
        model=SERVED_NAME, input="Hi", max_output_tokens=20, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert long.usage is not None and long.usage.output_tokens == 20 and long.status == "incomplete"
    word = long.output_text.split()[1]
    cut = client.responses.create(
        model=SERVED_NAME, input="Hi", max_output_tokens=20, temperature=0.0, extra_body={"stop": [word]}
    )
    assert cut.status == "completed" and long.output_text.startswith(cut.output_text)
    assert word not in cut.output_text
    a, b = (
        client.responses.create(
            model=SERVED_NAME, input="Hi", max_output_tokens=12, temperature=1.0, extra_body={"seed": 7}
        )
        for _ in range(2)
    )
    assert a.output_text == b.output_text
    # A cancel of a response that was not in the background: 400 (only background ones can be cancelled).
    r3 = client.responses.create(model=SERVED_NAME, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(r3.id)


def test_api_responses_store_is_per_api_key(live_server: LiveServer) -> None:
    alice, bob = _client(live_server.url, "alice"), _client(live_server.url, "bob")
    r = alice.responses.create(model=SERVED_NAME, input="Hi", max_output_tokens=2)
    assert alice.responses.retrieve(r.id).id == r.id
    for call in (
        lambda: bob.responses.retrieve(r.id),
        lambda: bob.responses.delete(r.id),
        lambda: bob.responses.input_items.list(r.id),
        lambda: bob.responses.create(model=SERVED_NAME, input="Go on", previous_response_id=r.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert alice.responses.retrieve(r.id).id == r.id  # bob's delete did nothing


def test_api_responses_tools_through_previous_response_id(live_server: LiveServer) -> None:
    client = _client(live_server.url)
    named = {"type": "function", "name": "get_weather"}
    first = client.responses.create(
        model=SERVED_NAME,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice=named,  # type: ignore[arg-type]
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=1.0,
    )
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # Streamed, the arguments arrive as deltas that add up to the done event's.
    events = _events(
        live_server.url,
        {
            "model": SERVED_NAME,
            "input": "Weather?",
            "tools": [WEATHER],
            "tool_choice": named,
            "max_output_tokens": 60,
            "temperature": 0.0,
        },
    )
    kinds = [e["type"] for e in events]
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert done["arguments"] == args and done["name"] == "get_weather"
    assert events[-1]["response"]["output"][0]["type"] == "function_call"
    # The tool's output goes back through previous_response_id; the answer continues the stored
    # conversation: the prompt holds the call and its output.
    second = client.responses.create(
        model=SERVED_NAME,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 18}'}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="none",
        max_output_tokens=8,
        temperature=0.0,
    )
    assert second.previous_response_id == first.id and second.output[0].type == "message"
    # The same conversation sent whole gives the same prompt and answer.
    whole = client.responses.create(
        model=SERVED_NAME,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 18}'},
        ],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="none",
        max_output_tokens=8,
        temperature=0.0,
    )
    assert whole.usage is not None and second.usage is not None
    assert whole.usage.input_tokens == second.usage.input_tokens and whole.output_text == second.output_text
    alone = client.responses.create(
        model=SERVED_NAME,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=1,  # type: ignore[list-item]
    )
    assert alone.usage is not None and second.usage.input_tokens > alone.usage.input_tokens + 10
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=SERVED_NAME, input="x", previous_response_id="resp_unknown")
    assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    # bounded, as the name is: at temperature 1 an unbounded integer once ran past max_output_tokens
    population: int = pydantic.Field(ge=0, le=99_999_999)


def test_api_responses_parse_text_format(live_server: LiveServer) -> None:
    client = _client(live_server.url)
    for seed_text in ("A city?", "Another city?"):
        r = client.responses.parse(
            model=SERVED_NAME, input=seed_text, text_format=City, max_output_tokens=120, temperature=1.0
        )
        assert isinstance(r.output_parsed, City)
    r = client.responses.create(
        model=SERVED_NAME, input="JSON please", text={"format": {"type": "json_object"}}, max_output_tokens=40
    )
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=SERVED_NAME, input="x", text={"verbosity": "low"})  # type: ignore[typeddict-item]
    assert "text.verbosity" in str(e.value)


def test_api_responses_refusals_name_the_field(live_server: LiveServer) -> None:
    url = live_server.url
    base = {"model": SERVED_NAME, "input": "hi", "max_output_tokens": 2}
    for extra, name in (
        ({"tools": [{"type": "web_search"}]}, "web_search"),
        ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "code_interpreter"),
        ({"tools": [{"type": "mcp", "server_label": "x"}]}, "mcp"),
        ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "file_search"),
        ({"background": True}, "background"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"conversation": "conv_1"}, "conversation"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input_image",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # SmolLM2's template takes none
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ):
        r = httpx.post(f"{url}/v1/responses", json={**base, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert name in err["message"] or name == err["param"], (extra, err)
    r = httpx.get(f"{url}/v1/responses/resp_nope", timeout=60)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


def test_api_responses_truncation_auto(live_server: LiveServer) -> None:
    client = _client(live_server.url)
    limit = live_server.state.limits.max_input_tokens
    words = len(live_server.llm.tokenizer.encode("word " * 100)) / 100
    long_turn = "word " * int(0.6 * limit / words)  # two such turns overflow, one fits
    conversation: list[Any] = [
        {"role": "user", "content": long_turn},
        {"role": "assistant", "content": long_turn},
        {"role": "user", "content": "Short question?"},
    ]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=SERVED_NAME, input=conversation, max_output_tokens=4)
    assert "must have less than" in str(e.value)
    r = client.responses.create(
        model=SERVED_NAME, input=conversation, max_output_tokens=4, truncation="auto", temperature=0.0
    )
    assert r.truncation == "auto" and r.usage is not None and r.usage.input_tokens < limit
    # The oldest turn went, nothing else: the same prompt as the conversation sent without it.
    rest = client.responses.create(
        model=SERVED_NAME, input=conversation[1:], max_output_tokens=4, temperature=0.0
    )
    assert rest.usage is not None and r.usage.input_tokens == rest.usage.input_tokens
    assert r.output_text == rest.output_text


def test_api_responses_routes_need_the_api_key() -> None:
    """The Responses routes follow --api-key as the other generation routes: 401 without it."""

    from serving import free_port, serve_in_thread

    from server.api.app import create_app
    from server.api.state import ServerState
    from server.config import ServerConfig

    port = free_port()
    state = ServerState(ServerConfig(host="127.0.0.1", port=port, api_key="sekret"))
    app = create_app(state, load_on_startup=False)  # the model never loads: enough for auth
    with serve_in_thread(app, port, until="listening") as running:
        url = running.url
        calls = [
            ("POST", "/v1/responses", {"input": "hi"}),
            ("GET", "/v1/responses/resp_x", None),
            ("DELETE", "/v1/responses/resp_x", None),
            ("GET", "/v1/responses/resp_x/input_items", None),
            ("POST", "/v1/responses/resp_x/cancel", None),
        ]
        for method, path, body in calls:
            r = httpx.request(method, f"{url}{path}", json=body, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError", (path, r.text)
            r = httpx.request(
                method, f"{url}{path}", json=body, headers={"Authorization": "Bearer sekret"}, timeout=30
            )
            assert r.status_code == (503 if method == "POST" and path == "/v1/responses" else 404), (
                path,
                r.text,
            )


def test_api_responses_disconnect_mid_stream_frees_the_request(live_server: LiveServer) -> None:
    """A client gone mid-stream: the engine request is aborted, its KV blocks and its admission slot
    freed, and nothing is stored."""
    import re
    import threading

    def aborts() -> float:
        text = httpx.get(f"{live_server.url}/metrics", timeout=60).text
        m = re.search(r'^vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)', text, re.M)
        return float(m.group(1)) if m else 0.0

    before = aborts()
    body = {"model": SERVED_NAME, "input": "Tell a long story.", "max_output_tokens": 400, "stream": True}
    body["extra"] = None  # an undeclared field set to null is accepted
    rid = None
    with httpx.stream("POST", f"{live_server.url}/v1/responses", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                rid = rid or event["response"]["id"]
                if event["type"] == "response.output_text.delta":
                    break  # the client goes away after the first token
    for _ in range(600):
        if aborts() == before + 1 and live_server.metric("vllm:num_requests_running") == 0:
            break
        threading.Event().wait(0.1)
    assert aborts() == before + 1
    assert live_server.metric("vllm:kv_cache_usage_perc") == 0 and live_server.state.in_flight == 0
    assert httpx.get(f"{live_server.url}/v1/responses/{rid}", timeout=60).status_code == 404


def test_api_responses_engine_failure_is_failed(
    live_server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request the engine fails (here: its grammar state, injected): the stream ends with
    response.failed carrying the error, a unary call is a 500 in OpenAI's shape; blocks are freed."""
    structured = live_server.llm.runner.structured

    def fail(logits: Any, requests: list[Any]) -> dict[str, str]:
        return {
            r.request_id: "injected failure" for r in requests if r.sampling_params.structured is not None
        }

    monkeypatch.setattr(structured, "apply", fail)
    body = {
        "model": SERVED_NAME,
        "input": "JSON",
        "max_output_tokens": 20,
        "text": {"format": {"type": "json_object"}},
    }
    events = _events(live_server.url, body)
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    last = events[-1]
    assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
    assert "injected failure" in last["response"]["error"]["message"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    r = httpx.post(f"{live_server.url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
    assert live_server.metric("vllm:kv_cache_usage_perc") == 0
