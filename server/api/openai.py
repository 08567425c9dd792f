"""OpenAI-compatible routes as vLLM serves them: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.core.outputs import Logprob, RequestOutput
from server.request import FinishReason, LoRARequest, SamplingParams

from .errors import APIError, ErrorKind, Family, validation
from .generation import (
    MIN_LOGPROB,
    ClientGone,
    Generation,
    check_request,
    collect,
    encode,
    make_params,
    merge_streams,
    read_json,
    resolve_adapter,
    safe_logprob,
    stream_engine,
    until_disconnect,
)
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, parse
from .sse import OPENAI_DONE, EventStreamResponse, openai_event
from .state import ServerState, server_state

router = APIRouter(tags=["OpenAI"])

MAX_N = 16


@dataclass(frozen=True)
class Job:
    """One engine request of an OpenAI call: choice `index` of prompt `prompt_index`."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    lora: LoRARequest | None = None  # the adapter named by `model`, None = the base model


def _stream_chunk(
    rid: str, obj: str, created: int, model: str, choices: list[dict[str, Any]], include_usage: bool
) -> dict[str, Any]:
    """One streamed chunk; with include_usage every chunk carries "usage": null until the last one."""
    c: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if include_usage:
        c["usage"] = None
    return c


def _check_model(state: ServerState, model: str | None) -> LoRARequest | None:
    """The base model's names select the base model, a loaded adapter's name that adapter; else 404."""
    return resolve_adapter(state, model)


def _finish_reason(reason: FinishReason | None) -> str | None:
    if reason is FinishReason.LENGTH:
        return "length"
    if reason is FinishReason.STOP:
        return "stop"
    return None if reason is None else str(reason)


def _build_params(
    state: ServerState,
    req: SamplingFields,
    prompt_len: int,
    max_tokens: int | None,
    logprobs: int | None,
    i: int,
) -> SamplingParams:
    assert state.limits is not None
    if req.logit_bias:
        raise validation("logit_bias is not supported", "logit_bias")
    if max_tokens is not None and max_tokens < 1:
        raise validation("max_tokens must be at least 1", "max_tokens")
    top_k = req.top_k if req.top_k is not None else 0
    if top_k < -1:
        raise validation(f"top_k must be -1 (disable) or at least 1, got {top_k}", "top_k")
    return make_params(
        max_tokens=max_tokens
        if max_tokens is not None
        else max(1, state.limits.max_total_tokens - prompt_len),
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(0, top_k),
        min_p=req.min_p or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        seed=None if req.seed is None else req.seed + i,
        stop=req.stop_list(),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
    )


def _check_common(req: SamplingFields) -> None:
    if not (1 <= req.n <= MAX_N):
        raise validation(f"n must be in [1, {MAX_N}], got {req.n}", "n")
    if req.seed is not None and not (0 <= req.seed < 2**63 - MAX_N):
        raise validation("seed must be in [0, 2**63)", "seed")
    if req.stream_options is not None and not req.stream:
        raise validation("stream_options is only allowed when stream is true", "stream_options")


def _usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _error_event(e: APIError) -> bytes:
    return openai_event(e.body(Family.OPENAI))


# ---- logprob views -----------------------------------------------------------------------------
class _Logprobs:
    def __init__(self, state: ServerState) -> None:
        assert state.llm is not None
        self.tok = state.llm.tokenizer

    def text(self, tid: int) -> str:
        return self.tok.token_text(tid)

    def completion(
        self, ids: list[int], chosen: list[Logprob | None], tops: list[list[Logprob]], offset0: int
    ) -> dict[str, Any]:
        tokens, token_lps, top, offsets = [], [], [], []
        offset = offset0
        for tid, lp, alts in zip(ids, chosen, tops, strict=True):
            t = self.text(tid)
            tokens.append(t)
            token_lps.append(safe_logprob(lp.logprob) if lp else None)
            d = {self.text(a.token_id): safe_logprob(a.logprob) for a in alts}
            if lp is not None:
                d.setdefault(t, safe_logprob(lp.logprob))
            top.append(d)
            offsets.append(offset)
            offset += len(t)
        return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": top}

    def chat(self, ids: list[int], chosen: list[Logprob | None], tops: list[list[Logprob]]) -> dict[str, Any]:
        content = []
        for tid, lp, alts in zip(ids, chosen, tops, strict=True):
            t = self.text(tid)
            content.append(
                {
                    "token": t,
                    "logprob": safe_logprob(lp.logprob) if lp else MIN_LOGPROB,
                    "bytes": list(t.encode()),
                    "top_logprobs": [
                        {
                            "token": self.text(a.token_id),
                            "logprob": safe_logprob(a.logprob),
                            "bytes": list(self.text(a.token_id).encode()),
                        }
                        for a in alts
                    ],
                }
            )
        return {"content": content}


