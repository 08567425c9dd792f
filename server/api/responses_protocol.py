"""The Responses API's request body and its input items -> chat-template messages.

Format: OpenAI's `POST /v1/responses` (platform.openai.com/docs/api-reference/responses/create) as
vLLM serves it. Every declared field has a row in `fields.py`; an undeclared non-null field is refused
by name (`protocol.parse`), so hosted-only features (`conversation`, `prompt`, `max_tool_calls`, ...)
are 400s naming them.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import validation
from .protocol import RequestModel
from .shapes import check_strict, refuse_unknown, require_object

# OpenAI's hosted tools: they run on OpenAI's side, so this server cannot offer them.
HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "web_search_preview_2025_03_11",
        "file_search",
        "computer",
        "computer_use_preview",
        "code_interpreter",
        "mcp",
        "image_generation",
        "local_shell",
        "shell",
        "apply_patch",
        "custom",
    }
)


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    include: list[str] | None = None
    stream: bool = False
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None
    service_tier: str | None = None
    # vLLM's sampling extras (guidellm sends ignore_eos and stop)
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class Conversation:
    """Input items turned into chat-template messages, and the items as input_items lists them."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    items: list[dict[str, Any]] = field(default_factory=list)


_PART_KEYS = {"text": ("type", "text"), "output_text": ("type", "text", "annotations", "logprobs")}
# Each input item's keys: what the API defines for it (an output item replayed as input keeps its id
# and status).
_ITEM_KEYS = {
    "message": ("type", "role", "content", "id", "status"),
    "function_call": ("type", "id", "call_id", "name", "arguments", "status"),
    "function_call_output": ("type", "id", "call_id", "output", "status"),
    "reasoning": ("type", "id", "summary", "content", "encrypted_content", "status"),
}
_FUNCTION_TOOL_KEYS = ("type", "name", "description", "parameters", "strict")


def _parts_text(content: Any, role: str, where: str) -> str:
    """A message's content: a string, or a list of text parts (input_text / output_text / text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise validation(f"{where}.content must be a string or a list of content parts", "input")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        part = require_object(part, at)
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            # a replayed output_text carries its annotations and logprobs: metadata of that output
            refuse_unknown(part, _PART_KEYS["output_text" if kind == "output_text" else "text"], at)
            texts.append(part["text"])
        elif kind == "refusal" and role == "assistant" and isinstance(part.get("refusal"), str):
            refuse_unknown(part, ("type", "refusal"), at)
            texts.append(part["refusal"])
        else:
            raise validation(f"{at}.type {kind!r} is not supported (text parts only)", f"{at}.type")
    return "".join(texts)


def _arguments_object(arguments: Any, where: str) -> Any:
    """A call's arguments for the template: an object (templates tojson it), from JSON text."""
    if not isinstance(arguments, str):
        raise validation(f"{where}.arguments must be a JSON string", "input")
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        raise validation(f"{where}.arguments is not valid JSON", "input") from None


