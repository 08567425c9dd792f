"""vLLM's `--tool-call-parser` names for the families beyond Hermes/Llama: granite (Granite 3.0's
`<|tool_call|>`, 3.1+'s `<tool_call>` before a JSON array), phi4_mini_json (Phi-4-mini's `functools[...]`)
and pythonic (Gemma 3 / Llama 3.2 pythonic templates), on outputs in each model's format (no server)."""

from __future__ import annotations

import json

import pytest

from server.api.tool_parsers import TOOL_PARSERS, ParsedCall, ParsedToolOutput
from server.config import TOOL_CALL_PARSERS, ServerConfig

TWO = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "Europe/Paris"})]
CALLS = {
    "granite": '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
    '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
    "granite-3.1": '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},'
    ' {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
    "phi4_mini_json": 'functools[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
    '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
    "pythonic": '[get_weather(city="Paris", unit="celsius"), get_time(tz="Europe/Paris")]',
}


def _parser(case: str):  # type: ignore[no-untyped-def]
    return TOOL_PARSERS[case.split("-")[0]]()


@pytest.mark.parametrize("case", sorted(CALLS))
def test_two_calls_streamed_and_whole(case: str) -> None:
    parser = _parser(case)
    out = parser.parse(CALLS[case], final=True)
    assert out.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == TWO
    # streaming: nothing is shown before the output ends, then the same calls
    for n in range(len(CALLS[case])):
        assert parser.parse(CALLS[case][:n], final=False) == ParsedToolOutput("")


@pytest.mark.parametrize("name", ["granite", "phi4_mini_json", "pythonic"])
def test_plain_text_stays_content(name: str) -> None:
    parser = TOOL_PARSERS[name]()
    text = "The weather in Paris is mild [citation needed]."
    assert parser.parse(text, final=True) == ParsedToolOutput(text)
    assert parser.parse(text[:20], final=False) == ParsedToolOutput(text[:20])
    assert ServerConfig(enable_auto_tool_choice=True, tool_call_parser=name).tool_call_parser == name
    assert name in TOOL_CALL_PARSERS


def test_cut_and_malformed_calls() -> None:
    granite = TOOL_PARSERS["granite"]()
    # cut by max_tokens inside the second call: the first whole, the second by the unfinished-call rule
    cut = CALLS["granite-3.1"][:-20]
    out = granite.parse(cut, final=True)
    assert out.calls[0] == ParsedCall("get_weather", json.dumps({"city": "Paris", "unit": "celsius"}))
    assert out.calls[1].name == "get_time" and out.calls[1].arguments == '{"tz'
    # an element that is not a call: the output is text
    bad = '<tool_call>[{"name": "get_time", "arguments": {}}, 3]'
    assert granite.parse(bad, final=True) == ParsedToolOutput(bad)
    # Phi-4-mini needs its marker; a bare array is text
    bare = '[{"name": "get_time", "arguments": {}}]'
    assert TOOL_PARSERS["phi4_mini_json"]().parse(bare, final=True) == ParsedToolOutput(bare)
    pythonic = TOOL_PARSERS["pythonic"]()
    # never evaluated: a non-literal argument or a positional one makes it text
    for text in ['[get_time(tz=__import__("os").getcwd())]', '[get_time("UTC")]', '[get_time(tz="UT']:
        assert pythonic.parse(text, final=True) == ParsedToolOutput(text)
    assert pythonic.parse("[get_time()]", final=True).calls == [ParsedCall("get_time", "{}")]
