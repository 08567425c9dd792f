"""Structured outputs and tool calling at the API: request fields -> a GrammarSpec (compiled off the
event loop, so a bad schema is a 400/422 before admission), tool_choice planning, and the model's
output -> OpenAI `tool_calls` (whole or streamed as `delta.tool_calls` fragments).

Field names follow OpenAI (`response_format`, `tools`, `tool_choice`, `parallel_tool_calls`), vLLM
(`structured_outputs`, `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`) and TGI
(`parameters.grammar` = {"type": "json" | "regex", "value": ...}).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from server.request import GrammarSpec
from server.structured import GrammarError

from .errors import validation
from .shapes import check_chat_tool, check_chat_tool_choice, check_grammar, refuse_unknown
from .state import ServerState
from .tool_parsers import TOOL_PARSERS, ParsedCall, ParsedToolOutput, ToolParser, partial_call

_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's StructuredOutputsParams switches whose default (false) is what this server does.
_OFF_BY_DEFAULT = frozenset({"disable_fallback", "disable_any_whitespace", "disable_additional_properties"})


def _json_spec(value: Any, param: str) -> GrammarSpec:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise validation(f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(value, dict | bool):
        raise validation(f"{param} must be a JSON schema object", param)
    return GrammarSpec("json", json.dumps(value))


def _choice_spec(value: Any, param: str) -> GrammarSpec:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise validation(f"{param} must be a non-empty list of non-empty strings", param)
    return GrammarSpec("choice", json.dumps(value))


def _text_spec(kind: str, value: Any, param: str) -> GrammarSpec:
    if not isinstance(value, str) or not value:
        raise validation(f"{param} must be a non-empty string", param)
    return GrammarSpec(kind, value)


def _closed(obj: dict[str, Any], allowed: tuple[str, ...], param: str) -> None:
    """Refuses, by name, a key of `obj` that the peer's schema does not have (a null asks for nothing)."""
    unknown = sorted(k for k, v in obj.items() if k not in allowed and v is not None)
    if unknown:
        raise validation(
            f"{param}.{unknown[0]} is not supported (known: {', '.join(allowed)})", f"{param}.{unknown[0]}"
        )


def response_format_spec(fmt: dict[str, Any] | None) -> GrammarSpec | None:
    """`response_format` on chat: OpenAI's `text` | `json_object` | `json_schema` {json_schema: {name,
    description, schema, strict}}, and TGI's grammar shapes (its `GrammarType`, serde tag `type`,
    content `value`): `json` / `json_object` with `value` a schema (huggingface_hub sends a
    json_schema as `{"type": "json_object", "value": SCHEMA}`), `regex` with `value` a regex,
    `json_schema` with `value` {name, schema}. `json_object` without `value` is any JSON object. Every
    other key is refused by name: an ignored schema would return unconstrained output with a 200."""
    if fmt is None:
        return None
    param = "response_format"
    kind = fmt.get("type", "text")
    if kind == "text":
        _closed(fmt, ("type",), param)
        return None
    if kind in ("json_object", "json"):
        _closed(fmt, ("type", "value"), param)
        value = fmt.get("value")
        if value is None:
            if kind == "json":
                raise validation("response_format.value (a JSON schema) is required for type json", param)
            return GrammarSpec("json_object")
        return _json_spec(value, "response_format.value")
    if kind == "regex":
        _closed(fmt, ("type", "value"), param)
        return _text_spec("regex", fmt.get("value"), "response_format.value")
    if kind == "json_schema":
        _closed(fmt, ("type", "json_schema", "value"), param)
        inner_param = "response_format.json_schema" if "json_schema" in fmt else "response_format.value"
        js = fmt.get("json_schema", fmt.get("value"))
        if not isinstance(js, dict) or js.get("schema") is None:
            raise validation(f"{inner_param}.schema is required", param)
        _closed(js, ("name", "description", "schema", "strict"), inner_param)
        return _json_spec(js["schema"], f"{inner_param}.schema")
    raise validation(
        f"response_format type {kind!r} is not supported (text, json_object, json_schema; TGI's json, regex)",
        param,
    )