def _chosen(out: RequestOutput) -> tuple[list[Logprob | None], list[list[Logprob]]]:
    chosen: list[Logprob | None] = []
    tops: list[list[Logprob]] = []
    for i in range(len(out.new_token_ids)):
        lp = out.new_logprobs[i] if i < len(out.new_logprobs) else None
        chosen.append(lp.chosen if lp else None)
        tops.append(list(lp.top) if lp else [])
    return chosen, tops


# ---- shared plumbing -----------------------------------------------------------------------------
async def _run_all(state: ServerState, jobs: list[Job]) -> list[Generation]:
    gens = await asyncio.gather(*(collect(state, j.prompt_ids, j.params, j.lora) for j in jobs))
    for g in gens:
        g.raise_if_failed()
    return list(gens)


def _stream_factories(
    state: ServerState, jobs: list[Job]
) -> list[Callable[[], AsyncIterator[RequestOutput]]]:
    def factory(job: Job) -> Callable[[], AsyncIterator[RequestOutput]]:
        return lambda: stream_engine(state, job.prompt_ids, job.params, job.lora)

    return [factory(j) for j in jobs]


@dataclass(frozen=True)
class Deferred:
    """A validated non-streaming call: the jobs to run, and how to build the body from their results."""

    jobs: list[Job]
    build: Callable[[list[Generation]], dict[str, Any]]


async def _serve(
    request: Request, prepare: Callable[[ServerState, Any], Awaitable[EventStreamResponse | Deferred]]
) -> Response:
    state = server_state(request)
    slot = None
    try:
        slot = state.admit()
        body = await read_json(request, state.config.max_payload_bytes)
        prepared = await prepare(state, body)
        if isinstance(prepared, EventStreamResponse):
            prepared.on_close = slot.release  # the stream releases its slot when it ends
            slot = None
            return prepared
        gens = await until_disconnect(request, _run_all(state, prepared.jobs))
        return JSONResponse(prepared.build(gens))
    except APIError as e:
        return e.response(Family.OPENAI)
    except ClientGone:
        return Response(status_code=499)
    finally:
        if slot is not None:
            slot.release()


