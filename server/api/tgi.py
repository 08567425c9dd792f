"""TGI's routes: /generate, /generate_stream, POST / (with "stream"), /info (/tokenize: utility.py)."""

from __future__ import annotations

import asyncio
import importlib.metadata
import random
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.core.outputs import Logprob
from server.request import FinishReason, LoRARequest, SamplingParams

from .errors import APIError, Family, validation
from .generation import (
    ClientGone,
    Generation,
    check_request,
    collect,
    encode,
    make_params,
    read_json,
    safe_logprob,
    stream_engine,
    until_disconnect,
)
from .protocol import TGIRequest, parse
from .sse import EventStreamResponse, tgi_event
from .state import ServerState, server_state
from .structured import compile_spec, tgi_grammar_spec

router = APIRouter(tags=["TGI"])


def _version() -> str:
    try:
        return importlib.metadata.version("kubeinfer")
    except importlib.metadata.PackageNotFoundError:  # running from a source checkout
        return "0.1.0"


VERSION = _version()


@dataclass(frozen=True)
class TGIPlan:
    """A validated TGI request, ready for the engine."""

    inputs: str
    prompt_ids: list[int]
    params: list[SamplingParams]  # one per best_of sequence
    seeds: list[int | None]
    details: bool
    decoder_input_details: bool
    top_n_tokens: int
    return_full_text: bool
    received_at: float
    validated_at: float
    lora: LoRARequest | None = None  # parameters.adapter_id; None = the base model


def _finish_reason(gen: Generation) -> str:
    if gen.finish_reason is FinishReason.LENGTH:
        return "length"
    if isinstance(gen.stop_reason, str):
        return "stop_sequence"
    return "eos_token"


def _adapter(state: ServerState, adapter_id: str | None) -> LoRARequest | None:
    """TGI's `adapter_id`: a loaded LoRA adapter's name (the base model's id, or none, = the base model)."""
    assert state.llm is not None
    if not adapter_id or adapter_id in (state.llm.info.served_model_name, state.llm.info.model_id):
        return None
    if state.llm.lora is None:
        raise validation(
            "Input validation error: `adapter_id` needs a server started with --enable-lora", "adapter_id"
        )
    lora = state.llm.lora.get(adapter_id)
    if lora is None:
        raise validation(f"Input validation error: adapter `{adapter_id}` is not loaded", "adapter_id")
    return lora