def to_conversation(value: str | list[dict[str, Any]]) -> Conversation:
    """`input` -> messages. Consecutive `function_call` items join one assistant message (after its
    text, when the message came just before them); a `reasoning` item's text goes to the next
    assistant message's `reasoning_content` (the key thinking templates read)."""
    conv = Conversation()
    if isinstance(value, str):
        conv.messages.append({"role": "user", "content": value})
        conv.items.append(
            {
                "id": new_id("msg"),
                "type": "message",
                "role": "user",
                "status": "completed",
                "content": [{"type": "input_text", "text": value}],
            }
        )
        return conv
    if not value:
        raise validation("input must not be empty", "input")
    pending_reasoning: str | None = None
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind in _ITEM_KEYS:
            refuse_unknown(item, _ITEM_KEYS[kind], where)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise validation(f"{where}.role must be user, system, developer or assistant", "input")
            text = _parts_text(item.get("content"), role, where)
            msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": text}
            if role == "assistant" and pending_reasoning is not None:
                msg["reasoning_content"] = pending_reasoning
                pending_reasoning = None
            conv.messages.append(msg)
            part_type = "output_text" if role == "assistant" else "input_text"
            conv.items.append(
                {
                    "id": item.get("id") or new_id("msg"),
                    "type": "message",
                    "role": role,
                    "status": item.get("status") or "completed",
                    "content": [{"type": part_type, "text": text}],
                }
            )
        elif kind == "function_call":
            name, call_id = item.get("name"), item.get("call_id")
            if not isinstance(name, str) or not name or not isinstance(call_id, str) or not call_id:
                raise validation(f"{where}: a function_call needs name and call_id", "input")
            args = _arguments_object(item.get("arguments", "{}"), where)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = conv.messages[-1] if conv.messages else None
            prev_kind = value[i - 1].get("type", "message") if i > 0 else None
            if last is not None and last["role"] == "assistant" and prev_kind in ("message", "function_call"):
                last.setdefault("tool_calls", []).append(call)
            else:
                msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                if pending_reasoning is not None:
                    msg["reasoning_content"] = pending_reasoning
                    pending_reasoning = None
                conv.messages.append(msg)
            conv.items.append(
                {
                    "id": item.get("id") or new_id("fc"),
                    "type": "function_call",
                    "call_id": call_id,
                    "name": name,
                    "arguments": item.get("arguments", "{}"),
                    "status": item.get("status") or "completed",
                }
            )
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not call_id:
                raise validation(f"{where}: a function_call_output needs call_id", "input")
            text = output if isinstance(output, str) else _parts_text(output, "tool", where)
            conv.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
            conv.items.append(
                {
                    "id": item.get("id") or new_id("fco"),
                    "type": "function_call_output",
                    "call_id": call_id,
                    "output": text,
                    "status": item.get("status") or "completed",
                }
            )
        elif kind == "reasoning":
            texts = []
            for j, p in enumerate(item.get("content") or []):
                at = f"{where}.content[{j}]"
                p = require_object(p, at)
                if p.get("type") != "reasoning_text" or not isinstance(p.get("text"), str):
                    raise validation(
                        f"{at}.type: a reasoning item's content is reasoning_text parts", f"{at}.type"
                    )
                refuse_unknown(p, ("type", "text"), at)
                texts.append(p["text"])
            if item.get("encrypted_content"):
                raise validation(f"{where}.encrypted_content is not supported", "input")
            pending_reasoning = "".join(texts)
            conv.items.append(
                {
                    "id": item.get("id") or new_id("rs"),
                    "type": "reasoning",
                    "summary": item.get("summary") or [],
                    "content": [{"type": "reasoning_text", "text": pending_reasoning}],
                }
            )
        else:
            raise validation(
                f"{where}: input item type {kind!r} is not supported "
                "(message, function_call, function_call_output, reasoning)",
                "input",
            )
    return conv


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools ({type, name, description, parameters, strict}) -> chat tools; a hosted
    tool is a 400 naming its type."""
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind in HOSTED_TOOLS:
            raise validation(
                f"tools[{i}]: the hosted tool {kind!r} is not available on this server (function tools only)",
                "tools",
            )
        if kind != "function":
            raise validation(f"tools[{i}].type {kind!r} is not supported (function)", f"tools[{i}].type")
        refuse_unknown(t, _FUNCTION_TOOL_KEYS, f"tools[{i}]")
        fn: dict[str, Any] = {"name": t.get("name")}
        if t.get("strict") is not None:
            fn["strict"] = check_strict(t["strict"], f"tools[{i}].strict")
        if t.get("description") is not None:
            fn["description"] = t["description"]
        if t.get("parameters") is not None:
            fn["parameters"] = t["parameters"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """Responses tool_choice ("none" | "auto" | "required" | {"type": "function", "name"}) -> chat's."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        refuse_unknown(choice, ("type", "name"), "tool_choice")
        return {"type": "function", "function": {"name": choice.get("name")}}
    kind = choice.get("type") if isinstance(choice, dict) else None
    raise validation(
        f"tool_choice {kind!r} is not supported (none, auto, required, or a function by name)", "tool_choice"
    )


def text_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` -> chat's response_format (text, json_object, json_schema {name, schema, strict})."""
    if text is None:
        return None
    verbosity = text.get("verbosity")
    if verbosity not in (None, "medium"):
        raise validation("text.verbosity is not supported (medium only)", "text.verbosity")
    unknown = sorted(k for k, v in text.items() if k not in ("format", "verbosity") and v is not None)
    if unknown:
        raise validation(f"Unrecognized request argument supplied: text.{unknown[0]}", f"text.{unknown[0]}")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise validation("text.format must be an object", "text.format")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        refuse_unknown(fmt, ("type",), "text.format")
        return {"type": kind}
    if kind == "json_schema":
        refuse_unknown(fmt, ("type", "name", "description", "schema", "strict"), "text.format")
        if not isinstance(fmt.get("schema"), dict):
            raise validation("text.format.schema is required for json_schema", "text.format")
        inner = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": inner}
    raise validation(
        f"text.format type {kind!r} is not supported (text, json_object, json_schema)", "text.format"
    )
