"""Runs engine requests for the routes: body reading, tokenization off the loop, metrics per request,
disconnect watching for non-streaming responses, and merging several engine streams into one."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from starlette.requests import ClientDisconnect

from server.core.outputs import Logprob, RequestOutput, TokenLogprobs
from server.engine import EngineDeadError
from server.metrics import FinishedRequestTimes
from server.request import FinishReason, LoRARequest, SamplingParams

from .errors import APIError, ErrorKind, validation
from .json_body import parse_json_body
from .state import ServerState

T = TypeVar("T")

# Tokenizing a long text takes long enough to stall every stream on the event loop.
_TOKENIZE_IN_THREAD_CHARS = 8192
# OpenAI and TGI both forbid NaN/inf in JSON; vLLM reports -inf logprobs as this.
MIN_LOGPROB = -9999.0


class ClientGone(Exception):
    """The client disconnected before the response was ready; its engine requests were aborted."""


def safe_logprob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


async def read_json(request: Request, max_bytes: int) -> Any:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise APIError(ErrorKind.TOO_LARGE, f"request body is larger than {max_bytes} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise APIError(ErrorKind.TOO_LARGE, f"request body is larger than {max_bytes} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        # Gone halfway through its body (e.g. a client timeout on a busy server): cancelled, not a 500.
        raise ClientGone() from None
    return parse_json_body(b"".join(chunks))


async def encode(state: ServerState, text: str, add_special_tokens: bool = True) -> list[int]:
    assert state.llm is not None
    tok = state.llm.tokenizer
    if len(text) > _TOKENIZE_IN_THREAD_CHARS:
        return await asyncio.to_thread(tok.encode, text, add_special_tokens)
    return tok.encode(text, add_special_tokens)


# The model names TGI's clients send for "the served model" (TGI serves one model and ignores the
# field): text_generation.Client.chat sends "tgi", TGI's docs and huggingface_hub examples "tgi" or
# "dummy". They name the base model on every route; a served model or adapter of that name wins.
TGI_MODEL_PLACEHOLDERS = frozenset({"tgi", "dummy"})


def names_base_model(name: str | None, served: tuple[str | None, ...]) -> bool:
    """Whether a request's `model` asks for the base model: unset, one of its `served` names, or one
    of TGI's placeholders."""
    return name is None or name in served or name in TGI_MODEL_PLACEHOLDERS


def resolve_adapter(state: ServerState, name: str | None) -> LoRARequest | None:
    """The LoRA adapter loaded under `name`, or None when `name` is the base model (or not given, or
    one of TGI's placeholders). Raises a 404 APIError for any other name."""
    assert state.llm is not None
    served = (state.llm.info.served_model_name, state.llm.info.model_id)
    if name is None or name in served:
        return None
    lora = state.llm.lora.get(name) if state.llm.lora is not None else None
    if lora is None:
        if names_base_model(name, served):
            return None
        raise APIError(ErrorKind.NOT_FOUND, f"The model `{name}` does not exist.", "model")
    return lora


def check_request(
    state: ServerState, prompt_ids: list[int], params: SamplingParams, new_tokens_name: str
) -> None:
    """The API's token limits, then the engine's own checks; raises a validation APIError."""
    assert state.limits is not None and state.llm is not None
    lim = state.limits
    n = len(prompt_ids)
    if n > lim.max_input_tokens:
        raise validation(
            f"Input validation error: `inputs` must have less than {lim.max_input_tokens + 1} tokens. "
            f"Given: {n} (max_input_tokens={lim.max_input_tokens}, max_total_tokens={lim.max_total_tokens})",
            "prompt",
        )
    if n + params.max_tokens > lim.max_total_tokens:
        raise validation(
            f"Input validation error: `inputs` tokens + `{new_tokens_name}` must be <= {lim.max_total_tokens}. "
            f"Given: {n} `inputs` tokens and {params.max_tokens} `{new_tokens_name}` "
            f"(max_input_tokens={lim.max_input_tokens}, max_total_tokens={lim.max_total_tokens})",
            new_tokens_name,
        )
    try:
        state.llm.validate(prompt_ids, params)
    except ValueError as e:
        raise validation(f"Input validation error: {e}") from None


def make_params(**kwargs: Any) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise validation(f"Input validation error: {e}") from None


