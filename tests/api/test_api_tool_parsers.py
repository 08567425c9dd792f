"""Tool-call parsers and the streamed tool-call deltas, on real-format model outputs (no server)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from server.api.structured import ToolPlan, ToolStream, _closed_items
from server.api.tool_parsers import HermesToolParser, Llama3JsonToolParser, ParsedCall

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]

HERMES_TWO = (
    "Let me check both.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'
)


def test_hermes_two_calls_and_content() -> None:
    out = HermesToolParser().parse(HERMES_TWO, final=True)
    assert out.content == "Let me check both."
    assert [c.name for c in out.calls] == ["get_weather", "get_time"]
    assert json.loads(out.calls[0].arguments) == {"city": "Paris", "unit": "celsius"}
    assert json.loads(out.calls[1].arguments) == {"tz": "Europe/Paris"}


def test_hermes_plain_text_unclosed_and_malformed() -> None:
    p = HermesToolParser()
    assert p.parse("The weather is nice.", final=True).calls == []
    assert p.parse("The weather is nice.", final=True).content == "The weather is nice."
    # The model stopped (EOS) before writing </tool_call>: the last call still counts.
    out = p.parse('<tool_call>\n{"name": "get_time", "arguments": {}}\n', final=True)
    assert out.calls == [ParsedCall("get_time", "{}")]
    # Malformed JSON inside a call: the whole output is text, no calls (vLLM's behaviour).
    bad = '<tool_call>\n{"name": "get_time", "arguments": {"tz": }\n</tool_call>'
    out = p.parse(bad, final=True)
    assert out.calls == [] and out.content == bad
    # A call without a name is not a call.
    assert p.parse('<tool_call>{"arguments": {}}</tool_call>', final=True).calls == []
    # Arguments written as a JSON string are accepted and normalised to an object.
    out = p.parse('<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>', True)
    assert json.loads(out.calls[0].arguments) == {"tz": "UTC"}


def test_hermes_partial_holds_back_marker() -> None:
    p = HermesToolParser()
    assert p.parse("Sure <tool_", final=False).content == "Sure "
    assert p.parse('Sure <tool_call>{"name": "get_', final=False).content == "Sure "
    assert p.parse('Sure <tool_call>{"name": "get_', final=False).calls == []
    half = HERMES_TWO[: HERMES_TWO.index("</tool_call>") + len("</tool_call>") + 5]
    assert [c.name for c in p.parse(half, final=False).calls] == ["get_weather"]


def test_llama3_json() -> None:
    p = Llama3JsonToolParser()
    one = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    out = p.parse(one, final=True)
    assert out.content == "" and out.calls == [ParsedCall("get_weather", '{"city": "Oslo"}')]
    two = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'
    assert [c.name for c in p.parse(two, final=True).calls] == ["get_weather", "get_time"]
    assert p.parse("It is sunny.", final=True).calls == []
    bad = '{"name": "get_weather", "parameters": {"city": '
    assert p.parse(bad, final=True).calls == [] and p.parse(bad, final=True).content == bad
    assert p.parse('{"name": "get_weather"', final=False).content == ""  # held while it may be a call


def _reassemble(deltas: list[dict[str, Any]]) -> tuple[str, list[dict[str, str]]]:
    """What a client (e.g. the openai SDK's stream helpers) rebuilds from delta fragments."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            c = calls.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
            if "id" in tc:
                assert not c["id"], "id sent twice"
                c["id"] = tc["id"]
                c["name"] = tc["function"]["name"]
            c["arguments"] += tc["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 3, 7])
def test_stream_auto_hermes_matches_whole_parse(size: int) -> None:
    plan = ToolPlan("auto", TOOLS, parser=HermesToolParser())
    stream = ToolStream(plan)
    pieces = _pieces(HERMES_TWO, size)
    deltas = [stream.feed(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
    content, calls = _reassemble(deltas)
    whole = plan.parse(HERMES_TWO)
    assert content.strip() == whole.content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c.name, json.loads(c.arguments)) for c in whole.calls
    ]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in calls)


def test_stream_required_and_named() -> None:
    text = '[{"name": "get_weather", "parameters": {"city": "a]b{"}}, {"name": "get_time", "parameters": {}}]'
    assert len(_closed_items(text)) == 2
    plan = ToolPlan("required", TOOLS)
    stream = ToolStream(plan)
    pieces = _pieces(text, 4)
    _, calls = _reassemble([stream.feed(p, i == len(pieces) - 1) for i, p in enumerate(pieces)])
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "a]b{"}),
        ("get_time", {}),
    ]
    named = ToolPlan("named", TOOLS, name="get_time", parallel=False)
    stream = ToolStream(named)
    args = '{"tz": "UTC"}'
    pieces = _pieces(args, 3)
    _, calls = _reassemble([stream.feed(p, i == len(pieces) - 1) for i, p in enumerate(pieces)])
    assert calls == [{"id": calls[0]["id"], "name": "get_time", "arguments": args}]


def test_required_grammar_schema_shape() -> None:
    spec = ToolPlan("required", TOOLS, parallel=False).grammar()
    assert spec is not None and spec.kind == "json"
    schema = json.loads(spec.value)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert [it["properties"]["name"]["enum"] for it in schema["items"]["anyOf"]] == [
        ["get_weather"],
        ["get_time"],
    ]
