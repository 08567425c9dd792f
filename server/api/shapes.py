"""Nested request objects, closed by name as top-level fields are (`protocol.parse`): every key of a
tool definition, a message content part, a replayed tool call, a `tool_choice` object or TGI's
`grammar` is either served or refused with a 400/422 naming its path (`tools[0].function.foo`).

The shapes are the peers' own: OpenAI's chat `tools` (`{type: "function", function: {name,
description, parameters, strict}}`), content parts (`{type: "text", text}`; image, audio and file
parts are refused by type: this server reads text), assistant `tool_calls` (`{id, type, function:
{name, arguments}}`, plus TGI's `function.description` and the streamed `index` real clients replay),
TGI's `GrammarType` (serde tag `type`, content `value`) and the Responses API's function tools and
input items. A null asks for nothing, as everywhere (`protocol.NullIsUnset`).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import Any, Protocol

from .errors import validation

CHAT_TOOL_KEYS = ("type", "function")
FUNCTION_KEYS = ("name", "description", "parameters", "strict")
TEXT_PART_KEYS = ("type", "text")
TOOL_CALL_KEYS = ("id", "type", "function", "index")
TOOL_CALL_FUNCTION_KEYS = ("name", "arguments", "description")
TOOL_CHOICE_KEYS = ("type", "function")
TOOL_CHOICE_FUNCTION_KEYS = ("name",)
GRAMMAR_KEYS = ("type", "value")
# OpenAI's content part types this server does not read (it serves text models).
MEDIA_PARTS = ("image_url", "input_audio", "file", "input_image", "input_file")


def refuse_unknown(obj: dict[str, Any], allowed: Collection[str], path: str, tgi: bool = False) -> None:
    """Raises a validation APIError naming `path.key` for the first key of `obj` outside `allowed`
    whose value is not null (a null asks for nothing)."""
    unknown = sorted(k for k, v in obj.items() if k not in allowed and v is not None)
    if unknown:
        where = f"{path}.{unknown[0]}"
        prefix = "Input validation error: " if tgi else ""
        raise validation(f"{prefix}{where} is not supported (known: {', '.join(allowed)})", where)


def require_object(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise validation(f"{path} must be an object", path)
    return value


def check_strict(value: Any, path: str) -> bool:
    """A function's `strict` flag: a boolean (null is false)."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise validation(f"{path} must be a boolean", path)
    return value


def check_chat_tool(tool: Any, path: str) -> dict[str, Any]:
    """One chat `tools` item: `{"type": "function", "function": {name, description, parameters,
    strict}}`. Returns the function object. Raises a validation APIError naming the offending path."""
    tool = require_object(tool, path)
    refuse_unknown(tool, CHAT_TOOL_KEYS, path)
    kind = tool.get("type")
    if kind != "function":
        raise validation(f"{path}.type {kind!r} is not supported (function)", f"{path}.type")
    fn = require_object(tool.get("function"), f"{path}.function")
    refuse_unknown(fn, FUNCTION_KEYS, f"{path}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise validation(f"{path}.function.name is required", f"{path}.function.name")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise validation(f"{path}.function.description must be a string", f"{path}.function.description")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise validation(
            f"{path}.function.parameters must be a JSON schema object", f"{path}.function.parameters"
        )
    check_strict(fn.get("strict"), f"{path}.function.strict")
    return fn


