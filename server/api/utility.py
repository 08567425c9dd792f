"""Utility routes: POST /tokenize (TGI's body or vLLM's), POST /detokenize and GET /version (vLLM).

/tokenize answers in the shape of the body it got: `{"inputs": ...}` is TGI's request and gets
TGI's list of `{id, text, start, stop}` (TGI errors); `{"prompt": ...}` or `{"messages": [...]}` is
vLLM's and gets `{count, max_model_len, tokens[, token_strs]}` (OpenAI-shaped errors, as vLLM).
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from server.tokenizer import Tokenizer

from .embeddings import TEIDecodeRequest
from .errors import APIError, ErrorKind, Family, validation
from .generation import names_base_model, read_json
from .protocol import (
    DetokenizeRequest,
    TGITokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    parse,
)
from .shapes import template_messages
from .state import ServerState, server_state
from .tgi import VERSION

router = APIRouter(tags=["Utility"])


# Pooling models load a transformers tokenizer of their own; wrapped once for these routes.
_POOLING_TOKENIZERS: weakref.WeakKeyDictionary[Any, Tokenizer] = weakref.WeakKeyDictionary()


def _loaded(state: ServerState) -> Tokenizer:
    """The served model's tokenizer: the generative engine's, or a pooling model's (embed and score
    servers tokenize too, as vLLM's do). 503 only while loading: it clears once /ready is 200."""
    if state.limits is not None and state.llm is not None:
        return state.llm.tokenizer
    if state.limits is not None and state.pooling is not None:
        hf = state.pooling.model.tokenizer
        tok = _POOLING_TOKENIZERS.get(hf)
        if tok is None:
            tok = _POOLING_TOKENIZERS[hf] = Tokenizer("", hf=hf)
        return tok
    raise APIError(ErrorKind.UNAVAILABLE, "the model is still loading")


def _served_names(state: ServerState) -> tuple[str | None, ...]:
    if state.llm is not None:
        return (state.llm.info.served_model_name, state.llm.info.model_id)
    return (state.model_name, state.config.engine.model.model)


def _check_model(state: ServerState, model: str | None) -> None:
    if not names_base_model(model, _served_names(state)):
        raise APIError(ErrorKind.NOT_FOUND, f"The model `{model}` does not exist.", "model")


async def _tgi_tokenize(state: ServerState, tok: Tokenizer, body: Any) -> Response:
    assert state.limits is not None
    req: TGITokenizeRequest = parse(TGITokenizeRequest, body)
    truncate = req.parameters.truncate
    if truncate is not None and not (0 < truncate <= state.limits.max_input_tokens):
        raise validation(
            f"Input validation error: `truncate` must be strictly positive and less than "
            f"{state.limits.max_input_tokens + 1}. Given: {truncate}",
            "truncate",
        )
    offsets = await asyncio.to_thread(tok.offsets, req.inputs)
    if truncate is not None:  # TGI keeps the last `truncate` tokens, as /generate does
        offsets = offsets[-truncate:]
    return JSONResponse(
        [{"id": tid, "text": text, "start": start, "stop": stop} for tid, text, start, stop in offsets]
    )


async def _vllm_tokenize(state: ServerState, tok: Tokenizer, body: Any) -> Response:
    assert state.limits is not None
    return_token_strs: bool
    if "messages" in body:
        req: TokenizeChatRequest = parse(TokenizeChatRequest, body)
        return_token_strs = req.return_token_strs
        _check_model(state, req.model)
        if req.continue_final_message and req.add_generation_prompt:
            raise validation(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )
        messages = template_messages(req.messages)
        try:
            ids = await asyncio.to_thread(
                tok.apply_chat_template,
                messages,
                req.add_generation_prompt,
                req.continue_final_message,
                req.add_special_tokens,
            )
        except Exception as e:  # jinja raises its own errors for messages a template rejects
            raise validation(f"invalid messages for this model's chat template: {e}", "messages") from None
    else:
        preq: TokenizeCompletionRequest = parse(TokenizeCompletionRequest, body)
        _check_model(state, preq.model)
        return_token_strs = preq.return_token_strs
        ids = await asyncio.to_thread(tok.encode, preq.prompt, preq.add_special_tokens)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": state.limits.max_total_tokens, "tokens": ids}
    if return_token_strs:
        out["token_strs"] = tok.hf.convert_ids_to_tokens(ids)
    return JSONResponse(out)


@router.post("/tokenize", summary="Tokenize: TGI's body ({inputs}) or vLLM's ({prompt} or {messages})")
async def tokenize(request: Request) -> Response:
    state = server_state(request)
    family = Family.TGI
    try:
        body = await read_json(request, state.config.max_payload_bytes)
        if isinstance(body, dict) and "inputs" not in body and ("prompt" in body or "messages" in body):
            family = Family.OPENAI
        tok = _loaded(state)
        if family is Family.OPENAI:
            return await _vllm_tokenize(state, tok, body)
        return await _tgi_tokenize(state, tok, body)
    except APIError as e:
        return e.response(family)


@router.post("/detokenize", summary="Token ids to text (vLLM)")
async def detokenize(request: Request) -> Response:
    state = server_state(request)
    try:
        body = await read_json(request, state.config.max_payload_bytes)
        tok = _loaded(state)
        req: DetokenizeRequest = parse(DetokenizeRequest, body)
        _check_model(state, req.model)
        vocab = tok.vocab_size
        if any(t < 0 or t >= vocab for t in req.tokens):
            raise validation(f"token ids must be in [0, {vocab})", "tokens")
        text = tok.decode(req.tokens)
    except APIError as e:
        return e.response(Family.OPENAI)
    return JSONResponse({"prompt": text})


@router.post("/decode", summary="Token ids to text (TEI)")
async def tei_decode(request: Request) -> Response:
    """TEI's `DecodeResponse`: a list of strings, one per id list (a single list gives one)."""
    state = server_state(request)
    try:
        body = await read_json(request, state.config.max_payload_bytes)
        tok = _loaded(state)
        try:
            req = TEIDecodeRequest.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"])
            raise validation(f"Input validation error: {loc}: {err['msg']}", loc or None) from None
        batch: list[list[int]] = (
            [[t for t in x] if isinstance(x, list) else [x] for x in req.ids]
            if not all(isinstance(t, int) for t in req.ids)
            else [[t for t in req.ids if isinstance(t, int)]]
        )
        vocab = tok.vocab_size
        if not batch or any(t < 0 or t >= vocab for ids in batch for t in ids):
            raise validation(f"Input validation error: token ids must be in [0, {vocab})", "ids")
        texts = [tok.decode(ids, req.skip_special_tokens) for ids in batch]
    except APIError as e:
        return e.response(Family.TGI)
    return JSONResponse(texts)


@router.get("/version", summary="Server version (vLLM)")
async def version() -> Response:
    return JSONResponse({"version": VERSION})