async def _plan(state: ServerState, req: TGIRequest, stream: bool, received_at: float) -> TGIPlan:
    cfg = state.config
    assert state.limits is not None
    lim = state.limits
    p = req.parameters
    if not req.inputs:
        raise validation("Input validation error: `inputs` cannot be empty", "inputs")
    if p.temperature is not None and not p.temperature > 0:
        raise validation("Input validation error: `temperature` must be strictly positive", "temperature")
    if p.top_p is not None and not (0.0 < p.top_p < 1.0):
        raise validation("Input validation error: `top_p` must be > 0.0 and < 1.0", "top_p")
    if p.top_k is not None and p.top_k <= 0:
        raise validation("Input validation error: `top_k` must be strictly positive", "top_k")
    if p.repetition_penalty is not None and not p.repetition_penalty > 0:
        raise validation(
            "Input validation error: `repetition_penalty` must be strictly positive", "repetition_penalty"
        )
    if p.frequency_penalty is not None and not (-2.0 <= p.frequency_penalty <= 2.0):
        raise validation(
            "Input validation error: `frequency_penalty` must be >= -2.0 and <= 2.0", "frequency_penalty"
        )
    if p.typical_p is not None and not (0.0 < p.typical_p <= 1.0):
        raise validation("Input validation error: `typical_p` must be > 0.0 and < 1.0", "typical_p")
    if p.typical_p is not None and p.typical_p < 1.0:
        raise validation("Input validation error: `typical_p` is not supported by this server", "typical_p")
    if p.watermark:
        raise validation("Input validation error: `watermark` is not supported by this server", "watermark")
    lora = _adapter(state, p.adapter_id)
    if p.max_new_tokens is not None and p.max_new_tokens < 1:
        raise validation(
            "Input validation error: `max_new_tokens` must be strictly positive", "max_new_tokens"
        )
    if p.seed is not None and not (0 <= p.seed < 2**63):
        raise validation("Input validation error: `seed` must be in [0, 2**63)", "seed")
    if len(p.stop) > cfg.max_stop_sequences:
        raise validation(
            f"Input validation error: `stop` supports up to {cfg.max_stop_sequences} stop sequences. "
            f"Given: {len(p.stop)}",
            "stop",
        )
    top_n = p.top_n_tokens or 0
    if not (0 <= top_n <= cfg.max_top_n_tokens):
        raise validation(
            f"Input validation error: `top_n_tokens` must be >= 0 and <= {cfg.max_top_n_tokens}. Given: {top_n}",
            "top_n_tokens",
        )
    if p.truncate is not None and not (0 < p.truncate <= lim.max_input_tokens):
        raise validation(
            f"Input validation error: `truncate` must be strictly positive and less than "
            f"{lim.max_input_tokens + 1}. Given: {p.truncate}",
            "truncate",
        )
    # TGI samples when asked to, or when any warper is set (its NextTokenChooser: do_sample or has_warpers).
    sampling = (
        p.do_sample
        or (p.temperature is not None and p.temperature != 1.0)
        or (p.top_k is not None and p.top_k != 0)
        or (p.top_p is not None and p.top_p < 1.0)
    )
    best_of = p.best_of if p.best_of is not None else 1
    if best_of < 1 or best_of > cfg.max_best_of:
        raise validation(
            f"Input validation error: `best_of` must be > 0 and <= {cfg.max_best_of}. Given: {best_of}",
            "best_of",
        )
    if best_of > 1:
        if stream:
            raise validation(
                "Input validation error: `best_of` != 1 is not supported when streaming tokens", "best_of"
            )
        if p.seed is not None:
            raise validation("Input validation error: `seed` must not be set when `best_of` > 1", "seed")
        if not sampling:
            raise validation("Input validation error: you must use sampling when `best_of` is > 1", "best_of")
    if stream and p.decoder_input_details:
        raise validation(
            "Input validation error: `decoder_input_details` == true is not supported when streaming tokens",
            "decoder_input_details",
        )

    spec = tgi_grammar_spec(p.grammar)
    if spec is not None:
        await compile_spec(state, spec, "parameters.grammar")
    prompt_ids = await encode(state, req.inputs)
    if p.truncate is not None:
        prompt_ids = prompt_ids[-p.truncate :]
    max_new = (
        p.max_new_tokens if p.max_new_tokens is not None else max(1, lim.max_total_tokens - len(prompt_ids))
    )
    seeds: list[int | None] = []
    params: list[SamplingParams] = []
    for _ in range(best_of):
        seed = (p.seed if p.seed is not None else random.getrandbits(63)) if sampling else None
        seeds.append(seed)
        params.append(
            make_params(
                max_tokens=max_new,
                temperature=(p.temperature or 1.0) if sampling else 0.0,
                top_k=(p.top_k or 0) if sampling else 0,
                top_p=(p.top_p or 1.0) if sampling else 1.0,
                repetition_penalty=p.repetition_penalty or 1.0,
                frequency_penalty=p.frequency_penalty or 0.0,
                seed=seed,
                stop=tuple(p.stop),
                logprobs=top_n,  # TGI reports every token's logprob
                prompt_logprobs=0 if p.decoder_input_details else None,
                include_stop_str_in_output=True,  # TGI's generated_text keeps the stop sequence
                structured=spec,
            )
        )
    check_request(state, prompt_ids, params[0], "max_new_tokens")
    return TGIPlan(
        inputs=req.inputs,
        prompt_ids=prompt_ids,
        params=params,
        seeds=seeds,
        details=p.details,
        decoder_input_details=p.decoder_input_details,
        top_n_tokens=top_n,
        return_full_text=bool(p.return_full_text),
        received_at=received_at,
        validated_at=time.monotonic(),
        lora=lora,
    )


