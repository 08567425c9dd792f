"""Tool-call parsers for `tool_choice: "auto"`: the model's text -> content + tool calls, as vLLM's
`--tool-call-parser hermes` and `llama3_json` read them.

hermes (Hermes 2 Pro, Qwen2.5 and many fine-tunes): calls are `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`, any number of them; content is the text before the first call.
llama3_json (Llama 3.1/3.2 JSON tool calling): the whole output is `{"name": ..., "parameters": {...}}`,
optionally after `<|python_tag|>`, several separated by `;`.

A parser reads the whole text (`final=True`) or a prefix of it while streaming (`final=False`): then it
returns only what can no longer change (content that cannot turn into a call, calls already closed).
"""

from __future__ import annotations

import json
import re
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
            return ParsedToolOutput(text[: len(text) - _held_prefix(text, self.START)])
        content = text[:start]
        bodies = [m.group(1) for m in self._CALL.finditer(text, start)]
        if final:
            tail = text[text.rfind(self.END) + len(self.END) :] if bodies else text[start:]
            open_at = tail.find(self.START)
            if open_at != -1:  # a last call the model left unclosed (stopped by EOS)
                bodies.append(tail[open_at + len(self.START) :])
        calls = []
        for body in bodies:
            try:
                call = _call_from(json.loads(body.strip()), ("arguments", "parameters"))
            except json.JSONDecodeError:
                call = None
            if call is None:
                if final:  # malformed: the output is plain text, as vLLM's parser returns it
                    return ParsedToolOutput(text)
                continue
            calls.append(call)
        return ParsedToolOutput(content.rstrip() if calls else content, calls)


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
                return ParsedToolOutput(text)
            call = _call_from(obj, ("parameters", "arguments"))
            if call is None:
                return ParsedToolOutput(text)
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return ParsedToolOutput("", calls)


TOOL_PARSERS: dict[str, type[HermesToolParser] | type[Llama3JsonToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}
