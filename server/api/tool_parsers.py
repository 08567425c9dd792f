"""Tool-call parsers for `tool_choice: "auto"`: the model's text -> content + tool calls, as vLLM's
`--tool-call-parser hermes`, `llama3_json`, `granite`, `phi4_mini_json` and `pythonic` read them.

hermes (Hermes 2 Pro, Qwen2.5 and many fine-tunes): calls are `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`, any number of them; content is the text before the first call.
llama3_json (Llama 3.1/3.2 JSON tool calling): the whole output is `{"name": ..., "parameters": {...}}`,
optionally after `<|python_tag|>`, several separated by `;`.

granite (Granite 3.x), phi4_mini_json (Phi-4-mini), pythonic (Gemma 3 and Llama 3.2 with pythonic
templates): the classes below say their formats.

A parser reads the whole text (`final=True`) or a prefix of it while streaming (`final=False`): then it
returns only what can no longer change (content that cannot turn into a call, calls already closed), so
a stream's deltas add up to the final parse: the same calls, streamed or not (tests/api/test_api_tool_stream.py).

One rule for a call the output leaves unfinished (cut by max_tokens, or the model stopped inside it),
whatever the mode and the finish reason: once its name is complete it is a call whose `arguments` are
the argument text generated so far (possibly not valid JSON; finish_reason says "length"), as OpenAI
returns a call cut by max_tokens and as vLLM returns a named call; cut before its name ends, it is
dropped. A closed call that is malformed is dropped; an output with no call at all is plain content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class ParsedToolOutput:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


class ToolParser(Protocol):
    def parse(self, text: str, final: bool) -> ParsedToolOutput: ...


def _call_from(obj: Any, args_keys: tuple[str, ...]) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    for key in args_keys:
        if key in obj:
            args = obj[key]
            if isinstance(args, str):  # some models write the arguments as a JSON string
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    return None
            if not isinstance(args, dict):
                return None
            return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))
    return ParsedCall(obj["name"], "{}")


_PARTIAL = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*(?:,\s*"(\w+)"\s*:\s*(.*))?', re.DOTALL)


def partial_call(text: str, args_keys: tuple[str, ...]) -> ParsedCall | None:
    """An unfinished call object `{"name": "f", "<args key>": {...` -> ParsedCall(f, the argument text
    so far, right-stripped; "" before any); None when its name is not complete yet or it is not a call."""
    m = _PARTIAL.match(text)
    if m is None:
        return None
    try:
        name = json.loads(m.group(1))
    except json.JSONDecodeError:
        return None
    if not name or (m.group(2) is not None and m.group(2) not in args_keys):
        return None
    return ParsedCall(name, (m.group(3) or "").rstrip())


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker (text to hold back)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class HermesToolParser:
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        start = text.find(self.START)
        if start == -1:
            if final:
                return ParsedToolOutput(text)
            # Trailing whitespace is held back too: before a call it is stripped from the content.
            return ParsedToolOutput(text[: len(text) - _held_prefix(text, self.START)].rstrip())
        content = text[:start]
        bodies = [m.group(1) for m in self._CALL.finditer(text, start)]
        unclosed = None
        if final:
            tail = text[text.rfind(self.END) + len(self.END) :] if bodies else text[start:]
            open_at = tail.find(self.START)
            if open_at != -1:  # a last call left unclosed (stopped by EOS or cut by max_tokens)
                unclosed = tail[open_at + len(self.START) :]
        keys = ("arguments", "parameters")
        calls = []
        for body in bodies:
            try:
                call = _call_from(json.loads(body.strip()), keys)
            except json.JSONDecodeError:
                call = None
            if call is not None:  # a malformed closed call is dropped (streamed or not)
                calls.append(call)
        if unclosed is not None:
            try:
                call = _call_from(json.loads(unclosed.strip()), keys)
            except json.JSONDecodeError:
                call = partial_call(unclosed, keys)
            if call is not None:
                calls.append(call)
        if final and not calls:  # no call at all: the output is plain text, as vLLM's parser returns it
            return ParsedToolOutput(text)
        return ParsedToolOutput(content.rstrip(), calls)


class Llama3JsonToolParser:
    TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        body = text.lstrip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].lstrip()
        if not body.startswith("{"):
            if not final and (not body or self.TAG.startswith(body)):
                return ParsedToolOutput("")
            return ParsedToolOutput(text)
        if not final:  # a JSON call is being written: nothing is known until it ends
            return ParsedToolOutput("")
        decoder = json.JSONDecoder()
        calls, pos = [], 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                cut = partial_call(body[pos:], ("parameters", "arguments"))
                if cut is None:
                    return ParsedToolOutput(text)
                calls.append(cut)
                break
            call = _call_from(obj, ("parameters", "arguments"))
            if call is None:
                return ParsedToolOutput(text)
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return ParsedToolOutput("", calls)


class _JsonListToolParser:
    """An output that is one JSON array of calls after a marker (`MARKERS`, any one or none when
    `BARE_OK`): vLLM's `granite` (Granite 3.0 `<|tool_call|>[...]`, 3.1+ `<tool_call>[...]`, each
    `{"name", "arguments"}`) and `phi4_mini_json` (Phi-4-mini's `functools[...]`). While streaming,
    nothing is known until it ends (as llama3_json); a last call cut off inside the array keeps the
    module's unfinished-call rule; any other output is plain content."""

    MARKERS: tuple[str, ...] = ()
    BARE_OK = True
    KEYS = ("arguments", "parameters")

    def _body(self, text: str) -> str | None:
        body = text.strip()
        for marker in self.MARKERS:
            if body.startswith(marker):
                return body[len(marker) :].lstrip()
        return body if self.BARE_OK else None

    def _may_become_call(self, text: str) -> bool:
        body = text.lstrip()
        if not body:
            return True
        if any(m.startswith(body) or body.startswith(m) for m in self.MARKERS):
            return True
        return self.BARE_OK and body.startswith("[")

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        if not final:
            return ParsedToolOutput("" if self._may_become_call(text) else text)
        body = self._body(text)
        if body is None or not body.startswith("["):
            return ParsedToolOutput(text)
        try:
            items = json.loads(body)
        except json.JSONDecodeError:
            return self._cut(text, body)
        if not isinstance(items, list):
            return ParsedToolOutput(text)
        calls = [_call_from(item, self.KEYS) for item in items]
        if not calls or any(c is None for c in calls):
            return ParsedToolOutput(text)
        return ParsedToolOutput("", [c for c in calls if c is not None])

    def _cut(self, text: str, body: str) -> ParsedToolOutput:
        """The array left unclosed: the complete calls, then the last one by the unfinished-call rule."""
        decoder = json.JSONDecoder()
        calls, pos = [], 1
        while True:
            while pos < len(body) and body[pos] in " \t\r\n,":
                pos += 1
            if pos >= len(body) or body[pos] == "]":
                break
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                cut = partial_call(body[pos:], self.KEYS)
                if cut is not None:
                    calls.append(cut)
                break
            call = _call_from(obj, self.KEYS)
            if call is None:
                return ParsedToolOutput(text)
            calls.append(call)
        return ParsedToolOutput("", calls) if calls else ParsedToolOutput(text)


class GraniteToolParser(_JsonListToolParser):
    MARKERS = ("<|tool_call|>", "<tool_call>")


class Phi4MiniJsonToolParser(_JsonListToolParser):
    MARKERS = ("functools",)
    BARE_OK = False


class PythonicToolParser:
    """vLLM's `pythonic` (Llama 3.2/4 and Gemma 3 with a pythonic tool template): the output is one
    Python list of calls with keyword arguments of literal values, `[get_weather(city="Paris"),
    get_time()]`, read with `ast` (never evaluated). While streaming, nothing is known until it ends;
    an output that does not parse as such a list (a cut-off call included: its arguments are not JSON
    text) is plain content."""

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        import ast

        body = text.strip()
        if not final:
            return ParsedToolOutput("" if not body or body.startswith("[") else text)
        if not body.startswith("["):
            return ParsedToolOutput(text)
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            return ParsedToolOutput(text)
        if not isinstance(tree, ast.List) or not tree.elts:
            return ParsedToolOutput(text)
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return ParsedToolOutput(text)
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            except ValueError:
                return ParsedToolOutput(text)
            if len(args) != len(node.keywords):  # **kwargs
                return ParsedToolOutput(text)
            calls.append(ParsedCall(node.func.id, json.dumps(args, ensure_ascii=False)))
        return ParsedToolOutput("", calls)


def _harmony_parser() -> ToolParser:
    from .harmony import HarmonyToolParser  # harmony.py imports this module's types

    return HarmonyToolParser()


TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "granite": GraniteToolParser,
    "phi4_mini_json": Phi4MiniJsonToolParser,
    "pythonic": PythonicToolParser,
    "openai": _harmony_parser,  # gpt-oss: calls out of harmony's commentary channel (harmony.py)
}
