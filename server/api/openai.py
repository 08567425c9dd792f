"""OpenAI-compatible routes as vLLM serves them: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.core.outputs import Logprob, RequestOutput, TokenLogprobs
from server.request import FinishReason, GrammarSpec, LoRARequest, SamplingParams

from . import admin
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
    token_texts,
    until_disconnect,
)
from .objectives import apply_objective_priority
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, parse
from .reasoning import count_reasoning_tokens, plan_reasoning, template_kwargs
from .shapes import template_messages
from .sse import OPENAI_DONE, EventStreamResponse, openai_event
from .state import ServerState, server_state
from .structured import (
    ToolPlan,
    ToolStream,
    compile_spec,
    message_tool_calls,
    plan_tools,
    response_format_spec,
    vllm_spec,
)
from .tgi import VERSION

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
    priority: int = 0  # vLLM's request priority (--scheduling-policy priority)


# OpenAI's field naming the backend configuration; TGI writes "<version>-<docker label or native>", and
# its own client (text_generation.types.ChatComplete, ChatCompletionChunk) requires the field.
SYSTEM_FINGERPRINT = f"{VERSION}-native"


def _stream_chunk(
    rid: str, obj: str, created: int, model: str, choices: list[dict[str, Any]], include_usage: bool
) -> dict[str, Any]:
    """One streamed chunk; with include_usage every chunk carries "usage": null until the last one."""
    c: dict[str, Any] = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": choices,
    }
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


def _chat_finish_reason(reason: FinishReason | None, called: bool) -> str | None:
    """The finish reason, "tool_calls" when the message ends with calls (a call cut short stays "length")."""
    if called and reason is FinishReason.STOP:
        return "tool_calls"
    return _finish_reason(reason)


def _build_params(
    state: ServerState,
    req: SamplingFields,
    prompt_len: int,
    max_tokens: int | None,
    logprobs: int | None,
    i: int,
    prompt_logprobs: int | None = None,
    structured: GrammarSpec | None = None,
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
        prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        structured=structured,
    )


def _check_common(req: SamplingFields) -> None:
    if not (1 <= req.n <= MAX_N):
        raise validation(f"n must be in [1, {MAX_N}], got {req.n}", "n")
    if req.seed is not None and not (0 <= req.seed < 2**63 - MAX_N):
        raise validation("seed must be in [0, 2**63)", "seed")
    if req.no_stop_trim:
        raise validation(
            "no_stop_trim is not supported (include_stop_str_in_output keeps stops)", "no_stop_trim"
        )
    if req.return_hidden_states:
        raise validation("return_hidden_states is not supported", "return_hidden_states")
    if req.stream_options is not None and not req.stream:
        raise validation("stream_options is only allowed when stream is true", "stream_options")
    so = req.stream_options
    if so is not None and so.continuous_usage_stats and not so.include_usage:
        raise validation(
            "stream_options.continuous_usage_stats requires stream_options.include_usage",
            "stream_options.continuous_usage_stats",
        )


def _check_prompt_logprobs(value: int | None) -> None:
    if value is not None and not (0 <= value <= 20):
        raise validation("prompt_logprobs must be in [0, 20]", "prompt_logprobs")


class UsageCounter:
    """Token counts for streamed usage: the final usage chunk, and with stream_options
    continuous_usage_stats, the running usage in every chunk (vLLM)."""

    def __init__(self, prompt_tokens: int, num_jobs: int, continuous: bool) -> None:
        self.prompt_tokens = prompt_tokens
        self.continuous = continuous
        self._per_job = [0] * num_jobs

    def update(self, job: int, num_output_tokens: int) -> None:
        self._per_job[job] = num_output_tokens

    def usage(self) -> dict[str, Any]:
        return _usage(self.prompt_tokens, sum(self._per_job))

    def stamp(self, chunk: dict[str, Any]) -> dict[str, Any]:
        if self.continuous:
            chunk["usage"] = self.usage()
        return chunk


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
class TextOffsets:
    """Character offsets into the output text of consecutive tokens, from each token's own bytes:
    a token holding part of a UTF-8 character starts where that character starts, so every offset
    indexes the returned text (never past its end)."""

    def __init__(self, start: int = 0, limit: int | None = None) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = start
        self._limit = limit

    def next(self, token: bytes) -> int:
        """The offset of the token about to be added; then adds its bytes."""
        offset = self._chars if self._limit is None else min(self._chars, self._limit)
        self._chars += len(self._decoder.decode(token))
        return offset


class _Logprobs:
    """Logprobs in OpenAI's shapes. A token's string is its text when its bytes are valid UTF-8 on
    their own, else OpenAI's `bytes:\\xNN...` form; `bytes` are always the token's own bytes."""

    def __init__(self, state: ServerState) -> None:
        assert state.llm is not None
        self.tok = state.llm.tokenizer

    def bytes(self, tid: int) -> bytes:
        return self.tok.token_bytes(tid)

    def text(self, tid: int) -> str:
        raw = self.tok.token_bytes(tid)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def completion(
        self, ids: list[int], chosen: list[Logprob | None], tops: list[list[Logprob]], offsets: TextOffsets
    ) -> dict[str, Any]:
        tokens, token_lps, top, text_offsets = [], [], [], []
        for tid, lp, alts in zip(ids, chosen, tops, strict=True):
            t = self.text(tid)
            tokens.append(t)
            token_lps.append(safe_logprob(lp.logprob) if lp else None)
            d = {self.text(a.token_id): safe_logprob(a.logprob) for a in alts}
            if lp is not None:
                d.setdefault(t, safe_logprob(lp.logprob))
            top.append(d)
            text_offsets.append(offsets.next(self.bytes(tid)))
        return {
            "text_offset": text_offsets,
            "token_logprobs": token_lps,
            "tokens": tokens,
            "top_logprobs": top,
        }

    def prompt_completion(
        self, ids: list[int], plps: list[TokenLogprobs | None], num_top: int, offsets: TextOffsets
    ) -> dict[str, Any]:
        """The echoed prompt's logprobs (the first token has none, as in vLLM)."""
        tokens: list[str] = []
        token_lps: list[float | None] = []
        top: list[dict[str, float] | None] = []
        text_offsets: list[int] = []
        for i, tid in enumerate(ids):
            p = plps[i] if i < len(plps) else None
            t = self.text(tid)
            tokens.append(t)
            text_offsets.append(offsets.next(self.bytes(tid)))
            if p is None:
                token_lps.append(None)
                top.append(None)
                continue
            token_lps.append(safe_logprob(p.chosen.logprob))
            d = {self.text(a.token_id): safe_logprob(a.logprob) for a in p.top[:num_top]}
            d.setdefault(t, safe_logprob(p.chosen.logprob))
            top.append(d)
        return {
            "text_offset": text_offsets,
            "token_logprobs": token_lps,
            "tokens": tokens,
            "top_logprobs": top,
        }

    def chat(self, ids: list[int], chosen: list[Logprob | None], tops: list[list[Logprob]]) -> dict[str, Any]:
        content = []
        for tid, lp, alts in zip(ids, chosen, tops, strict=True):
            content.append(
                {
                    "token": self.text(tid),
                    "logprob": safe_logprob(lp.logprob) if lp else MIN_LOGPROB,
                    "bytes": list(self.bytes(tid)),
                    "top_logprobs": [
                        {
                            "token": self.text(a.token_id),
                            "logprob": safe_logprob(a.logprob),
                            "bytes": list(self.bytes(a.token_id)),
                        }
                        for a in alts
                    ],
                }
            )
        return {"content": content}

    def prompt_logprobs(
        self, plps: list[TokenLogprobs | None] | None, num_top: int
    ) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token_id: {logprob, rank,
        decoded_token}} holding the prompt token and its top `num_top` alternatives."""
        out: list[dict[str, dict[str, Any]] | None] = []
        for p in plps or []:
            if p is None:
                out.append(None)
                continue
            d: dict[str, dict[str, Any]] = {}
            for lp in (p.chosen, *p.top[:num_top]):
                d.setdefault(
                    str(lp.token_id),
                    {
                        "logprob": safe_logprob(lp.logprob),
                        "rank": lp.rank,
                        "decoded_token": self.text(lp.token_id),
                    },
                )
            out.append(d)
        return out


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
    gens = await asyncio.gather(*(collect(state, j.prompt_ids, j.params, j.lora, j.priority) for j in jobs))
    for g in gens:
        g.raise_if_failed()
    return list(gens)


def _stream_factories(
    state: ServerState, jobs: list[Job]
) -> list[Callable[[], AsyncIterator[RequestOutput]]]:
    def factory(job: Job) -> Callable[[], AsyncIterator[RequestOutput]]:
        return lambda: stream_engine(state, job.prompt_ids, job.params, job.lora, job.priority)

    return [factory(j) for j in jobs]


@dataclass(frozen=True)
class Deferred:
    """A validated non-streaming call: the jobs to run, and how to build the body from their results."""

    jobs: list[Job]
    build: Callable[[list[Generation]], dict[str, Any]]


async def _serve(
    request: Request,
    prepare: Callable[[ServerState, Any], Awaitable[EventStreamResponse | Deferred]],
    priority_field: bool = False,
) -> Response:
    state = server_state(request)
    slot = None
    try:
        # Admitted once the body is read: a slow body holds no slot (server/api/limits.py times it out)
        body = await read_json(request, state.config.max_payload_bytes)
        if priority_field:  # the body type has vLLM's `priority` (the Responses API's has none)
            body = apply_objective_priority(request.headers, body, state.config.objective_priorities)
        slot = state.admit()
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
@dataclass(frozen=True)
class CompletionPlan:
    """What a validated /v1/completions call returns around its generations."""

    echo_texts: list[str]  # per prompt: the text echoed in front ("" without echo)
    id_lists: list[list[int]]  # per prompt: its token ids
    score_only: bool  # max_tokens 0: the prompt's logprobs only; the one token run for them is dropped
    echo_logprobs: int | None  # echo with logprobs: top alternatives per prompt token
    prompt_logprobs: int | None  # vLLM's prompt_logprobs extra


def _completion_logprobs(
    view: _Logprobs, plan: CompletionPlan, req: CompletionRequest, job: Job, g: Generation
) -> dict[str, Any] | None:
    if req.logprobs is None:
        return None
    offsets = TextOffsets(0, len(plan.echo_texts[job.prompt_index]) + len(g.text))
    parts = []
    if plan.echo_logprobs is not None:
        parts.append(
            view.prompt_completion(job.prompt_ids, g.prompt_logprobs or [], plan.echo_logprobs, offsets)
        )
    if not plan.score_only:
        parts.append(view.completion(g.token_ids, g.logprobs, g.top_logprobs, offsets))
    merged: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for part in parts:
        for key in merged:
            merged[key].extend(part[key])
    return merged


async def _prepare_completion(state: ServerState, body: Any) -> EventStreamResponse | Deferred:
    req: CompletionRequest = parse(CompletionRequest, body)
    lora = _check_model(state, req.model)
    _check_common(req)
    state.metrics.request_params(req.n)
    _check_prompt_logprobs(req.prompt_logprobs)
    if req.suffix:
        raise validation("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise validation("best_of other than n is not supported", "best_of")
    if req.logprobs is not None and not (0 <= req.logprobs <= 20):
        raise validation("logprobs must be in [0, 20]", "logprobs")
    score_only = req.max_tokens == 0
    if score_only and not (req.echo or req.prompt_logprobs is not None):
        raise validation(
            "max_tokens 0 needs echo or prompt_logprobs (there is nothing else to return)", "max_tokens"
        )
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
    echo_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    wanted = [v for v in (echo_logprobs, req.prompt_logprobs) if v is not None]
    engine_prompt_lps = max(wanted) if wanted else None
    found = vllm_spec(req)
    if found is not None:
        await compile_spec(state, *found)
    spec = found[0] if found else None
    jobs: list[Job] = []
    for pi, ids in enumerate(id_lists):
        for i in range(req.n):
            params = _build_params(
                state,
                req,
                len(ids),
                1 if score_only else req.max_tokens,
                req.logprobs,
                i,
                engine_prompt_lps,
                spec,
            )
            if i == 0:
                check_request(state, ids, params, "max_tokens")
            jobs.append(Job(pi * req.n + i, pi, ids, params, lora, req.priority))
    assert state.llm is not None
    plan = CompletionPlan(
        echo_texts=[
            (t if t is not None else state.llm.tokenizer.decode(ids)) if req.echo else ""
            for t, ids in zip(texts, id_lists, strict=True)
        ],
        id_lists=id_lists,
        score_only=score_only,
        echo_logprobs=echo_logprobs,
        prompt_logprobs=req.prompt_logprobs,
    )
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = lora.name if lora is not None else state.llm.info.served_model_name
    view = _Logprobs(state)

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        counter = UsageCounter(
            sum(len(ids) for ids in id_lists),
            len(jobs),
            bool(req.stream_options and req.stream_options.continuous_usage_stats),
        )

        async def events() -> AsyncIterator[bytes]:
            def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
                return counter.stamp(
                    _stream_chunk(rid, "text_completion", created, model, choices, include_usage)
                )

            offsets = [TextOffsets() for _ in jobs]
            echoed = [False] * len(jobs)
            try:
                async for tagged in merge_streams(_stream_factories(state, jobs)):
                    out, job = tagged.output, jobs[tagged.index]
                    if out.finished and out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                        g = Generation(prompt_ids=job.prompt_ids)
                        g.add(out)
                        g.raise_if_failed()
                    if not echoed[tagged.index] and (req.echo or plan.prompt_logprobs is not None):
                        echoed[tagged.index] = True
                        first: dict[str, Any] = {
                            "index": job.index,
                            "text": plan.echo_texts[job.prompt_index],
                            "logprobs": None,
                            "finish_reason": None,
                        }
                        if echo_logprobs is not None:
                            first["logprobs"] = view.prompt_completion(
                                job.prompt_ids,
                                out.prompt_logprobs or [],
                                echo_logprobs,
                                offsets[tagged.index],
                            )
                        if plan.prompt_logprobs is not None:
                            first["prompt_logprobs"] = view.prompt_logprobs(
                                out.prompt_logprobs, plan.prompt_logprobs
                            )
                        yield openai_event(chunk([first]))
                    if score_only:
                        out_ids: list[int] = []
                        text = ""
                    else:
                        counter.update(tagged.index, out.num_output_tokens)
                        out_ids, text = out.new_token_ids, out.text
                    if not text and not out.finished and (req.logprobs is None or not out_ids):
                        continue
                    choice: dict[str, Any] = {
                        "index": job.index,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    if req.logprobs is not None:
                        chosen, tops = _chosen(out)
                        n = len(out_ids)
                        choice["logprobs"] = view.completion(
                            out_ids, chosen[:n], tops[:n], offsets[tagged.index]
                        )
                    if out.finished:
                        choice["finish_reason"] = (
                            "length" if score_only else _finish_reason(out.finish_reason)
                        )
                        choice["stop_reason"] = None if score_only else out.stop_reason
                    yield openai_event(chunk([choice]))
                if include_usage:
                    yield openai_event(
                        {
                            "id": rid,
                            "object": "text_completion",
                            "created": created,
                            "model": model,
                            "system_fingerprint": SYSTEM_FINGERPRINT,
                            "choices": [],
                            "usage": counter.usage(),
                        }
                    )
            except APIError as e:
                yield _error_event(e)
            yield OPENAI_DONE

        return EventStreamResponse(events())

    return Deferred(jobs, lambda gens: _completion_body(state, req, plan, rid, created, model, jobs, gens))


def _completion_body(
    state: ServerState,
    req: CompletionRequest,
    plan: CompletionPlan,
    rid: str,
    created: int,
    model: str,
    jobs: list[Job],
    gens: list[Generation],
) -> dict[str, Any]:
    view = _Logprobs(state)
    choices = []
    for job, g in zip(jobs, gens, strict=True):
        if plan.score_only:  # the token run to get the prompt's logprobs is not part of the answer
            g.token_ids, g.logprobs, g.top_logprobs, g.text = [], [], [], ""
            g.finish_reason, g.stop_reason = FinishReason.LENGTH, None
        choice: dict[str, Any] = {
            "index": job.index,
            "text": plan.echo_texts[job.prompt_index] + g.text,
            "logprobs": _completion_logprobs(view, plan, req, job, g),
            "finish_reason": _finish_reason(g.finish_reason),
            "stop_reason": g.stop_reason,
        }
        if plan.prompt_logprobs is not None:
            choice["prompt_logprobs"] = view.prompt_logprobs(g.prompt_logprobs, plan.prompt_logprobs)
        choices.append(choice)
    usage = _usage(sum(len(ids) for ids in plan.id_lists), sum(len(g.token_ids) for g in gens))
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": choices,
        "usage": usage,
    }


@router.post("/v1/completions", summary="Completions (OpenAI)")
async def completions(request: Request) -> Response:
    return await _serve(request, _prepare_completion, priority_field=True)


# ---- /v1/chat/completions ----------------------------------------------------------------------------
async def _chat_prompt(
    state: ServerState, req: ChatCompletionRequest, plan: ToolPlan
) -> tuple[list[int], str]:
    """The prompt ids, and the text chat `echo` puts in front of the reply: the last message's
    content when it is the assistant's (the reply's role), as vLLM does."""
    assert state.llm is not None
    messages = template_messages(req.messages)
    tools = [t for t in plan.tools] if plan.active else None
    if tools and not state.llm.tokenizer.chat_template_knows_tools:
        raise validation(
            "this model's chat template does not render tools; start the server with --chat-template", "tools"
        )
    if messages[-1]["role"] == "assistant" and req.add_generation_prompt and len(messages) == 1:
        raise validation("messages must contain at least one non-assistant message", "messages")
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise validation(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )
        if messages[-1]["role"] != "assistant":
            raise validation(
                "continue_final_message needs a final assistant message", "continue_final_message"
            )
    echo = messages[-1]["content"] if req.echo and messages[-1]["role"] == "assistant" else ""
    kwargs = template_kwargs(
        state.llm.tokenizer, req.chat_template_kwargs, req.reasoning_effort, "reasoning_effort"
    )
    try:
        ids = await asyncio.to_thread(
            state.llm.tokenizer.apply_chat_template,
            messages,
            req.add_generation_prompt,
            req.continue_final_message,
            False,
            tools,
            kwargs,
        )
    except Exception as e:  # jinja raises its own errors for messages a template rejects
        raise validation(f"invalid messages for this model's chat template: {e}", "messages") from None
    return ids, echo


async def _prepare_chat(state: ServerState, body: Any) -> EventStreamResponse | Deferred:
    req: ChatCompletionRequest = parse(ChatCompletionRequest, body)
    lora = _check_model(state, req.model)
    _check_common(req)
    state.metrics.request_params(req.n)
    for name in ("separate_reasoning", "stream_reasoning", "include_reasoning"):
        if not getattr(req, name):
            raise validation(f"{name}: false is not supported (reasoning is always separated)", name)
    _check_prompt_logprobs(req.prompt_logprobs)
    if req.stream and req.prompt_logprobs is not None:
        raise validation("prompt_logprobs is not available when stream is true", "prompt_logprobs")
    plan = plan_tools(state, req.tools, req.tool_choice, req.parallel_tool_calls)
    specs: list[tuple[GrammarSpec, str]] = []
    rf = response_format_spec(req.response_format)
    if rf is not None:
        specs.append((rf, "response_format"))
    found = vllm_spec(req)
    if found is not None:
        specs.append(found)
    tool_spec = plan.grammar()
    if tool_spec is not None:
        specs.append((tool_spec, "tool_choice"))
    if len(specs) > 1:
        raise validation(f"give one output constraint, got {', '.join(p for _, p in specs)}", specs[1][1])
    spec = specs[0][0] if specs else None
    if specs:
        await compile_spec(state, *specs[0])
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise validation("top_logprobs requires logprobs to be true", "top_logprobs")
        if not (0 <= req.top_logprobs <= 20):
            raise validation("top_logprobs must be in [0, 20]", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    ids, echo = await _chat_prompt(state, req, plan)
    assert state.llm is not None
    answer_grammar = next((p for _, p in specs if p in ("response_format", "tool_choice")), None)
    reasoning = plan_reasoning(state.config.reasoning_parser, state.llm.tokenizer, ids, answer_grammar)
    if spec is not None and answer_grammar is not None:
        spec = reasoning.answer_grammar(spec)
    jobs = []
    for i in range(req.n):
        params = _build_params(state, req, len(ids), max_tokens, logprobs, i, req.prompt_logprobs, spec)
        if reasoning.keep_special_tokens:  # harmony's channel markers are special tokens
            params = dataclasses.replace(params, skip_special_tokens=False)
        if i == 0:
            check_request(state, ids, params, "max_tokens")
        jobs.append(Job(i, 0, ids, params, lora, req.priority))
    assert state.llm is not None
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = lora.name if lora is not None else state.llm.info.served_model_name
    view = _Logprobs(state)

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        counter = UsageCounter(
            len(ids), len(jobs), bool(req.stream_options and req.stream_options.continuous_usage_stats)
        )

        # text-generation's Client.chat (TGI 2's Messages API; it sends TGI's placeholder "tgi") validates
        # every chunk: `role` and `tool_calls` in every delta, and no `[DONE]` line (it parses each data
        # line as JSON). OpenAI's shape sends the role once: the openai SDK's .stream() helper
        # concatenates string fields across deltas.
        tgi_shape = req.model == "tgi" and lora is None

        def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
            if tgi_shape:
                choices = [
                    {**c, "delta": {"role": "assistant", "tool_calls": None, **c["delta"]}} for c in choices
                ]
            return counter.stamp(
                _stream_chunk(rid, "chat.completion.chunk", created, model, choices, include_usage)
            )

        async def events() -> AsyncIterator[bytes]:
            tool_streams = [ToolStream(plan) for _ in jobs]
            reasoning_streams = [reasoning.stream() for _ in jobs]
            job_token_texts: list[list[str]] = [[] for _ in jobs]  # for usage's reasoning_tokens
            try:
                for j in jobs:
                    first = {"index": j.index, "delta": {"role": "assistant", "content": ""}}
                    yield openai_event(chunk([{**first, "logprobs": None, "finish_reason": None}]))
                    if echo:
                        yield openai_event(
                            chunk(
                                [
                                    {
                                        "index": j.index,
                                        "delta": {"content": echo},
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
                    counter.update(tagged.index, out.num_output_tokens)
                    ts = tool_streams[tagged.index]
                    rs = reasoning_streams[tagged.index]
                    if rs is None:
                        delta = ts.feed(out.text, out.finished)
                    else:  # thinking as vLLM streams it: its own delta field, the answer in content
                        job_token_texts[tagged.index].extend(token_texts(out))
                        thought, answer = rs.feed(out.text, out.finished)
                        delta = ts.feed(answer, out.finished)
                        if thought:
                            delta = {"reasoning_content": thought, "reasoning": thought, **delta}
                    if not delta and not out.finished and logprobs is None:
                        continue
                    choice: dict[str, Any] = {
                        "index": tagged.index,
                        "delta": delta,
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    if logprobs is not None:
                        chosen, tops = _chosen(out)
                        choice["logprobs"] = view.chat(out.new_token_ids, chosen, tops)
                    if out.finished:
                        choice["finish_reason"] = _chat_finish_reason(out.finish_reason, ts.called)
                        choice["stop_reason"] = out.stop_reason
                    yield openai_event(chunk([choice]))
                thought_tokens = sum(
                    count_reasoning_tokens(texts, rs.split_so_far())
                    for texts, rs in zip(job_token_texts, reasoning_streams, strict=True)
                    if rs is not None
                )
                state.metrics.reasoning_tokens_generated(thought_tokens)
                if include_usage:
                    usage = counter.usage()
                    if state.config.reasoning_parser is not None:
                        usage["completion_tokens_details"] = {"reasoning_tokens": thought_tokens}
                    yield openai_event(
                        {
                            "id": rid,
                            "object": "chat.completion.chunk",
                            "created": created,
                            "model": model,
                            "system_fingerprint": SYSTEM_FINGERPRINT,
                            "choices": [],
                            "usage": usage,
                        }
                    )
            except APIError as e:
                yield _error_event(e)
            if not tgi_shape:
                yield OPENAI_DONE

        return EventStreamResponse(events())

    def build(gens: list[Generation]) -> dict[str, Any]:
        choices = []
        reasoning_tokens = 0
        for job, g in zip(jobs, gens, strict=True):
            answer, thought = g.text, None
            if reasoning.parser is not None:
                split = reasoning.parser.split(g.text)
                answer, thought = split.content or "", split.reasoning
                reasoning_tokens += count_reasoning_tokens(g.token_texts, split)
            message: dict[str, Any] = {"role": "assistant", "content": (echo + answer) or None}
            if reasoning.parser is None and not plan.active:
                message["content"] = echo + answer  # "" stays "" without a parser, as before
            if state.config.reasoning_parser is not None:  # vLLM's field names, the older and current one
                message["reasoning_content"] = message["reasoning"] = thought
            called = False
            if plan.active:  # the same parse as the stream's (ToolStream): the same calls and content
                parsed = plan.parse(answer)
                message = {**message, "content": (echo + parsed.content) or None}
                if parsed.calls:
                    called = True
                    message["tool_calls"] = message_tool_calls(parsed.calls)
            choices.append(
                {
                    "index": job.index,
                    "message": message,
                    "logprobs": view.chat(g.token_ids, g.logprobs, g.top_logprobs)
                    if logprobs is not None
                    else None,
                    "finish_reason": _chat_finish_reason(g.finish_reason, called),
                    "stop_reason": g.stop_reason,
                }
            )
        cached = gens[0].num_cached_tokens if gens else 0
        body: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": choices,
            "usage": _usage(len(ids), sum(len(g.token_ids) for g in gens), cached),
        }
        state.metrics.reasoning_tokens_generated(reasoning_tokens)
        if state.config.reasoning_parser is not None:
            body["usage"]["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = view.prompt_logprobs(gens[0].prompt_logprobs, req.prompt_logprobs)
        return body

    return Deferred(jobs, build)


@router.post("/v1/chat/completions", summary="Chat completions (OpenAI)")
async def chat_completions(request: Request) -> Response:
    return await _serve(request, _prepare_chat, priority_field=True)


@router.get("/v1/models", summary="Served models (OpenAI)")
async def models(request: Request) -> Response:
    state = server_state(request)
    if state.llm is None or state.limits is None:
        return APIError(ErrorKind.UNAVAILABLE, "the model is still loading").response(Family.OPENAI)
    return JSONResponse({"object": "list", "data": _model_cards(state, request)})


@router.get("/v1/models/{model_id:path}", summary="One served model (OpenAI's models.retrieve)")
async def model_card(request: Request, model_id: str) -> Response:
    """The card `/v1/models` lists under `model_id` (ids may hold `/`: a path or an org/name)."""
    state = server_state(request)
    if state.llm is None or state.limits is None:
        return APIError(ErrorKind.UNAVAILABLE, "the model is still loading").response(Family.OPENAI)
    for card in _model_cards(state, request):
        if card["id"] == model_id:
            return JSONResponse(card)
    return APIError(ErrorKind.NOT_FOUND, f"The model `{model_id}` does not exist.", "model").response(
        Family.OPENAI
    )


def _model_cards(state: ServerState, request: Request) -> list[dict[str, Any]]:
    assert state.llm is not None and state.limits is not None
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
    # LoRA adapters as vLLM lists them (parent = the base model). root, vLLM's server-side folder, is
    # management data: only a caller who may load adapters sees it (the operator's adapter sync compares
    # it with the uri it loaded); to everyone else root is the adapter's name (OpenAI shows ids only).
    cfg = state.config
    manager = (
        admin.cross_site_refusal(request.scope) is None
        and admin.ManagementGuard(cfg.api_key, cfg.admin_api_key, cfg.host).refusal(request.scope) is None
    )
    adapters = [
        {
            **base,
            "id": a.name,
            "root": a.path if manager else a.name,
            "parent": a.base_model_name or info.served_model_name,
        }
        for a in (state.llm.lora.names() if state.llm.lora is not None else [])
    ]
    return [base, *adapters]
