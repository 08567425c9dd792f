"""OpenAI's Responses API on our engine, as vLLM serves it: `POST /v1/responses` (unary or a stream of
semantic events), `GET` / `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`,
`POST /v1/responses/{id}/cancel`.

A request becomes a chat conversation (responses_protocol.py: `instructions` first, then the stored
history of `previous_response_id`, then `input`) rendered by the chat template, with the chat route's
tools (structured.py: ToolPlan) and structured output (`text.format` -> response_format). The output
is split by `--reasoning-parser` into a reasoning item and the answer, the answer into a message and
function calls (responses_output.py). Responses are kept per API key in `ResponseStore` unless
`store` is false. `background: true` is refused: this server runs a response only while its client
waits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.core.outputs import RequestOutput
from server.request import FinishReason, GrammarSpec, LoRARequest, SamplingParams

from .admin import bearer_token
from .errors import APIError, ErrorKind, Family, validation
from .generation import Generation, check_request, make_params, resolve_adapter, stream_engine
from .openai import Deferred, EventStreamResponse, Job, _serve
from .protocol import parse
from .reasoning import (
    AnyReasoningStream,
    ReasoningPlan,
    count_reasoning_tokens,
    plan_reasoning,
    template_kwargs,
)
from .response_store import owner_of
from .responses_output import OutputBuilder
from .responses_protocol import (
    ResponsesRequest,
    chat_tool_choice,
    chat_tools,
    new_id,
    text_response_format,
    to_conversation,
)
from .sse import _dumps
from .state import ServerState, server_state
from .structured import ToolPlan, compile_spec, plan_tools, response_format_spec

router = APIRouter(tags=["OpenAI"])

# `include` values this server can honour; none yet (logprobs and encrypted reasoning are not kept).
_INCLUDE: frozenset[str] = frozenset()
_METADATA_KEYS, _METADATA_KEY_CHARS, _METADATA_VALUE_CHARS = 16, 64, 512


@dataclass(frozen=True)
class Prepared:
    """A validated /v1/responses call."""

    req: ResponsesRequest
    rid: str
    created: int
    model: str
    lora: LoRARequest | None
    ids: list[int]  # the prompt's token ids
    params: SamplingParams
    plan: ToolPlan
    reasoning: ReasoningPlan
    history: list[dict[str, Any]]  # the conversation without instructions (stored for the next turn)
    items: list[dict[str, Any]]  # this request's input items (input_items)
    owner: str
    store: bool


def _sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {_dumps(event)}\n\n".encode()


def _check_simple_fields(state: ServerState, req: ResponsesRequest) -> bool:
    """The fields that need no engine: refusals and bounds. Returns whether the response is stored."""
    if req.background:
        raise validation(
            "background: true is not supported (responses run while the client waits)", "background"
        )
    for inc in req.include or []:
        if inc not in _INCLUDE:
            raise validation(f"include value {inc!r} is not supported", "include")
    if req.top_logprobs not in (None, 0):
        raise validation("top_logprobs is not supported", "top_logprobs")
    if req.service_tier not in (None, "auto", "default"):
        raise validation("service_tier: only auto and default are served", "service_tier")
    if req.seed is not None and not (0 <= req.seed < 2**63):
        raise validation("seed must be in [0, 2**63)", "seed")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise validation("max_output_tokens must be at least 1", "max_output_tokens")
    md = req.metadata or {}
    if len(md) > _METADATA_KEYS or any(
        len(k) > _METADATA_KEY_CHARS or len(v) > _METADATA_VALUE_CHARS for k, v in md.items()
    ):
        raise validation(
            f"metadata: at most {_METADATA_KEYS} keys of at most {_METADATA_KEY_CHARS} characters, "
            f"values of at most {_METADATA_VALUE_CHARS}",
            "metadata",
        )
    enabled = state.config.responses_store.enabled
    if req.store and not enabled:
        raise validation("store: true needs the server's responses store (--enable-responses-store)", "store")
    return enabled if req.store is None else req.store


def _template_kwargs(state: ServerState, req: ResponsesRequest) -> dict[str, Any]:
    """`reasoning.effort` for templates that read reasoning_effort; anything else in `reasoning` is refused."""
    assert state.llm is not None
    r = req.reasoning or {}
    for key, value in r.items():
        if key not in ("effort", "summary", "generate_summary") and value is not None:
            raise validation(f"reasoning.{key} is not supported", f"reasoning.{key}")
    if r.get("summary") is not None or r.get("generate_summary") is not None:
        raise validation("reasoning.summary is not supported (no summarizer)", "reasoning.summary")
    return template_kwargs(state.llm.tokenizer, None, r.get("effort"), "reasoning.effort")


async def _render(
    state: ServerState, messages: list[dict[str, Any]], plan: ToolPlan, kwargs: dict[str, Any]
) -> list[int]:
    assert state.llm is not None
    tools = list(plan.tools) if plan.active else None
    if tools and not state.llm.tokenizer.chat_template_knows_tools:
        raise validation(
            "this model's chat template does not render tools; start the server with --chat-template", "tools"
        )
    try:
        return await asyncio.to_thread(
            state.llm.tokenizer.apply_chat_template, messages, True, False, False, tools, kwargs
        )
    except Exception as e:  # jinja raises its own errors for conversations a template rejects
        raise validation(f"invalid input for this model's chat template: {e}", "input") from None


async def _prompt(
    state: ServerState, req: ResponsesRequest, history: list[dict[str, Any]], plan: ToolPlan
) -> list[int]:
    """The prompt ids; with truncation "auto" the oldest turns are dropped until the prompt fits."""
    assert state.limits is not None
    kwargs = _template_kwargs(state, req)
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    ids = await _render(state, system + history, plan, kwargs)
    if req.truncation == "auto":
        limit = state.limits.max_input_tokens
        if req.max_output_tokens is not None:
            limit = min(limit, state.limits.max_total_tokens - req.max_output_tokens)
        start = 0
        while len(ids) > limit and start < len(history) - 1:
            start += 1
            while start < len(history) - 1 and history[start]["role"] == "tool":
                start += 1  # a tool result without its call would not render
            ids = await _render(state, system + history[start:], plan, kwargs)
    return ids


async def _prepare(state: ServerState, req: ResponsesRequest, owner: str) -> Prepared:
    assert state.llm is not None and state.limits is not None
    lora = resolve_adapter(state, req.model)
    store = _check_simple_fields(state, req)
    prev: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        entry = state.responses_store.get(req.previous_response_id, owner)
        if entry is None:
            raise APIError(
                ErrorKind.NOT_FOUND,
                f"Previous response with id '{req.previous_response_id}' not found "
                "(never stored, deleted, evicted, or kept by another replica).",
                "previous_response_id",
            )
        prev = entry.history
    conv = to_conversation(req.input)
    history = [*prev, *conv.messages]
    plan = plan_tools(
        state, chat_tools(req.tools), chat_tool_choice(req.tool_choice), req.parallel_tool_calls
    )
    specs: list[tuple[GrammarSpec, str]] = []
    rf = response_format_spec(text_response_format(req.text))
    if rf is not None:
        specs.append((rf, "text.format"))
    tool_spec = plan.grammar()
    if tool_spec is not None:
        specs.append((tool_spec, "tool_choice"))
    if len(specs) > 1:
        raise validation(
            "give one output constraint, got text.format and a forced tool_choice", "text.format"
        )
    ids = await _prompt(state, req, history, plan)
    reasoning = plan_reasoning(
        state.config.reasoning_parser, state.llm.tokenizer, ids, specs[0][1] if specs else None
    )
    spec = reasoning.answer_grammar(specs[0][0]) if specs else None
    if specs:
        await compile_spec(state, *specs[0])
    params = make_params(
        max_tokens=req.max_output_tokens
        if req.max_output_tokens is not None
        else max(1, state.limits.max_total_tokens - len(ids)),
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=req.seed,
        stop=(req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
        ignore_eos=req.ignore_eos,
        structured=spec,
        skip_special_tokens=not reasoning.keep_special_tokens,
    )
    check_request(state, ids, params, "max_output_tokens")
    model = lora.name if lora is not None else state.llm.info.served_model_name
    return Prepared(
        req,
        new_id("resp"),
        int(time.time()),
        model,
        lora,
        ids,
        params,
        plan,
        reasoning,
        history,
        conv.items,
        owner,
        store,
    )


def _body(
    p: Prepared,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    req = p.req
    fmt = (req.text or {}).get("format") or {"type": "text"}
    return {
        "id": p.rid,
        "object": "response",
        "created_at": p.created,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": None,
        "metadata": req.metadata or {},
        "model": p.model,
        "output": output,
        "parallel_tool_calls": p.plan.parallel if p.plan.active else req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
        "service_tier": "default",
        "store": p.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [],
        "top_logprobs": 0,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled",
        "usage": usage,
        "user": req.user,
        "safety_identifier": req.safety_identifier,
        "prompt_cache_key": req.prompt_cache_key,
    }


def _usage(p: Prepared, g: Generation, reasoning_tokens: int) -> dict[str, Any]:
    n_out = len(g.token_ids)
    return {
        "input_tokens": len(p.ids),
        "input_tokens_details": {"cached_tokens": g.num_cached_tokens},
        "output_tokens": n_out,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": len(p.ids) + n_out,
    }


def _finish(
    state: ServerState, p: Prepared, b: OutputBuilder, g: Generation, reasoning_tokens: int
) -> dict[str, Any]:
    complete = g.finish_reason is not FinishReason.LENGTH
    b.finish(complete)
    body = _body(p, "completed" if complete else "incomplete", b.items, _usage(p, g, reasoning_tokens))
    if p.store:
        state.responses_store.put(p.rid, p.owner, body, [*p.history, b.history_message()], p.items)
    return body


def _unary(state: ServerState, p: Prepared, g: Generation) -> dict[str, Any]:
    b = OutputBuilder(p.plan)
    answer = g.text
    reasoning_tokens = 0
    if p.reasoning.parser is not None:
        split = p.reasoning.parser.split(g.text)
        b.add_reasoning(split.reasoning or "")
        answer = split.content or ""
        reasoning_tokens = count_reasoning_tokens(g.token_texts, split)
    b.add_answer(answer, True)
    state.metrics.reasoning_tokens_generated(reasoning_tokens)
    return _finish(state, p, b, g, reasoning_tokens)


def _stream(state: ServerState, p: Prepared) -> EventStreamResponse:
    async def events() -> AsyncIterator[bytes]:
        seq = 0

        def frame(event: dict[str, Any]) -> bytes:
            nonlocal seq
            event["sequence_number"] = seq
            seq += 1
            return _sse(event)

        start = _body(p, "in_progress", [], None)
        yield frame({"type": "response.created", "response": start})
        yield frame({"type": "response.in_progress", "response": start})
        b = OutputBuilder(p.plan)
        rs = p.reasoning.stream()
        g = Generation(prompt_ids=p.ids)
        try:
            async for out in stream_engine(state, p.ids, p.params, p.lora):
                g.add(out)
                if out.finished and out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                    g.raise_if_failed()
                _feed(b, rs, out)
                for event in b.take_events():
                    yield frame(event)
            reasoning_tokens = (
                count_reasoning_tokens(g.token_texts, rs.split_so_far()) if rs is not None else 0
            )
            state.metrics.reasoning_tokens_generated(reasoning_tokens)
            body = _finish(state, p, b, g, reasoning_tokens)
            for event in b.take_events():
                yield frame(event)
            kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
            yield frame({"type": kind, "response": body})
        except APIError as e:
            for event in b.take_events():
                yield frame(event)
            err = {"code": "server_error", "message": e.message}
            yield frame({"type": "response.failed", "response": _body(p, "failed", b.items, None, err)})

    return EventStreamResponse(events())


def _feed(b: OutputBuilder, rs: AnyReasoningStream | None, out: RequestOutput) -> None:
    if rs is None:
        b.add_answer(out.text, out.finished)
        return
    reasoning, content = rs.feed(out.text, out.finished)
    b.add_reasoning(reasoning)
    if content or out.finished:
        b.add_answer(content, out.finished)


def _owner(request: Request) -> str:
    return owner_of(bearer_token(request.scope))


@router.post("/v1/responses", summary="Create a response (OpenAI Responses API)")
async def create_response(request: Request) -> Response:
    owner = _owner(request)

    async def prepare(state: ServerState, body: Any) -> EventStreamResponse | Deferred:
        req: ResponsesRequest = parse(ResponsesRequest, body)
        p = await _prepare(state, req, owner)
        if req.stream:
            return _stream(state, p)
        return Deferred([Job(0, 0, p.ids, p.params, p.lora)], lambda gens: _unary(state, p, gens[0]))

    return await _serve(request, prepare)


def _not_found(response_id: str) -> JSONResponse:
    return APIError(
        ErrorKind.NOT_FOUND, f"Response with id '{response_id}' not found.", "response_id"
    ).response(Family.OPENAI)


@router.get("/v1/responses/{response_id}", summary="Retrieve a stored response (OpenAI Responses API)")
async def get_response(request: Request, response_id: str) -> Response:
    entry = server_state(request).responses_store.get(response_id, _owner(request))
    return _not_found(response_id) if entry is None else JSONResponse(entry.body)


@router.delete("/v1/responses/{response_id}", summary="Delete a stored response (OpenAI Responses API)")
async def delete_response(request: Request, response_id: str) -> Response:
    if not server_state(request).responses_store.delete(response_id, _owner(request)):
        return _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.get(
    "/v1/responses/{response_id}/input_items",
    summary="A stored response's input items (OpenAI Responses API)",
)
async def input_items(
    request: Request, response_id: str, limit: int = 20, order: str = "desc", after: str | None = None
) -> Response:
    entry = server_state(request).responses_store.get(response_id, _owner(request))
    if entry is None:
        return _not_found(response_id)
    if not (1 <= limit <= 100):
        return validation("limit must be in [1, 100]", "limit").response(Family.OPENAI)
    if order not in ("asc", "desc"):
        return validation("order must be asc or desc", "order").response(Family.OPENAI)
    items = list(entry.input_items) if order == "asc" else list(reversed(entry.input_items))
    if after is not None:
        ids = [it["id"] for it in items]
        if after not in ids:
            return validation(f"after: no input item {after!r} in this response", "after").response(
                Family.OPENAI
            )
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )


@router.post(
    "/v1/responses/{response_id}/cancel", summary="Cancel a background response (OpenAI Responses API)"
)
async def cancel_response(request: Request, response_id: str) -> Response:
    entry = server_state(request).responses_store.get(response_id, _owner(request))
    if entry is None:
        return _not_found(response_id)
    # Only background responses can be cancelled (OpenAI's rule), and this server runs none.
    return validation(
        "Only responses created with background: true can be cancelled", "response_id"
    ).response(Family.OPENAI)
