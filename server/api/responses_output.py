"""A response's output items and its stream of semantic events, built from the model's text.

The same builder serves both ways: a stream feeds it each engine delta and sends the events it
queues; a unary call feeds the whole text once and keeps only the items, so both end with the same
items. Item and event shapes: OpenAI's Responses API (platform.openai.com/docs/api-reference/
responses-streaming): `response.output_item.added` / `.done`, `response.content_part.added` /
`.done`, `response.output_text.delta` / `.done`, `response.reasoning_text.delta` / `.done`,
`response.function_call_arguments.delta` / `.done`. Reasoning comes first (a `reasoning` item), then
the answer's `message`, then its `function_call`s.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from .responses_protocol import new_id
from .structured import ToolPlan, ToolStream


class OutputBuilder:
    """Deltas of reasoning and answer text -> output items and the events announcing them."""

    def __init__(self, plan: ToolPlan) -> None:
        self.tools = ToolStream(plan)
        self.items: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []  # queued, without sequence_number
        self._open: int | None = None  # index of the item still being written
        self.reasoning_text = ""
        self.answer_text = ""

    # ---- items -----------------------------------------------------------------------------------
    def _emit(self, kind: str, **fields: Any) -> None:
        self.events.append({"type": kind, **fields})

    def _open_item(self, item: dict[str, Any]) -> int:
        self._close("completed")
        self.items.append(item)
        self._open = len(self.items) - 1
        self._emit("response.output_item.added", output_index=self._open, item=_copy(item))
        return self._open

    def _open_with_part(self, item: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
        """Opens `item` (a message or a reasoning item) with its one content part; returns the item."""
        i = self._open_item(item)
        item["content"].append(part)
        self._emit(
            "response.content_part.added",
            item_id=item["id"],
            output_index=i,
            content_index=0,
            part=_copy(part),
        )
        return item

    def _current(self, kind: str) -> dict[str, Any] | None:
        if self._open is None:
            return None
        item = self.items[self._open]
        return item if item["type"] == kind else None

    def _close(self, status: str) -> None:
        if self._open is None:
            return
        i, item = self._open, self.items[self._open]
        self._open = None
        if item["type"] == "reasoning":
            part = item["content"][0]
            self._emit(
                "response.reasoning_text.done",
                item_id=item["id"],
                output_index=i,
                content_index=0,
                text=part["text"],
            )
            self._emit(
                "response.content_part.done",
                item_id=item["id"],
                output_index=i,
                content_index=0,
                part=_copy(part),
            )
        elif item["type"] == "message":
            part = item["content"][0]
            self._emit(
                "response.output_text.done",
                item_id=item["id"],
                output_index=i,
                content_index=0,
                text=part["text"],
                logprobs=[],
            )
            self._emit(
                "response.content_part.done",
                item_id=item["id"],
                output_index=i,
                content_index=0,
                part=_copy(part),
            )
        elif item["type"] == "function_call":
            self._emit(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=i,
                name=item["name"],
                arguments=item["arguments"],
            )
        item["status"] = status
        self._emit("response.output_item.done", output_index=i, item=_copy(item))

    # ---- feeding ---------------------------------------------------------------------------------
    def add_reasoning(self, delta: str) -> None:
        if not delta:
            return
        self.reasoning_text += delta
        item = self._current("reasoning")
        if item is None:
            item = self._open_with_part(
                {
                    "id": new_id("rs"),
                    "type": "reasoning",
                    "summary": [],
                    "content": [],
                    "status": "in_progress",
                },
                {"type": "reasoning_text", "text": ""},
            )
        assert self._open is not None
        item["content"][0]["text"] += delta
        self._emit(
            "response.reasoning_text.delta",
            item_id=item["id"],
            output_index=self._open,
            content_index=0,
            delta=delta,
        )

    def add_answer(self, delta: str, finished: bool) -> None:
        self.answer_text += delta
        out = self.tools.feed(delta, finished)
        if out.get("content"):
            self._add_text(out["content"])
        for frag in out.get("tool_calls") or []:
            fn = frag.get("function") or {}
            if frag.get("id"):  # a new call
                self._open_item(
                    {
                        "id": new_id("fc"),
                        "type": "function_call",
                        "call_id": f"call_{uuid.uuid4().hex}",
                        "name": fn.get("name", ""),
                        "arguments": "",
                        "status": "in_progress",
                    }
                )
            args = fn.get("arguments") or ""
            item = self._current("function_call")
            if args and item is not None:
                item["arguments"] += args
                self._emit(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self._open,
                    delta=args,
                )

    def _add_text(self, text: str) -> None:
        item = self._current("message")
        if item is None:
            item = self._open_with_part(
                {
                    "id": new_id("msg"),
                    "type": "message",
                    "role": "assistant",
                    "status": "in_progress",
                    "content": [],
                },
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
            )
        assert self._open is not None
        item["content"][0]["text"] += text
        self._emit(
            "response.output_text.delta",
            item_id=item["id"],
            output_index=self._open,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def finish(self, complete: bool) -> None:
        """Closes the last item: "completed", or "incomplete" when the output was cut (max_output_tokens).
        An output with no item at all gets an empty message, as OpenAI returns one."""
        if not self.items:
            self._add_text("")
        self._close("completed" if complete else "incomplete")

    def take_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events

    # ---- views -----------------------------------------------------------------------------------
    @property
    def output_text(self) -> str:
        return "".join(
            part["text"] for item in self.items if item["type"] == "message" for part in item["content"]
        )

    def history_message(self) -> dict[str, Any]:
        """The output as one assistant message for the chat template (previous_response_id's history)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.output_text}
        if self.reasoning_text:
            msg["reasoning_content"] = self.reasoning_text
        calls = [
            {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": _args_object(item["arguments"])},
            }
            for item in self.items
            if item["type"] == "function_call"
        ]
        if calls:
            msg["tool_calls"] = calls
        return msg


def _args_object(arguments: str) -> Any:
    """A call's arguments as an object for the template; a call cut mid-JSON (max_output_tokens)
    goes back as an empty object rather than text the template cannot render."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(item))