def vllm_spec(fields: Any) -> tuple[GrammarSpec, str] | None:
    """vLLM's structured_outputs object and the older guided_* fields; at most one may be given."""
    found: list[tuple[GrammarSpec, str]] = []
    so = fields.structured_outputs
    if so is not None:
        if not isinstance(so, dict):
            raise validation("structured_outputs must be an object", "structured_outputs")
        unknown = sorted(
            k
            for k, v in so.items()
            if k not in _STRUCTURED_KEYS and v is not None and not (k in _OFF_BY_DEFAULT and v is False)
        )
        if unknown:
            raise validation(
                f"structured_outputs.{unknown[0]} is not supported (use one of {', '.join(_STRUCTURED_KEYS)})",
                f"structured_outputs.{unknown[0]}",
            )
        given = [k for k in _STRUCTURED_KEYS if so.get(k) not in (None, False)]
        if len(given) != 1:
            raise validation(
                f"structured_outputs needs exactly one of {', '.join(_STRUCTURED_KEYS)}", "structured_outputs"
            )
        k = given[0]
        param = f"structured_outputs.{k}"
        if k == "json":
            found.append((_json_spec(so[k], param), param))
        elif k == "choice":
            found.append((_choice_spec(so[k], param), param))
        elif k == "json_object":
            found.append((GrammarSpec("json_object"), param))
        else:
            found.append((_text_spec(k, so[k], param), param))
    if fields.guided_json is not None:
        found.append((_json_spec(fields.guided_json, "guided_json"), "guided_json"))
    if fields.guided_regex is not None:
        found.append((_text_spec("regex", fields.guided_regex, "guided_regex"), "guided_regex"))
    if fields.guided_choice is not None:
        found.append((_choice_spec(fields.guided_choice, "guided_choice"), "guided_choice"))
    if fields.guided_grammar is not None:
        found.append((_text_spec("grammar", fields.guided_grammar, "guided_grammar"), "guided_grammar"))
    if len(found) > 1:
        raise validation(
            f"give one structured output constraint, got {', '.join(p for _, p in found)}", found[1][1]
        )
    return found[0] if found else None


def tgi_grammar_spec(grammar: Any) -> GrammarSpec | None:
    """TGI's `parameters.grammar` (its `GrammarType`: serde tag `type`, content `value`): `json` (alias
    `json_object`) with a schema, `regex` with a regex, `json_schema` with `{name, schema}` (TGI 3).
    Any other key is refused by name (`parameters.grammar.<key>`)."""
    if grammar is None:
        return None
    param = "parameters.grammar"
    kind, value = check_grammar(grammar, param, tgi=True)
    if kind in ("json", "json_object"):
        return _json_spec(value, f"{param}.value")
    if kind == "json_schema":
        if not isinstance(value, dict) or value.get("schema") is None:
            raise validation(f"Input validation error: {param}.value.schema is required", f"{param}.value")
        refuse_unknown(value, ("name", "schema"), f"{param}.value", tgi=True)
        return _json_spec(value["schema"], f"{param}.value.schema")
    if kind == "regex":
        return _text_spec("regex", value, f"{param}.value")
    raise validation(
        f"Input validation error: grammar type {kind!r} is not supported (json, json_schema, regex)",
        f"{param}.type",
    )


async def compile_spec(state: ServerState, spec: GrammarSpec, param: str) -> None:
    """Compiles (or finds cached) off the event loop; a spec that does not compile is a validation error."""
    assert state.llm is not None
    try:
        await asyncio.to_thread(state.llm.grammars.compile, spec)
    except GrammarError as e:
        raise validation(f"{param}: {e}", param) from None
    state.metrics.structured_request(spec.kind)


# ---- tools ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolPlan:
    """How a chat request uses its tools. mode: none | auto | required | named."""

    mode: str
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tool objects, validated
    name: str | None = None  # the forced function (mode named)
    parallel: bool = True
    parser: ToolParser | None = None  # mode auto

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def _params(self, name: str) -> dict[str, Any]:
        for t in self.tools:
            if t["function"]["name"] == name:
                params = t["function"].get("parameters")
                return params if isinstance(params, dict) else {"type": "object", "properties": {}}
        raise KeyError(name)

    def grammar(self) -> GrammarSpec | None:
        """required: a JSON array of {"name", "parameters"} (one item without parallel calls), each valid
        against its function's schema; named: the function's arguments object (vLLM's formats)."""
        if self.mode == "named":
            assert self.name is not None
            return GrammarSpec("json", json.dumps(self._params(self.name)))
        if self.mode != "required":
            return None
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t["function"]["name"]]},
                    "parameters": self._params(t["function"]["name"]),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        return GrammarSpec("json", json.dumps(schema))

    def parse(self, text: str, final: bool = True) -> ParsedToolOutput:
        """The output so far -> content + calls: with final=False (streaming) only what can no longer
        change, so the stream's deltas add up to the final parse. An unfinished last call follows the
        rule in tool_parsers' docstring (kept once named, with the argument text so far)."""
        if self.mode == "named":
            assert self.name is not None
            return ParsedToolOutput("", [ParsedCall(self.name, text)])
        if self.mode == "required":
            scan = _scan_array(text)
            calls = []
            for item in scan.closed:
                try:
                    it = json.loads(item)
                    calls.append(ParsedCall(it["name"], json.dumps(it["parameters"], ensure_ascii=False)))
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # the grammar makes every closed item a call; never seen
            if final and scan.open_item is not None:
                cut = partial_call(scan.open_item, ("parameters",))
                if cut is not None:
                    calls.append(cut)
            return ParsedToolOutput("", calls)
        if self.mode == "auto":
            assert self.parser is not None
            out = self.parser.parse(text, final=final)
            if not self.parallel and len(out.calls) > 1:
                return ParsedToolOutput(out.content, out.calls[:1])
            return out
        return ParsedToolOutput(text)