class _TokenView:
    """Token dicts in TGI's shape."""

    def __init__(self, state: ServerState) -> None:
        assert state.llm is not None
        self.tok = state.llm.tokenizer

    def token(self, tid: int, text: str, lp: Logprob | None) -> dict[str, Any]:
        special = tid in self.tok.all_special_ids
        return {
            "id": tid,
            # Special tokens are skipped in the released text; TGI shows them in token.text.
            "text": self.tok.token_text(tid) if special else text,
            "logprob": safe_logprob(lp.logprob) if lp is not None else None,
            "special": special,
        }

    def alt(self, lp: Logprob) -> dict[str, Any]:
        return {
            "id": lp.token_id,
            "text": self.tok.token_text(lp.token_id),
            "logprob": safe_logprob(lp.logprob),
            "special": lp.token_id in self.tok.all_special_ids,
        }

    def prefill(self, gen: Generation) -> list[dict[str, Any]]:
        lps = gen.prompt_logprobs or []
        out = []
        for i, tid in enumerate(gen.prompt_ids):
            lp = lps[i] if i < len(lps) else None
            out.append(
                {
                    "id": tid,
                    "text": self.tok.token_text(tid),
                    "logprob": None if lp is None else safe_logprob(lp.chosen.logprob),
                }
            )
        return out


def _sequence_details(view: _TokenView, plan: TGIPlan, gen: Generation, seed: int | None) -> dict[str, Any]:
    d: dict[str, Any] = {
        "finish_reason": _finish_reason(gen),
        "generated_tokens": len(gen.token_ids),
        "seed": seed,
        "prefill": view.prefill(gen) if plan.decoder_input_details else [],
        "tokens": [
            view.token(tid, text, lp)
            for tid, text, lp in zip(gen.token_ids, gen.token_texts, gen.logprobs, strict=True)
        ],
    }
    if plan.top_n_tokens:
        d["top_tokens"] = [[view.alt(a) for a in alts] for alts in gen.top_logprobs]
    return d


def _full_text(plan: TGIPlan, text: str) -> str:
    return plan.inputs + text if plan.return_full_text else text


async def _run(state: ServerState, plan: TGIPlan) -> list[Generation]:
    gens = await asyncio.gather(*(collect(state, plan.prompt_ids, sp, plan.lora) for sp in plan.params))
    for g in gens:
        g.raise_if_failed()
    return list(gens)


def _headers(state: ServerState, plan: TGIPlan, gen: Generation) -> dict[str, str]:
    now = time.monotonic()
    total = now - plan.received_at
    queue = (gen.first_scheduled_time - gen.arrival_time) if gen.first_scheduled_time else 0.0
    inference = (now - gen.first_scheduled_time) if gen.first_scheduled_time else 0.0
    n = max(1, len(gen.token_ids))
    device = state.llm.info.device if state.llm else "cpu"
    return {
        "x-compute-type": "gpu" if device.startswith("cuda") else "cpu",
        "x-compute-time": f"{total:.6f}",
        "x-compute-characters": str(len(plan.inputs)),
        "x-total-time": str(int(total * 1000)),
        "x-validation-time": str(int((plan.validated_at - plan.received_at) * 1000)),
        "x-queue-time": str(int(queue * 1000)),
        "x-inference-time": str(int(inference * 1000)),
        "x-time-per-token": str(int(inference * 1000 / n)),
        "x-prompt-tokens": str(len(plan.prompt_ids)),
        "x-generated-tokens": str(len(gen.token_ids)),
    }


