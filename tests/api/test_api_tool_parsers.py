"""Tool-call parsers and the streamed tool-call deltas, on real-format model outputs (no server)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from server.api.structured import ToolPlan, ToolStream, _scan_array
from server.api.tool_parsers import HermesToolParser, Llama3JsonToolParser, ParsedCall, ParsedToolOutput

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
    # Trailing whitespace is held back too: a call after it strips it from the content.
    assert p.parse("Sure <tool_", final=False).content == "Sure"
    assert p.parse('Sure <tool_call>{"name": "get_', final=False).content == "Sure"
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
    # Cut inside the arguments: a call with the argument text so far (the unfinished-call rule).
    assert p.parse(bad, final=True) == ParsedToolOutput("", [ParsedCall("get_weather", '{"city":')])
    assert p.parse('{"name": "get_wea', final=True).content == '{"name": "get_wea'  # no name: text
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
    assert len(_scan_array(text).closed) == 2 and _scan_array(text).open_item is None
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


REQUIRED_TWO = (
    '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
    '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}]'
)
LLAMA3_TWO = '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'
HERMES_BAD_THEN_GOOD = (
    'On it.\n<tool_call>{"name": "get_time", "arguments": {"tz": }}</tool_call>\n'
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
)
MODES = {
    "required": (ToolPlan("required", TOOLS), REQUIRED_TWO),
    "named": (ToolPlan("named", TOOLS, name="get_time", parallel=False), '{"tz": "Europe/Paris"}'),
    "auto-hermes": (ToolPlan("auto", TOOLS, parser=HermesToolParser()), HERMES_TWO),
    "auto-hermes-malformed": (ToolPlan("auto", TOOLS, parser=HermesToolParser()), HERMES_BAD_THEN_GOOD),
    "auto-hermes-one": (ToolPlan("auto", TOOLS, parser=HermesToolParser(), parallel=False), HERMES_TWO),
    "auto-llama3": (ToolPlan("auto", TOOLS, parser=Llama3JsonToolParser()), LLAMA3_TWO),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_stream_equals_unary_at_every_cut(mode: str) -> None:
    """Every prefix of the output is a possible max_tokens cut: streamed in pieces of 1 and 5
    characters, the deltas rebuild exactly the unary reply's content and calls (names and argument
    text), whether the last call is complete, unfinished or not begun."""
    plan, text = MODES[mode]
    for cut in range(len(text) + 1):
        out = text[:cut]
        whole = plan.parse(out)
        for size in (1, 5):
            stream = ToolStream(plan)
            pieces = _pieces(out, size) or [""]
            content, calls = _reassemble([stream.feed(p, i == len(pieces) - 1) for i, p in enumerate(pieces)])
            assert content == whole.content, (cut, size)
            assert [(c["name"], c["arguments"]) for c in calls] == [
                (c.name, c.arguments) for c in whole.calls
            ], (
                cut,
                size,
            )
    # The unfinished-call rule, spot-checked: cut inside the second call's arguments, it is a call with
    # the argument text so far; cut inside its name, it is dropped.
    if mode == "required":
        cut_args = REQUIRED_TWO[: REQUIRED_TWO.index('"Europe')]
        assert plan.parse(cut_args).calls[1] == ParsedCall("get_time", '{"tz":')
        assert len(plan.parse(REQUIRED_TWO[: REQUIRED_TWO.index("get_time") + 3]).calls) == 1
    if mode == "auto-hermes-malformed":  # a malformed call is dropped, the good one stays, streamed or not
        assert [c.name for c in plan.parse(text).calls] == ["get_weather"]