def check_chat_tool_choice(choice: dict[str, Any]) -> str:
    """An object `tool_choice`: `{"type": "function", "function": {"name": ...}}`; returns the name."""
    refuse_unknown(choice, TOOL_CHOICE_KEYS, "tool_choice")
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise validation(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    assert isinstance(fn, dict)
    refuse_unknown(fn, TOOL_CHOICE_FUNCTION_KEYS, "tool_choice.function")
    return name


def chat_content_text(content: str | list[Any] | None, role: str, path: str) -> str:
    """A chat message's `content` as text: a string, or text parts joined (an assistant's `refusal`
    part reads as its text, as the Responses route reads it). Any other part type is refused by
    name: an image the model never saw would be answered as if it had."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        where = f"{path}.content[{j}]"
        part = require_object(part, where)
        kind = part.get("type")
        if kind == "text":
            refuse_unknown(part, TEXT_PART_KEYS, where)
            if not isinstance(part.get("text"), str):
                raise validation(f"{where}.text must be a string", f"{where}.text")
            texts.append(part["text"])
        elif kind == "refusal" and role == "assistant":
            refuse_unknown(part, ("type", "refusal"), where)
            if not isinstance(part.get("refusal"), str):
                raise validation(f"{where}.refusal must be a string", f"{where}.refusal")
            texts.append(part["refusal"])
        else:
            what = "this server reads text only" if kind in MEDIA_PARTS else "text parts only"
            raise validation(f"{where}.type {kind!r} is not supported ({what})", f"{where}.type")
    return "".join(texts)


def check_history_tool_call(call: Any, path: str) -> tuple[Any, str, Any]:
    """An assistant message's replayed tool call -> (id, function name, arguments as sent). `id` may
    be a string or TGI's integer; `arguments` a JSON string (OpenAI) or an object (TGI)."""
    call = require_object(call, path)
    refuse_unknown(call, TOOL_CALL_KEYS, path)
    if call.get("type") not in (None, "function"):
        raise validation(f"{path}.type {call['type']!r} is not supported (function)", f"{path}.type")
    if call.get("id") is not None and (isinstance(call["id"], bool) or not isinstance(call["id"], str | int)):
        raise validation(f"{path}.id must be a string", f"{path}.id")
    fn = require_object(call.get("function"), f"{path}.function")
    refuse_unknown(fn, TOOL_CALL_FUNCTION_KEYS, f"{path}.function")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise validation(f"{path}.function.name is required", f"{path}.function.name")
    return call.get("id"), fn["name"], fn.get("arguments", "{}")


def check_grammar(grammar: Any, path: str, tgi: bool) -> tuple[str, Any]:
    """TGI's `GrammarType`: `{"type": ..., "value": ...}` -> (type, value); other keys refused."""
    if not isinstance(grammar, dict) or "type" not in grammar:
        prefix = "Input validation error: " if tgi else ""
        raise validation(f'{prefix}`{path}` must be {{"type": ..., "value": ...}}', path)
    refuse_unknown(grammar, GRAMMAR_KEYS, path, tgi=tgi)
    return grammar["type"], grammar.get("value")


class _Message(Protocol):
    @property
    def role(self) -> str: ...
    @property
    def content(self) -> str | list[Any] | None: ...
    @property
    def name(self) -> str | None: ...
    @property
    def tool_call_id(self) -> str | None: ...
    @property
    def tool_calls(self) -> list[Any] | None: ...


def _history_tool_calls(calls: list[Any], path: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls for the template: arguments as an object (templates tojson it)."""
    out = []
    for k, c in enumerate(calls):
        where = f"{path}.tool_calls[{k}]"
        call_id, name, args = check_history_tool_call(c, where)
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise validation(
                    f"{where}.function.arguments must be JSON", f"{where}.function.arguments"
                ) from None
        out.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
    return out


def template_messages(messages: Sequence[_Message]) -> list[dict[str, Any]]:
    """Chat messages -> the chat template's message dicts (`developer` reads as `system`, as vLLM);
    every nested object checked by path (`messages[1].tool_calls[0].function.name`)."""
    out = []
    for i, m in enumerate(messages):
        path = f"messages[{i}]"
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": chat_content_text(m.content, m.role, path)}
        if m.name:
            msg["name"] = m.name
        if m.tool_calls:
            if role != "assistant":
                raise validation(
                    f"{path}.tool_calls: only assistant messages carry tool_calls", f"{path}.tool_calls"
                )
            msg["tool_calls"] = _history_tool_calls(m.tool_calls, path)
        if role == "tool" and not m.tool_call_id:
            raise validation(f"{path}: a tool message needs tool_call_id", f"{path}.tool_call_id")
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id  # passed to the template, as vLLM passes it
        out.append(msg)
    return out