def _response_body(
    state: ServerState, plan: TGIPlan, gens: list[Generation]
) -> tuple[dict[str, Any], Generation]:
    view = _TokenView(state)
    best = max(range(len(gens)), key=lambda i: gens[i].logprob_sum) if len(gens) > 1 else 0
    gen = gens[best]
    body: dict[str, Any] = {"generated_text": _full_text(plan, gen.text)}
    if plan.details:
        details = _sequence_details(view, plan, gen, plan.seeds[best])
        if len(gens) > 1:
            others = []
            for i, g in enumerate(gens):
                if i != best:
                    seq = _sequence_details(view, plan, g, plan.seeds[i])
                    others.append({"generated_text": _full_text(plan, g.text), **seq})
            details["best_of_sequences"] = others
        body["details"] = details
    return body, gen


async def _events(state: ServerState, plan: TGIPlan) -> AsyncIterator[bytes]:
    view = _TokenView(state)
    gen = Generation(prompt_ids=list(plan.prompt_ids))
    index = 0
    last_token: dict[str, Any] | None = None
    try:
        async for out in stream_engine(state, plan.prompt_ids, plan.params[0], plan.lora):
            texts = gen.add(out)
            failed = out.finished and out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT)
            n = len(out.new_token_ids)
            for i, tid in enumerate(out.new_token_ids):
                index += 1
                lp = out.new_logprobs[i] if i < len(out.new_logprobs) else None
                token = view.token(tid, texts[i], lp.chosen if lp else None)
                last_token = token
                event: dict[str, Any] = {"index": index, "token": token}
                if plan.top_n_tokens:
                    event["top_tokens"] = [view.alt(a) for a in (lp.top if lp else [])]
                final = out.finished and i == n - 1 and not failed
                event["generated_text"] = _full_text(plan, gen.text) if final else None
                event["details"] = _stream_details(plan, gen) if final else None
                yield tgi_event(event)
            if not out.finished:
                continue
            if failed:
                gen.raise_if_failed()
            if n == 0:
                # Finished without a new token (rare: e.g. text flushed at the end): close with the last token.
                token = last_token or {"id": 0, "text": "", "logprob": None, "special": True}
                yield tgi_event(
                    {
                        "index": index,
                        "token": token,
                        "generated_text": _full_text(plan, gen.text),
                        "details": _stream_details(plan, gen),
                    }
                )
            state.metrics.request_succeeded()
    except APIError as e:
        state.metrics.request_failed(e.kind.value)
        yield tgi_event(e.body(Family.TGI))


def _stream_details(plan: TGIPlan, gen: Generation) -> dict[str, Any]:
    return {
        "finish_reason": _finish_reason(gen),
        "generated_tokens": len(gen.token_ids),
        "seed": plan.seeds[0],
        "input_length": len(plan.prompt_ids),
    }


async def _handle(request: Request, stream: bool | None, as_list: bool) -> Response:
    state = server_state(request)
    received_at = time.monotonic()
    state.metrics.request_received()
    slot = None
    try:
        # Admitted once the body is read: a slow body holds no slot (server/api/limits.py times it out)
        body = await read_json(request, state.config.max_payload_bytes)
        slot = state.admit()
        req: TGIRequest = parse(TGIRequest, body)
        streaming = req.stream if stream is None else stream
        plan = await _plan(state, req, streaming, received_at)
        if streaming:
            response = EventStreamResponse(
                _events(state, plan),
                headers={
                    "x-compute-type": "gpu"
                    if state.llm and state.llm.info.device.startswith("cuda")
                    else "cpu"
                },
                on_close=slot.release,
            )
            slot = None  # the response releases it when the stream ends
            return response
        gens = await until_disconnect(request, _run(state, plan))
        resp_body, gen = _response_body(state, plan, gens)
        state.metrics.request_succeeded()
        return JSONResponse([resp_body] if as_list else resp_body, headers=_headers(state, plan, gen))
    except APIError as e:
        state.metrics.request_failed(e.kind.value)
        return e.response(Family.TGI)
    except ClientGone:
        state.metrics.request_failed("cancelled")
        return Response(status_code=499)
    finally:
        if slot is not None:
            slot.release()