@dataclass
class Generation:
    """One engine request's result, accumulated from its stream."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)  # each token's own text
    logprobs: list[Logprob | None] = field(default_factory=list)
    top_logprobs: list[list[Logprob]] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    def add(self, out: RequestOutput) -> list[str]:
        """Folds one output in; returns each new token's own text (TGI's token.text)."""
        texts = token_texts(out)
        for i, tid in enumerate(out.new_token_ids):
            self.token_ids.append(tid)
            self.token_texts.append(texts[i])
            lp = out.new_logprobs[i] if i < len(out.new_logprobs) else None
            self.logprobs.append(lp.chosen if lp is not None else None)
            self.top_logprobs.append(list(lp.top) if lp is not None else [])
        self.text += out.text
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_cached_tokens = out.num_cached_tokens
        if out.metrics is not None:
            self.arrival_time = out.metrics.arrival_time
            self.first_scheduled_time = out.metrics.first_scheduled_time
            self.first_token_time = out.metrics.first_token_time
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason
            self.error = out.error
            self.finished_time = out.metrics.finished_time if out.metrics else time.monotonic()
        return texts

    @property
    def logprob_sum(self) -> float:
        return sum(lp.logprob for lp in self.logprobs if lp is not None)

    def raise_if_failed(self) -> None:
        if self.finish_reason is FinishReason.ERROR:
            raise APIError(
                ErrorKind.GENERATION, f"Request failed during generation: {self.error or 'engine error'}"
            )
        if self.finish_reason is None or self.finish_reason is FinishReason.ABORT:
            raise APIError(ErrorKind.INCOMPLETE, "Request failed during generation: the request was aborted")


def token_texts(out: RequestOutput) -> list[str]:
    """Each new token's own text, as the detokenizer decoded it token by token: never shifted
    between tokens by stop-string hold-back (the released `out.text` may lag behind)."""
    if len(out.new_token_texts) == len(out.new_token_ids):
        return list(out.new_token_texts)
    n = len(out.new_token_ids)
    return [""] * max(0, n - 1) + [out.text] if n else []


async def stream_engine(
    state: ServerState,
    prompt_ids: list[int],
    params: SamplingParams,
    lora: LoRARequest | None = None,
    priority: int = 0,
) -> AsyncIterator[RequestOutput]:
    """The engine's stream for one request, recording its metrics when it ends (however it ends).
    Closing this generator early aborts the engine request."""
    engine = state.engine
    if engine is None:
        raise APIError(ErrorKind.UNAVAILABLE, "the model is still loading")
    if state.cut_reason is not None:
        raise APIError(ErrorKind.UNAVAILABLE, state.cut_reason)
    arrival = time.monotonic()
    last_token_at: float | None = None
    gaps: list[float] = []
    final: RequestOutput | None = None
    num_out = 0
    first_scheduled: float | None = None
    first_token: float | None = None
    try:
        if lora is not None:
            state.metrics.lora_request(lora.name)
        async for out in engine.generate(prompt_ids, params, lora=lora, priority=priority):
            now = time.monotonic()
            if out.metrics is not None:
                arrival = out.metrics.arrival_time
                first_scheduled = out.metrics.first_scheduled_time
                first_token = out.metrics.first_token_time
            if out.new_token_ids:
                if last_token_at is not None:
                    gaps.extend([(now - last_token_at) / len(out.new_token_ids)] * len(out.new_token_ids))
                last_token_at = now
            num_out = out.num_output_tokens
            if out.finished:
                final = out
                if out.finish_reason is FinishReason.ABORT and state.cut_reason is not None:
                    raise APIError(ErrorKind.UNAVAILABLE, state.cut_reason)
            yield out
    except ValueError as e:
        raise validation(f"Input validation error: {e}") from None
    except EngineDeadError as e:
        raise APIError(ErrorKind.INCOMPLETE, f"Request failed during generation: {e}") from None
    finally:
        reason = str(final.finish_reason) if final is not None and final.finish_reason else "abort"
        state.metrics.request_finished(
            FinishedRequestTimes(
                finished_reason=reason,
                num_prompt_tokens=len(prompt_ids),
                num_generation_tokens=num_out,
                arrival_time=arrival,
                first_scheduled_time=first_scheduled,
                first_token_time=first_token,
                finished_time=time.monotonic(),
                inter_token_latencies=tuple(gaps),
            )
        )


async def collect(
    state: ServerState,
    prompt_ids: list[int],
    params: SamplingParams,
    lora: LoRARequest | None = None,
    priority: int = 0,
) -> Generation:
    gen = Generation(prompt_ids=list(prompt_ids))
    async for out in stream_engine(state, prompt_ids, params, lora, priority):
        gen.add(out)
    return gen


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Runs `work`, cancelling it (which aborts its engine requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone()


@dataclass(frozen=True)
class Tagged:
    index: int
    output: RequestOutput


async def merge_streams(streams: list[Callable[[], AsyncIterator[RequestOutput]]]) -> AsyncIterator[Tagged]:
    """Interleaves several engine streams as their outputs arrive. Closing the merged stream cancels
    (and so aborts) every stream still running; an error in one is raised here after cancelling the rest."""
    queue: asyncio.Queue[Tagged | BaseException | None] = asyncio.Queue()

    async def pump(i: int, make: Callable[[], AsyncIterator[RequestOutput]]) -> None:
        try:
            async for out in make():
                await queue.put(Tagged(i, out))
        except Exception as e:
            await queue.put(e)
            return
        await queue.put(None)

    tasks = [asyncio.create_task(pump(i, make)) for i, make in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