# ---- /v1/completions -----------------------------------------------------------------------------
async def _prepare_completion(state: ServerState, body: Any) -> EventStreamResponse | Deferred:
    req: CompletionRequest = parse(CompletionRequest, body)
    lora = _check_model(state, req.model)
    _check_common(req)
    if req.suffix:
        raise validation("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise validation("best_of other than n is not supported", "best_of")
    if req.logprobs is not None and not (0 <= req.logprobs <= 20):
        raise validation("logprobs must be in [0, 20]", "logprobs")
    if req.echo and req.logprobs is not None:
        raise validation("echo together with logprobs is not supported", "echo")
    prompt = req.prompt
    texts: list[str | None]
    if isinstance(prompt, str):
        texts, id_lists = [prompt], [await encode(state, prompt)]
    elif prompt and all(isinstance(p, str) for p in prompt):
        texts = list(prompt)  # type: ignore[arg-type]
        id_lists = [await encode(state, p) for p in prompt]  # type: ignore[arg-type]
    elif prompt and all(isinstance(p, int) for p in prompt):
        texts, id_lists = [None], [list(prompt)]  # type: ignore[arg-type]
    elif prompt and all(isinstance(p, list) for p in prompt):
        id_lists = [list(p) for p in prompt]  # type: ignore[arg-type]
        texts = [None] * len(id_lists)
    else:
        raise validation("prompt must be a string, a list of strings, or token ids", "prompt")
    if len(id_lists) * req.n > MAX_N * 4:
        raise validation(f"at most {MAX_N * 4} prompts x n per request", "prompt")
    jobs: list[Job] = []
    for pi, ids in enumerate(id_lists):
        for i in range(req.n):
            params = _build_params(state, req, len(ids), req.max_tokens, req.logprobs, i)
            if i == 0:
                check_request(state, ids, params, "max_tokens")
            jobs.append(Job(pi * req.n + i, pi, ids, params, lora))
    assert state.llm is not None
    echo_texts = [
        (t if t is not None else state.llm.tokenizer.decode(ids)) if req.echo else ""
        for t, ids in zip(texts, id_lists, strict=True)
    ]
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = lora.name if lora is not None else state.llm.info.served_model_name
    view = _Logprobs(state)

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events() -> AsyncIterator[bytes]:
            def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
                return _stream_chunk(rid, "text_completion", created, model, choices, include_usage)

            completion_tokens = 0
            offsets = [0] * len(jobs)
            try:
                if req.echo:
                    for j in jobs:
                        yield openai_event(
                            chunk(
                                [
                                    {
                                        "index": j.index,
                                        "text": echo_texts[j.prompt_index],
                                        "logprobs": None,
                                        "finish_reason": None,
                                    }
                                ]
                            )
                        )
                async for tagged in merge_streams(_stream_factories(state, jobs)):
                    out, job = tagged.output, jobs[tagged.index]
                    if out.finished and out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                        g = Generation(prompt_ids=job.prompt_ids)
                        g.add(out)
                        g.raise_if_failed()
                    if not out.text and not out.finished and req.logprobs is None:
                        continue
                    choice: dict[str, Any] = {
                        "index": job.index,
                        "text": out.text,
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    if req.logprobs is not None:
                        chosen, tops = _chosen(out)
                        choice["logprobs"] = view.completion(
                            out.new_token_ids, chosen, tops, offsets[tagged.index]
                        )
                    offsets[tagged.index] += len(out.text)
                    if out.finished:
                        completion_tokens += out.num_output_tokens
                        choice["finish_reason"] = _finish_reason(out.finish_reason)
                        choice["stop_reason"] = out.stop_reason
                    yield openai_event(chunk([choice]))
                if include_usage:
                    usage = _usage(sum(len(ids) for ids in id_lists), completion_tokens)
                    yield openai_event(
                        {
                            "id": rid,
                            "object": "text_completion",
                            "created": created,
                            "model": model,
                            "choices": [],
                            "usage": usage,
                        }
                    )
            except APIError as e:
                yield _error_event(e)
            yield OPENAI_DONE

        return EventStreamResponse(events())

    return Deferred(
        jobs, lambda gens: _completion_body(state, req, rid, created, model, jobs, gens, echo_texts, id_lists)
    )


def _completion_body(
    state: ServerState,
    req: CompletionRequest,
    rid: str,
    created: int,
    model: str,
    jobs: list[Job],
    gens: list[Generation],
    echo_texts: list[str],
    id_lists: list[list[int]],
) -> dict[str, Any]:
    view = _Logprobs(state)
    choices = []
    for job, g in zip(jobs, gens, strict=True):
        choices.append(
            {
                "index": job.index,
                "text": echo_texts[job.prompt_index] + g.text,
                "logprobs": view.completion(g.token_ids, g.logprobs, g.top_logprobs, 0)
                if req.logprobs is not None
                else None,
                "finish_reason": _finish_reason(g.finish_reason),
                "stop_reason": g.stop_reason,
            }
        )
    usage = _usage(sum(len(ids) for ids in id_lists), sum(len(g.token_ids) for g in gens))
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
    }


@router.post("/v1/completions", summary="Completions (OpenAI)")
async def completions(request: Request) -> Response:
    return await _serve(request, _prepare_completion)


# ---- /v1/chat/completions ----------------------------------------------------------------------------
async def _chat_prompt(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    assert state.llm is not None
    messages = []
    for m in req.messages:
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": m.text()}
        if m.name:
            msg["name"] = m.name
        messages.append(msg)
    if messages[-1]["role"] == "assistant" and req.add_generation_prompt and len(messages) == 1:
        raise validation("messages must contain at least one non-assistant message", "messages")
    try:
        return await asyncio.to_thread(
            state.llm.tokenizer.apply_chat_template, messages, req.add_generation_prompt
        )
    except Exception as e:  # jinja raises its own errors for messages a template rejects
        raise validation(f"invalid messages for this model's chat template: {e}", "messages") from None


async def _prepare_chat(state: ServerState, body: Any) -> EventStreamResponse | Deferred:
    req: ChatCompletionRequest = parse(ChatCompletionRequest, body)
    lora = _check_model(state, req.model)
    _check_common(req)
    if req.tools and req.tool_choice != "none":
        raise validation("tools are not supported by this server", "tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise validation("only response_format type 'text' is supported", "response_format")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise validation("top_logprobs requires logprobs to be true", "top_logprobs")
        if not (0 <= req.top_logprobs <= 20):
            raise validation("top_logprobs must be in [0, 20]", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    ids = await _chat_prompt(state, req)
    jobs = []
    for i in range(req.n):
        params = _build_params(state, req, len(ids), max_tokens, logprobs, i)
        if i == 0:
            check_request(state, ids, params, "max_tokens")
        jobs.append(Job(i, 0, ids, params, lora))
    assert state.llm is not None
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = lora.name if lora is not None else state.llm.info.served_model_name
    view = _Logprobs(state)

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
            return _stream_chunk(rid, "chat.completion.chunk", created, model, choices, include_usage)

        async def events() -> AsyncIterator[bytes]:
            completion_tokens = 0
            try:
                for j in jobs:
                    yield openai_event(
                        chunk(
                            [
                                {
                                    "index": j.index,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ]
                        )
                    )
                async for tagged in merge_streams(_stream_factories(state, jobs)):
                    out = tagged.output
                    if out.finished and out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                        g = Generation(prompt_ids=ids)
                        g.add(out)
                        g.raise_if_failed()
                    if not out.text and not out.finished and logprobs is None:
                        continue
                    choice: dict[str, Any] = {
                        "index": tagged.index,
                        "delta": {"content": out.text} if out.text else {},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    if logprobs is not None:
                        chosen, tops = _chosen(out)
                        choice["logprobs"] = view.chat(out.new_token_ids, chosen, tops)
                    if out.finished:
                        completion_tokens += out.num_output_tokens
                        choice["finish_reason"] = _finish_reason(out.finish_reason)
                        choice["stop_reason"] = out.stop_reason
                    yield openai_event(chunk([choice]))
                if include_usage:
                    yield openai_event(
                        {
                            "id": rid,
                            "object": "chat.completion.chunk",
                            "created": created,
                            "model": model,
                            "choices": [],
                            "usage": _usage(len(ids), completion_tokens),
                        }
                    )
            except APIError as e:
                yield _error_event(e)
            yield OPENAI_DONE

        return EventStreamResponse(events())

    def build(gens: list[Generation]) -> dict[str, Any]:
        choices = []
        for job, g in zip(jobs, gens, strict=True):
            choices.append(
                {
                    "index": job.index,
                    "message": {"role": "assistant", "content": g.text},
                    "logprobs": view.chat(g.token_ids, g.logprobs, g.top_logprobs)
                    if logprobs is not None
                    else None,
                    "finish_reason": _finish_reason(g.finish_reason),
                    "stop_reason": g.stop_reason,
                }
            )
        cached = gens[0].num_cached_tokens if gens else 0
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": _usage(len(ids), sum(len(g.token_ids) for g in gens), cached),
        }

    return Deferred(jobs, build)


@router.post("/v1/chat/completions", summary="Chat completions (OpenAI)")
async def chat_completions(request: Request) -> Response:
    return await _serve(request, _prepare_chat)


@router.get("/v1/models", summary="Served models (OpenAI)")
async def models(request: Request) -> Response:
    state = server_state(request)
    if state.llm is None or state.limits is None:
        return APIError(ErrorKind.UNAVAILABLE, "the model is still loading").response(Family.OPENAI)
    info = state.llm.info
    base = {
        "id": info.served_model_name,
        "object": "model",
        "created": int(state.started_at),
        "owned_by": "kubeinfer",
        "root": info.model_id,
        "parent": None,
        "max_model_len": state.limits.max_total_tokens,
    }
    # LoRA adapters as vLLM lists them: root = the adapter's folder, parent = the base model
    adapters = [
        {**base, "id": a.name, "root": a.path, "parent": a.base_model_name or info.served_model_name}
        for a in (state.llm.lora.names() if state.llm.lora is not None else [])
    ]
    return JSONResponse({"object": "list", "data": [base, *adapters]})