@router.post("/generate", summary="Generate tokens (TGI)")
async def generate(request: Request) -> Response:
    return await _handle(request, stream=False, as_list=False)


@router.post("/generate_stream", summary="Generate a stream of tokens as server-sent events (TGI)")
async def generate_stream(request: Request) -> Response:
    return await _handle(request, stream=True, as_list=False)


@router.post("/", summary="Generate, streaming when the body says stream=true (TGI compat route)")
async def compat_generate(request: Request) -> Response:
    return await _handle(request, stream=None, as_list=True)


@router.get("/info", summary="Model and router information (TGI)")
async def info(request: Request) -> Response:
    state = server_state(request)
    if state.llm is None or state.limits is None:
        return JSONResponse(
            {"error": "the model is still loading", "error_type": "unavailable"}, status_code=503
        )
    cfg = state.config
    i = state.llm.info
    return JSONResponse(
        {
            "model_id": i.model_id,
            "model_sha": None,
            "model_dtype": i.dtype,
            "model_device_type": "cuda" if i.device.startswith("cuda") else "cpu",
            "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": cfg.max_concurrent_requests,
            "max_best_of": cfg.max_best_of,
            "max_stop_sequences": cfg.max_stop_sequences,
            "max_input_tokens": state.limits.max_input_tokens,
            "max_total_tokens": state.limits.max_total_tokens,
            "validation_workers": 1,
            "max_client_batch_size": cfg.max_client_batch_size,
            "router": "kubeinfer",
            "version": VERSION,
            "sha": None,
            "docker_label": None,
            # ours
            "served_model_name": i.served_model_name,
            "architecture": i.architecture,
            "dtype": i.dtype,
            "quantization": i.quantization,
            "num_parameters": i.num_parameters,
            "weight_bytes": i.weight_bytes,
            # the int8 batched path's packed copies of block-quantized weights, resident beside weight_bytes
            # (made at load only where they fit beside the KV cache still to allocate: gemm_dtype.py)
            "packed_weight_bytes": i.packed_weight_bytes,
            # a GGUF served as it is: the tensors held as fp32 (no kept layout for their type), each with
            # its bytes resident and beyond the file's; null for other models
            "gguf_dequantized": None
            if i.gguf_dequantized is None
            else {
                "tensors": [
                    {
                        "name": d.name,
                        "type": d.gguf_type,
                        "resident_bytes": d.resident_bytes,
                        "extra_bytes": d.extra_bytes,
                    }
                    for d in i.gguf_dequantized
                ],
                "extra_bytes": sum(d.extra_bytes for d in i.gguf_dequantized),
            },
            # where the memory goes, estimated from the model's files before loading (bytes; null when
            # the files could not be read for it): server/memory_estimate.py's MemoryEstimate
            "memory": None if i.memory is None else asdict(i.memory),
            "kv_block_size": i.block_size,
            "kv_blocks": i.num_kv_blocks,
            # the KV cache's layer groups (server/core/kv_groups.py): group 0 the full-attention layers,
            # group 1 (models that interleave sliding-window layers) the windowed ones, each with its
            # own blocks of one layer; blocks behind a window go back to group 1's pool
            "kv_groups": [
                {
                    "layers": [n for n, lg in enumerate(i.kv_layout.layer_group) if lg == g],
                    "blocks": spec.num_blocks,
                    "sliding_window": spec.sliding_window,
                }
                for g, spec in enumerate(i.kv_layout.groups)
            ]
            if i.kv_layout is not None
            else None,
            "kv_cache_dtype": i.kv_cache_dtype,
            # the block-quantized GEMMs' dtype on CPU (server/quant/gemm_dtype.py): float32, bfloat16, or
            # int8 (fp32 layers whose quantized GEMMs take int8 activations where a kernel has them)
            "gemm_dtype": i.gemm_dtype,
            "max_num_seqs": i.max_num_seqs,
            "max_num_batched_tokens": i.max_num_batched_tokens,
            "attention_backend": i.attention_backend,
            "device": i.device,
        }
    )