def plan_tools(
    state: ServerState, tools: list[dict[str, Any]] | None, choice: Any, parallel: bool | None
) -> ToolPlan:
    cfg = state.config
    if not tools:
        # vLLM and OpenAI refuse any tool_choice without tools, "none" included.
        if choice is not None:
            raise validation("tool_choice requires tools", "tool_choice")
        return ToolPlan("none")
    names: set[str] = set()
    for i, t in enumerate(tools):
        name = check_chat_tool(t, f"tools[{i}]")["name"]
        if name in names:
            raise validation(f"tools[{i}]: duplicate function name {name!r}", f"tools[{i}].function.name")
        names.add(name)
    parallel = True if parallel is None else parallel
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        name = check_chat_tool_choice(choice)
        if name not in names:
            raise validation(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        return ToolPlan("named", tools, name=name, parallel=False)
    if choice == "none":
        return ToolPlan("none")
    if choice == "required":
        return ToolPlan("required", tools, parallel=parallel)
    if choice == "auto":
        if not cfg.enable_auto_tool_choice or cfg.tool_call_parser is None:
            raise validation(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                "tool_choice",
            )
        return ToolPlan("auto", tools, parallel=parallel, parser=TOOL_PARSERS[cfg.tool_call_parser]())
    raise validation(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def message_tool_calls(calls: list[ParsedCall]) -> list[dict[str, Any]]:
    return [
        {"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


@dataclass(frozen=True)
class _ArrayScan:
    """A JSON array's text so far: its complete top-level items, and the text of an unfinished one."""

    closed: list[str]
    open_item: str | None


def _scan_array(text: str) -> _ArrayScan:
    items: list[str] = []
    depth, start, in_str, esc = 0, -1, False, False
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth == 2:
                start = i
        elif ch in "]}":
            depth -= 1
            if depth == 1 and start >= 0:
                items.append(text[start : i + 1])
                start = -1
    return _ArrayScan(items, text[start:] if start >= 0 else None)


class ToolStream:
    """Turns streamed text into OpenAI chat deltas: `content` pieces and `tool_calls` fragments
    (index, id and name once; arguments in one or more pieces)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.content_sent = 0
        self.calls_sent = 0
        self.started_named = False

    @property
    def called(self) -> bool:
        return self.calls_sent > 0

    def _call_delta(self, index: int, call: ParsedCall) -> dict[str, Any]:
        return {
            "index": index,
            "id": new_call_id(),
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }

    def feed(self, delta: str, finished: bool) -> dict[str, Any]:
        """The delta object for this piece of text ({} when nothing can be sent yet)."""
        self.text += delta
        plan = self.plan
        if plan.mode == "none":
            return {"content": delta} if delta else {}
        if plan.mode == "named":
            assert plan.name is not None
            if not self.started_named:
                self.started_named = True
                self.calls_sent = 1
                return {"tool_calls": [{**self._call_delta(0, ParsedCall(plan.name, delta))}]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": delta}}]} if delta else {}
        parsed = plan.parse(self.text, final=finished)  # the same parse as the unary reply's
        out: dict[str, Any] = {}
        if len(parsed.content) > self.content_sent:
            out["content"] = parsed.content[self.content_sent :]
            self.content_sent = len(parsed.content)
        new = parsed.calls[self.calls_sent :]
        if new:
            out["tool_calls"] = [self._call_delta(self.calls_sent + i, c) for i, c in enumerate(new)]
            self.calls_sent += len(new)
        return out
