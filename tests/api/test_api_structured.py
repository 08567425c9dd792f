"""Structured outputs and tool calling against the live server with the real clients: every sampled
output (temperature 1.0, 20 seeds) validates against its schema, regex and choice outputs always match,
a tool loop with the openai client, streamed tool-call deltas, TGI's grammar, and bad-input errors."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import re
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import httpx
import jsonschema
import openai
import pytest
from conftest import SERVED_NAME, LiveServer
from pydantic import BaseModel, Field
from text_generation import Client
from text_generation.types import Grammar, GrammarType

SEEDS = range(20)


class Role(enum.StrEnum):
    admin = "admin"
    user = "user"
    guest = "guest"


class Person(BaseModel):
    name: Annotated[str, Field(max_length=16)]
    age: Annotated[int, Field(ge=0, le=120)]
    role: Role


class Item(BaseModel):
    sku: Annotated[str, Field(max_length=8)]
    qty: Annotated[int, Field(ge=1, le=10)]


class Order(BaseModel):
    id: Annotated[int, Field(ge=1, le=9999)]
    items: Annotated[list[Item], Field(min_length=1, max_length=3)]
    paid: bool
    status: Literal["open", "shipped", "closed"]


class Reading(BaseModel):
    sensor: Annotated[str, Field(max_length=10)]
    celsius: Annotated[float, Field(ge=-50, le=60)]
    tags: Annotated[list[Annotated[str, Field(max_length=6)]], Field(max_length=2)]


CASES = [
    (Person, "Describe a fictional person as JSON."),
    (Order, "Write a small shop order as JSON."),
    (Reading, "Give one weather sensor reading as JSON."),
]

DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
IPV4 = r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"


def _client(live_server: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{live_server.url}/v1", api_key="x", max_retries=0, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "prompt"), CASES, ids=[c[0].__name__ for c in CASES])
def test_api_openai_parse_validates_20_seeds(
    live_server: LiveServer, model: type[BaseModel], prompt: str
) -> None:
    schema = model.model_json_schema()

    async def run() -> list[Any]:
        client = _client(live_server)
        return await asyncio.gather(
            *(
                client.chat.completions.parse(
                    model=SERVED_NAME,
                    messages=[{"role": "user", "content": prompt}],
                    response_format=model,
                    temperature=1.0,
                    seed=seed,
                    max_tokens=160,
                )
                for seed in SEEDS
            )
        )

    before = live_server.metric("kubeinfer_structured_output_requests_total", 0.0)
    completions = asyncio.run(run())
    texts = set()
    for c in completions:
        msg = c.choices[0].message
        assert c.choices[0].finish_reason == "stop"
        assert isinstance(msg.parsed, model)
        jsonschema.validate(json.loads(msg.content), schema)
        texts.add(msg.content)
    assert len(texts) > 5  # sampled, not one constant output
    assert live_server.metric("kubeinfer_structured_output_requests_total") >= before + len(SEEDS)
    assert live_server.metric("kubeinfer_structured_output_mask_seconds_total") > 0


@pytest.mark.slow
def test_api_regex_and_choice_both_apis(live_server: LiveServer) -> None:
    url = live_server.url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    for seed in range(4):
        chat = client.chat.completions.create(
            model=SERVED_NAME,
            messages=[{"role": "user", "content": "When was the Eiffel Tower finished?"}],
            temperature=1.0,
            seed=seed,
            max_tokens=20,
            extra_body={"structured_outputs": {"regex": DATE}},
        )
        assert re.fullmatch(DATE, chat.choices[0].message.content or "")
        cmpl = client.completions.create(
            model=SERVED_NAME,
            prompt="The server's IP address is",
            temperature=1.0,
            seed=seed,
            max_tokens=20,
            extra_body={"guided_regex": IPV4},
        )
        assert re.fullmatch(IPV4, cmpl.choices[0].text), cmpl.choices[0].text
        choices = ["positive", "negative", "neutral"]
        chat = client.chat.completions.create(
            model=SERVED_NAME,
            messages=[{"role": "user", "content": "Sentiment of 'I love it'?"}],
            temperature=1.0,
            seed=seed,
            max_tokens=10,
            extra_body={"guided_choice": choices},
        )
        assert chat.choices[0].message.content in choices
        cmpl = client.completions.create(
            model=SERVED_NAME,
            prompt="Answer yes or no:",
            temperature=1.0,
            seed=seed,
            max_tokens=5,
            extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
        )
        assert cmpl.choices[0].text in ("yes", "no")
    # the older vLLM spellings of a JSON schema and an EBNF grammar
    schema = Person.model_json_schema()
    cmpl = client.completions.create(
        model=SERVED_NAME,
        prompt="A person as JSON:",
        temperature=0,
        max_tokens=120,
        extra_body={"guided_json": schema},
    )
    jsonschema.validate(json.loads(cmpl.choices[0].text), schema)
    cmpl = client.completions.create(
        model=SERVED_NAME,
        prompt="Is Paris in France? Answer:",
        temperature=1.0,
        seed=0,
        max_tokens=5,
        extra_body={"guided_grammar": 'root ::= ("yes" | "no") "."'},
    )
    assert cmpl.choices[0].text in ("yes.", "no."), cmpl.choices[0].text
    # TGI: regex and JSON through the text-generation client's Grammar type.
    tgi = Client(url, timeout=120)
    for seed in range(3):
        r = tgi.generate(
            "Today's date is",
            max_new_tokens=20,
            do_sample=True,
            seed=seed,
            grammar=Grammar(type=GrammarType.Regex, value=DATE),
        )
        assert re.fullmatch(DATE, r.generated_text), r.generated_text
        schema = Person.model_json_schema()
        r = tgi.generate(
            "A person as JSON:",
            max_new_tokens=120,
            do_sample=True,
            seed=seed,
            grammar=Grammar(type=GrammarType.Json, value=schema),
        )
        jsonschema.validate(json.loads(r.generated_text), schema)
    events = [
        json.loads(line[5:])
        for line in httpx.post(
            f"{url}/generate_stream",
            json={
                "inputs": "Date:",
                "parameters": {"max_new_tokens": 20, "grammar": {"type": "regex", "value": DATE}},
            },
            timeout=60,
        ).text.splitlines()
        if line.startswith("data:")
    ]
    assert re.fullmatch(DATE, events[-1]["generated_text"])


def test_api_structured_greedy_mixed_batch_and_length(live_server: LiveServer) -> None:
    """A constrained request next to free ones leaves the free ones' greedy text unchanged; a constrained
    request cut by max_tokens ends with length (incomplete JSON, as in vLLM)."""
    url = live_server.url
    ref = live_server.refs["chat"]

    async def run() -> list[Any]:
        client = _client(live_server)
        free = client.chat.completions.create(
            model=SERVED_NAME,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=len(ref.token_ids),
        )
        constrained = client.chat.completions.create(
            model=SERVED_NAME,
            messages=[{"role": "user", "content": "JSON please"}],
            temperature=0,
            max_tokens=4,
            response_format={"type": "json_object"},
        )
        return list(await asyncio.gather(free, constrained, free))

    a, c, b = asyncio.run(run())
    assert a.choices[0].message.content == ref.text == b.choices[0].message.content
    assert c.choices[0].finish_reason == "length"
    assert (c.choices[0].message.content or "").startswith("{")
    del url


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 24}},
            "required": ["timezone"],
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.mark.slow
def test_api_tool_loop_required_named_and_stream(live_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="x", max_retries=0, timeout=120)
    messages: list[Any] = [{"role": "user", "content": "What's the weather in Paris?"}]
    common: dict[str, Any] = {
        "model": SERVED_NAME,
        "tools": [WEATHER, TIME],
        "temperature": 1.0,
        "max_tokens": 200,
    }
    first = client.chat.completions.create(messages=messages, tool_choice="required", seed=1, **common)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls
    for call in calls:
        assert call.id and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    # Streaming the same seeded request: the deltas reassemble to the same calls.
    stream = client.chat.completions.create(
        messages=messages, tool_choice="required", seed=1, stream=True, **common
    )
    got: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        ch = chunk.choices[0]
        finish = ch.finish_reason or finish
        for tc in ch.delta.tool_calls or []:
            c = got.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            if tc.id:
                c["id"], c["name"] = tc.id, tc.function.name
            c["arguments"] += tc.function.arguments or ""
    assert finish == "tool_calls"
    assert [(got[i]["name"], json.loads(got[i]["arguments"])) for i in sorted(got)] == [
        (c.function.name, json.loads(c.function.arguments)) for c in calls
    ]
    # The tool result goes back as a tool message; the next turn completes as text.
    messages.append(choice.message.model_dump(exclude_none=True))
    for call in calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 18})})
    final = client.chat.completions.create(messages=messages, tool_choice="none", seed=1, **common)
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    # A named function: always that function, arguments valid; streamed arguments come in pieces.
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(3):
        r = client.chat.completions.create(messages=messages[:1], tool_choice=named, seed=seed, **common)
        (call,) = r.choices[0].message.tool_calls or []
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_time"])
    pieces = [
        tc
        for chunk in client.chat.completions.create(
            messages=messages[:1], tool_choice=named, seed=0, stream=True, **common
        )
        for tc in (chunk.choices[0].delta.tool_calls if chunk.choices else None) or []
    ]
    assert pieces[0].id and pieces[0].function.name == "get_time"
    assert all(p.id is None for p in pieces[1:]) and len(pieces) > 2
    args = "".join(p.function.arguments or "" for p in pieces)
    jsonschema.validate(json.loads(args), SCHEMAS["get_time"])
    # parallel_tool_calls=false: exactly one call.
    r = client.chat.completions.create(
        messages=messages[:1], tool_choice="required", parallel_tool_calls=False, seed=5, **common
    )
    assert len(r.choices[0].message.tool_calls or []) == 1


@pytest.fixture
def auto_tools(live_server: LiveServer) -> Iterator[None]:
    state = live_server.state
    saved = state.config
    state.config = dataclasses.replace(saved, enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield
    state.config = saved


def test_api_tool_choice_auto_needs_flags_then_parses(live_server: LiveServer, auto_tools: None) -> None:
    client = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="x", max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER],
        temperature=0,
        max_tokens=60,
    )
    msg = r.choices[0].message
    # Whatever the small model writes, the response is well formed: calls (valid JSON) or plain text.
    if msg.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls"
        assert all(json.loads(c.function.arguments) is not None for c in msg.tool_calls)
    else:
        assert r.choices[0].finish_reason in ("stop", "length") and msg.content is not None


def _err(r: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text
    return dict(r.json()["error"])


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "foo"}},
                }
            },
            "response_format",
            "foo",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "xml"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "regex"),
        ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar", "grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        (
            {"structured_outputs": {"structural_tag": "x"}},
            "structured_outputs.structural_tag",
            "structural_tag",
        ),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"guided_json": "{not json"}, "guided_json", "JSON"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "one"),
        ({"tool_choice": "required"}, "tool_choice", "requires tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
        ({"tools": [WEATHER]}, "tool_choice", "--enable-auto-tool-choice"),
        (
            {"tools": [{"type": "function", "function": {}}], "tool_choice": "required"},
            "tools[0].function.name",
            "name",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
        ({"guided_regex": "a", "ignore_eos": True}, None, "ignore_eos"),
    ],
)
def test_api_structured_bad_input_400(
    live_server: LiveServer, body: dict, param: str | None, fragment: str
) -> None:
    before = live_server.llm.scheduler.stats().num_prompt_tokens
    err = _err(
        httpx.post(
            f"{live_server.url}/v1/chat/completions",
            json={"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], **body},
            timeout=60,
        )
    )
    assert err["type"] == "BadRequestError" and fragment in err["message"]
    if param is not None:
        assert err["param"] == param
    assert live_server.llm.scheduler.stats().num_prompt_tokens == before  # never reached the engine
