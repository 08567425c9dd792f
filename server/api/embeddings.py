"""Pooling routes: OpenAI `/v1/embeddings`; vLLM `/score`, `/rerank` `/v1/rerank` `/v2/rerank`
(Cohere/Jina shape), `/classify`; TEI `/embed`, `/rerank` (TEI shape: `texts`), `/predict`.

Served by `server/pooling/` when `--task` is embed or score; with a generative model each answers 400
(`ServerState.admit`). `guard_router` is mounted first when a pooling model is served: generation routes
answer 400 and `/v1/models` and `/info` describe the pooling model. Wire formats: OpenAI's embeddings
API reference, vLLM's pooling API docs (`serving_score.py` shapes), TEI's openapi.json.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ConfigDict, ValidationError

from server.pooling.engine import PoolingAbortedError, PoolingInput
from server.pooling.model import PoolingModel
from server.pooling.pooler import finish_embedding

from .errors import APIError, ErrorKind, Family, validation
from .generation import names_base_model, read_json
from .protocol import NullIsUnset
from .state import ServerState, server_state

router = APIRouter()
guard_router = APIRouter()

# Inputs (texts, pairs, documents) per request: OpenAI's embeddings limit; bounds one request's memory.
MAX_INPUTS = 2048


def _check_count(n: int, name: str) -> None:
    if n > MAX_INPUTS:
        raise validation(f"Input validation error: at most {MAX_INPUTS} inputs per request, got {n}", name)


class _Body(NullIsUnset):
    model_config = ConfigDict(extra="forbid")


class EmbeddingRequest(_Body):
    """OpenAI's embeddings body (+ vLLM's `truncate_prompt_tokens`)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # metadata only, as in OpenAI
    truncate_prompt_tokens: int | None = None


class TEIEmbedRequest(_Body):
    inputs: str | list[str]
    normalize: bool = True
    truncate: bool | None = None
    truncation_direction: Literal["Left", "Right", "left", "right"] = "Right"
    dimensions: int | None = None
    prompt_name: str | None = None  # a key of the model's sentence-transformers `prompts`


class ScoreRequest(_Body):
    """vLLM's /score: `text_1`/`text_2`, or its newer names `queries`/`documents` (one pair of names)."""

    model: str | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    truncate_prompt_tokens: int | None = None

    def sides(self) -> tuple[str | list[str], str | list[str]]:
        old, new = (self.text_1, self.text_2), (self.queries, self.documents)
        if any(x is not None for x in old) and any(x is not None for x in new):
            raise validation("give text_1 and text_2, or queries and documents, not both", "queries")
        a, b = old if any(x is not None for x in old) else new
        if a is None or b is None:
            raise validation("text_1 and text_2 (or queries and documents) are required", "text_1")
        return a, b


class RerankRequest(_Body):
    """vLLM's /rerank (Jina/Cohere shape). `top_n` 0 (vLLM's default) means every document."""

    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None


class TEIRerankRequest(_Body):
    query: str
    texts: list[str]
    top_n: int | None = None  # the best `top_n` only, as vLLM's /rerank (TEI's own body has no such field)
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool | None = None
    truncation_direction: Literal["Left", "Right", "left", "right"] = "Right"


class ClassifyRequest(_Body):
    model: str | None = None
    input: str | list[str]
    truncate_prompt_tokens: int | None = None


class TEIPredictRequest(_Body):
    """TEI's `PredictInput` (router/src/http/types.rs, serde-untagged): a text, a pair `[text, text]`,
    or a list of texts and pairs (a batch). A list of exactly two texts is ONE pair, as TEI reads it."""

    inputs: str | list[str | list[str]]
    raw_scores: bool = False
    truncate: bool | None = None
    truncation_direction: Literal["Left", "Right", "left", "right"] = "Right"


async def _read(request: Request) -> Any:
    """The body's JSON value through the one hardened parser every route uses (json_body.py: depth,
    long integers, lone surrogates, the payload cap): never `request.json()`, which 500s on those."""
    return await read_json(request, server_state(request).config.max_payload_bytes)


async def _body(request: Request, cls: type[_Body], raw: Any = None) -> Any:
    data = raw if raw is not None else await _read(request)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise validation(f"{loc}: {err['msg']}", loc or None) from e


def _model(state: ServerState) -> PoolingModel:
    assert state.pooling is not None
    return state.pooling.model


def _check_name(state: ServerState, name: str | None) -> None:
    if not names_base_model(name, (state.model_name, state.config.engine.model.model)):
        raise APIError(ErrorKind.NOT_FOUND, f"the model `{name}` does not exist", "model")


def _limit(state: ServerState, truncate_to: int | None) -> int:
    assert state.limits is not None
    limit = state.limits.max_input_tokens
    if truncate_to is not None:
        if truncate_to < 1:
            raise validation("truncate_prompt_tokens must be >= 1", "truncate_prompt_tokens")
        if truncate_to > limit:
            raise validation(
                f"truncate_prompt_tokens {truncate_to} is larger than the model's {limit} tokens",
                "truncate_prompt_tokens",
            )
        limit = truncate_to
    return limit


def _encode_text(m: PoolingModel, text: str, limit: int, truncate: bool, left: bool) -> PoolingInput:
    """Tokens with special tokens; longer than `limit`: cut on `left`/right when `truncate`, else 400."""
    tok = m.tokenizer
    ids = tok(text, add_special_tokens=True)["input_ids"]
    if len(ids) > limit:
        if not truncate:
            raise validation(
                f"Input validation error: inputs must have at most {limit} tokens, this one has {len(ids)} "
                "(ask for truncation: `truncate` on TEI routes, `truncate_prompt_tokens` on vLLM routes)",
                "input",
            )
        # The fast tokenizer's own truncation and post-processor: special tokens stay at both ends.
        backend = tok.backend_tokenizer
        enc = backend.encode(text, add_special_tokens=False)
        enc.truncate(
            max(0, limit - tok.num_special_tokens_to_add(False)), direction="left" if left else "right"
        )
        ids = backend.post_process(enc, None, add_special_tokens=True).ids
    return PoolingInput(list(ids))


def _prompt(m: PoolingModel, name: str | None) -> str:
    """The instruction prompt prepended to each text: `name`'s, else the model's default (usually none)."""
    try:
        return m.pooling.prompt(name)
    except KeyError:
        known = ", ".join(name for name, _ in m.pooling.prompts) or "none"
        raise validation(
            f"Input validation error: prompt_name {name!r} is not one of the model's prompts ({known})",
            "prompt_name",
        ) from None


def _encode_pair(m: PoolingModel, a: str, b: str, limit: int, truncate: bool) -> PoolingInput:
    tok = m.tokenizer
    enc = tok(a, b, add_special_tokens=True)
    if len(enc["input_ids"]) > limit:
        if not truncate:
            raise validation(
                f"Input validation error: a query and document pair must have at most {limit} tokens, "
                f"this one has {len(enc['input_ids'])}",
                "input",
            )
        enc = tok(a, b, add_special_tokens=True, truncation="longest_first", max_length=limit)
    return PoolingInput(
        list(enc["input_ids"]), list(enc["token_type_ids"]) if "token_type_ids" in enc else None
    )


def _check_ids(m: PoolingModel, ids: list[int], limit: int, truncate: bool) -> PoolingInput:
    vocab = len(m.tokenizer)
    if not ids:
        raise validation("input token lists cannot be empty", "input")
    if any(not 0 <= t < vocab for t in ids):
        raise validation(f"token ids must be in [0, {vocab})", "input")
    if len(ids) > limit:
        if not truncate:
            raise validation(f"inputs must have at most {limit} tokens, this one has {len(ids)}", "input")
        ids = ids[:limit]
    return PoolingInput(list(ids))


PoolingText = str | list[int] | tuple[str, str]  # a text, token ids, or a (query, document) pair


@dataclass(frozen=True)
class Cut:
    """How a request bounds its inputs: at most `limit` tokens (special tokens included); longer ones
    are cut (`truncate`, on the left with `left`) or refused."""

    limit: int
    truncate: bool = False
    left: bool = False


def _listed(value: Any, field: str, tei: bool = False) -> list[Any]:
    """A request's inputs as a list: a string is one input, a flat list of token ids is one input.
    400/422 naming `field` when there are none or more than MAX_INPUTS (TEI's message prefix with `tei`)."""
    items: list[Any] = [value] if isinstance(value, str) else list(value)
    if items and all(isinstance(x, int) for x in items):
        items = [items]
    if not items:
        raise validation(
            f"Input validation error: `{field}` cannot be empty" if tei else f"{field} cannot be empty", field
        )
    _check_count(len(items), field)
    return items


async def _rows(
    m: PoolingModel,
    inputs: list[PoolingText],
    cut: Cut,
    prompt: str = "",
    per_token: bool = False,
    empty_ok: bool = True,
) -> list[PoolingInput]:
    """The engine's rows for a request's inputs, tokenized off the event loop: a text with `prompt`
    (the model's instruction prompt) before it, token ids (never prefixed: they are the client's exact
    sequence), or a pair; each within `cut`. `per_token`: every token's hidden state. 400 for an empty
    text unless `empty_ok` (TEI's routes and /classify embed the special tokens alone)."""

    def tokenize() -> list[PoolingInput]:
        out = []
        for x in inputs:
            if isinstance(x, tuple):
                item = _encode_pair(m, x[0], x[1], cut.limit, cut.truncate)
            elif isinstance(x, str):
                if not x and not empty_ok:
                    raise validation("input strings cannot be empty", "input")
                item = _encode_text(m, prompt + x, cut.limit, cut.truncate, cut.left)
            else:
                item = _check_ids(m, list(x), cut.limit, cut.truncate)
            item.per_token = per_token
            out.append(item)
        return out

    return await asyncio.to_thread(tokenize)


def _tei_cut(state: ServerState, truncate: bool | None, direction: str) -> Cut:
    return Cut(_limit(state, None), bool(truncate), direction.lower() == "left")


def _vllm_cut(state: ServerState, truncate_prompt_tokens: int | None) -> Cut:
    return Cut(_limit(state, truncate_prompt_tokens), truncate_prompt_tokens is not None)


async def _run(state: ServerState, task: str, items: list[PoolingInput]) -> list[torch.Tensor]:
    slot = state.admit(task)
    try:
        assert state.pooling is not None
        return await state.pooling.encode(items)
    except PoolingAbortedError as e:
        if state.cut_reason is not None:  # the drain deadline, as for generation
            raise APIError(ErrorKind.UNAVAILABLE, state.cut_reason) from e
        raise APIError(ErrorKind.UNAVAILABLE, "the request was aborted") from e
    except ValueError as e:
        raise validation(str(e), "input") from e
    except RuntimeError as e:
        raise APIError(ErrorKind.GENERATION, f"the pooling engine failed: {e}") from e
    finally:
        slot.release()


def _dimensions(m: PoolingModel, dimensions: int | None) -> int | None:
    if dimensions is None:
        return None
    allowed = m.pooling.matryoshka_dimensions
    if allowed == ():
        raise validation(
            f"the model {m.hidden_size}-dimensional embeddings do not support `dimensions` (not a Matryoshka model)",
            "dimensions",
        )
    if not 1 <= dimensions <= m.hidden_size or (allowed is not None and dimensions not in allowed):
        raise validation(
            f"dimensions must be one of {list(allowed) if allowed else f'1..{m.hidden_size}'}", "dimensions"
        )
    return dimensions


def _scores(m: PoolingModel, logits: list[torch.Tensor], raw: bool) -> list[list[float]]:
    """num_labels 1: sigmoid (sentence-transformers' CrossEncoder default, TEI); more: softmax."""
    out = []
    for row in logits:
        if raw:
            out.append(row.tolist())
        elif row.numel() == 1:
            out.append(torch.sigmoid(row).tolist())
        else:
            out.append(torch.softmax(row, dim=-1).tolist())
    return out


def _usage(items: list[PoolingInput]) -> dict[str, int]:
    n = sum(len(it.input_ids) for it in items)
    return {"prompt_tokens": n, "total_tokens": n}


# ---- OpenAI /v1/embeddings --------------------------------------------------------------------------
@router.post("/v1/embeddings", summary="Embeddings (OpenAI)")
async def embeddings(request: Request) -> Response:
    state = server_state(request)
    body = await _read(request)
    if isinstance(body, dict) and "prompt_name" in body:
        # neither OpenAI's nor vLLM's embeddings body has one: refused with where it is taken
        raise validation(
            "prompt_name is not a field of OpenAI's or vLLM's embeddings request: name the prompt on TEI's "
            "/embed (`prompt_name`) or prepend its text to the input; this route applies the model's "
            "default_prompt_name",
            "prompt_name",
        )
    req: EmbeddingRequest = await _body(request, EmbeddingRequest, body)
    state.admit("embed").release()  # task and phase checks before tokenizing
    m = _model(state)
    _check_name(state, req.model)
    dims = _dimensions(m, req.dimensions)
    cut = _vllm_cut(state, req.truncate_prompt_tokens)
    # the model's default prompt, as sentence-transformers' encode applies it
    items = await _rows(m, _listed(req.input, "input"), cut, _prompt(m, None), empty_ok=False)
    vectors = await _run(state, "embed", items)
    data = []
    for i, v in enumerate(vectors):
        e = finish_embedding(v, m.pooling.normalize, dims)
        value: Any = (
            base64.b64encode(e.numpy().astype(np.float32).tobytes()).decode()
            if req.encoding_format == "base64"
            else e.tolist()
        )
        data.append({"object": "embedding", "index": i, "embedding": value})
    return JSONResponse({"object": "list", "data": data, "model": state.model_name, "usage": _usage(items)})


# ---- TEI /embed ------------------------------------------------------------------------------------
@router.post("/embed", summary="Embeddings (TEI)")
async def tei_embed(request: Request, raw: Any = None) -> Response:
    state = server_state(request)
    req: TEIEmbedRequest = await _body(request, TEIEmbedRequest, raw)
    state.admit("embed").release()
    m = _model(state)
    dims = _dimensions(m, req.dimensions)
    texts = _listed(req.inputs, "inputs", tei=True)
    cut = _tei_cut(state, req.truncate, req.truncation_direction)
    items = await _rows(m, texts, cut, _prompt(m, req.prompt_name))
    vectors = await _run(state, "embed", items)
    return JSONResponse([finish_embedding(v, req.normalize, dims).tolist() for v in vectors])


class TEISimilarityInput(_Body):
    source_sentence: str
    sentences: list[str]


class TEISimilarityParameters(_Body):
    truncate: bool | None = None
    truncation_direction: Literal["Left", "Right", "left", "right"] = "Right"
    prompt_name: str | None = None


class TEISimilarityRequest(_Body):
    """TEI's /similarity body (and huggingface_hub's sentence_similarity, which posts it to `/`)."""

    inputs: TEISimilarityInput
    parameters: TEISimilarityParameters = TEISimilarityParameters()


@router.post("/similarity", summary="Cosine similarity of a sentence to others (TEI)")
async def tei_similarity(request: Request, raw: Any = None) -> Response:
    """`[float]`: the cosine similarity of `inputs.source_sentence`'s embedding to each of
    `inputs.sentences`' (TEI's SimilarityResponse), in their order."""
    state = server_state(request)
    req: TEISimilarityRequest = await _body(request, TEISimilarityRequest, raw)
    state.admit("embed").release()
    m = _model(state)
    p = req.parameters
    texts = [req.inputs.source_sentence, *req.inputs.sentences]
    if not req.inputs.sentences:
        raise validation("Input validation error: `inputs.sentences` cannot be empty", "inputs.sentences")
    _check_count(len(texts), "inputs.sentences")
    items = await _rows(
        m, list(texts), _tei_cut(state, p.truncate, p.truncation_direction), _prompt(m, p.prompt_name)
    )
    vectors = torch.stack([finish_embedding(v, True, None) for v in await _run(state, "embed", items)])
    return JSONResponse((vectors[1:] @ vectors[0]).tolist())


# ---- per-token embeddings: TEI /embed_all, vLLM /pooling ----------------------------------------------
class TEIEmbedAllRequest(_Body):
    """TEI's /embed_all body (`EmbedAllRequest`): every token's last hidden state, not pooled, not
    normalized."""

    inputs: str | list[str]
    truncate: bool | None = None
    truncation_direction: Literal["Left", "Right", "left", "right"] = "Right"
    prompt_name: str | None = None


@router.post("/embed_all", summary="Per-token embeddings (TEI)")
async def tei_embed_all(request: Request, raw: Any = None) -> Response:
    """`[[[float]]]`: per input, per token (special tokens included), the model's last hidden state."""
    state = server_state(request)
    req: TEIEmbedAllRequest = await _body(request, TEIEmbedAllRequest, raw)
    state.admit("embed").release()
    m = _model(state)
    texts = _listed(req.inputs, "inputs", tei=True)
    cut = _tei_cut(state, req.truncate, req.truncation_direction)
    items = await _rows(m, texts, cut, _prompt(m, req.prompt_name), per_token=True)
    return JSONResponse([v.tolist() for v in await _run(state, "embed", items)])


class PoolingRequest(_Body):
    """vLLM's /pooling (`PoolingCompletionRequest`). `task`: `token_embed` (vLLM's default for an
    embedding model: every token's hidden state, L2-normalized per token unless `use_activation` is
    false), `embed` (the pooled vector, as /v1/embeddings), or on a score server `classify`
    (probabilities; raw logits with `use_activation: false`), which must be named there (vLLM's
    default there is no sequence task)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    task: Literal["token_embed", "embed", "classify"] | None = None
    encoding_format: Literal["float"] = "float"
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None


@router.post("/pooling", summary="Pooling: per-token or pooled embeddings, class probabilities (vLLM)")
async def pooling(request: Request) -> Response:
    """vLLM's `PoolingResponse`: `data[i].data` is `[[float]]` (token_embed), `[float]` (embed,
    classify)."""
    state = server_state(request)
    req: PoolingRequest = await _body(request, PoolingRequest)
    _check_name(state, req.model)
    if state.task not in ("embed", "score"):
        state.admit("embed")  # the usual 400: this server serves another task
    embedder = state.task == "embed"
    task = req.task or ("token_embed" if embedder else None)
    if task is None or (task == "classify") == embedder:
        served = "token_embed, embed" if embedder else "classify"
        raise validation(
            f"task {req.task!r} is not served by this {state.task} model (task: {served})", "task"
        )
    state.admit(state.task).release()
    m = _model(state)
    dims = _dimensions(m, req.dimensions) if task != "classify" else None
    if req.dimensions is not None and task == "classify":
        raise validation("dimensions applies to embeddings only", "dimensions")
    cut = _vllm_cut(state, req.truncate_prompt_tokens)
    # an embedder's default prompt, as on /v1/embeddings (a score model has no prompts)
    prompt = _prompt(m, None) if embedder else ""
    inputs = _listed(req.input, "input")
    items = await _rows(m, inputs, cut, prompt, per_token=task == "token_embed", empty_ok=False)
    rows = await _run(state, state.task, items)
    activate = req.use_activation is not False
    values: list[Any]
    if task == "classify":
        values = _scores(m, rows, raw=not activate)
    else:
        # vLLM normalizes every token's vector (its token_embed head); a pooled one as /v1/embeddings
        normalize = activate and (task == "token_embed" or m.pooling.normalize)
        values = [finish_embedding(v, normalize, dims).tolist() for v in rows]
    data = [{"index": i, "object": "pooling", "data": v} for i, v in enumerate(values)]
    return JSONResponse(
        {
            "id": f"pool-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": state.model_name,
            "data": data,
            "usage": _usage(items),
        }
    )


class TEIDecodeRequest(_Body):
    """TEI's /decode body (`DecodeRequest`): one list of token ids or a batch of them."""

    ids: list[int] | list[list[int]]
    skip_special_tokens: bool = True


# ---- scoring: vLLM /score, /rerank; TEI /rerank ------------------------------------------------------
async def _score_pairs(
    state: ServerState, pairs: list[tuple[str, str]], cut: Cut
) -> tuple[list[torch.Tensor], list[PoolingInput]]:
    items = await _rows(_model(state), list(pairs), cut)
    return await _run(state, "score", items), items


@router.post("/score", summary="Cross-encoder scores (vLLM)")
@router.post("/v1/score", include_in_schema=False)
async def score(request: Request) -> Response:
    state = server_state(request)
    req: ScoreRequest = await _body(request, ScoreRequest)
    state.admit("score").release()
    _check_name(state, req.model)
    one, two = req.sides()
    a = [one] if isinstance(one, str) else one
    b = [two] if isinstance(two, str) else two
    if not a or not b:
        raise validation("text_1 and text_2 cannot be empty", "text_1")
    if len(a) == 1:
        a = a * len(b)
    if len(a) != len(b):
        raise validation("text_1 must have one item or as many as text_2", "text_1")
    _check_count(len(b), "text_2")
    logits, items = await _score_pairs(
        state, list(zip(a, b, strict=True)), _vllm_cut(state, req.truncate_prompt_tokens)
    )
    scores = _scores(_model(state), logits, raw=False)
    return JSONResponse(
        {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": state.model_name,
            "data": [
                {"index": i, "object": "score", "score": s[0] if len(s) == 1 else s}
                for i, s in enumerate(scores)
            ],
            "usage": _usage(items),
        }
    )


@router.post("/rerank", summary="Rerank: TEI body (query, texts) or vLLM/Jina/Cohere body (query, documents)")
@router.post("/v1/rerank", include_in_schema=False)
@router.post("/v2/rerank", include_in_schema=False)
async def rerank(request: Request) -> Response:
    return await _rerank(request, tei_shape=request.url.path == "/rerank")


async def _rerank(request: Request, tei_shape: bool, raw: Any = None) -> Response:
    """tei_shape: a body with `texts` is TEI's (TEI's own routes); else only vLLM's shape is read."""
    state = server_state(request)
    raw = raw if raw is not None else await _read(request)
    if tei_shape and isinstance(raw, dict) and "texts" in raw:
        return await _tei_rerank(state, await _body(request, TEIRerankRequest, raw))
    req: RerankRequest = await _body(request, RerankRequest, raw)
    state.admit("score").release()
    _check_name(state, req.model)
    if not req.documents:
        raise validation("documents cannot be empty", "documents")
    _check_count(len(req.documents), "documents")
    if req.top_n is not None and req.top_n < 0:  # 0 is every document, vLLM's default
        raise validation("top_n must be >= 0 (0: every document)", "top_n")
    logits, items = await _score_pairs(
        state, [(req.query, d) for d in req.documents], _vllm_cut(state, req.truncate_prompt_tokens)
    )
    scores = [s[0] for s in _scores(_model(state), logits, raw=False)]
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n or len(scores)]
    results = []
    for i in order:
        r: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            r["document"] = {"text": req.documents[i]}
        results.append(r)
    return JSONResponse(
        {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": state.model_name,
            "usage": {"total_tokens": _usage(items)["total_tokens"]},
            "results": results,
        }
    )


async def _tei_rerank(state: ServerState, req: TEIRerankRequest) -> Response:
    state.admit("score").release()
    if not req.texts:
        raise validation("Input validation error: `texts` cannot be empty", "texts")
    if req.top_n is not None and req.top_n < 1:
        raise validation("Input validation error: `top_n` must be >= 1", "top_n")
    _check_count(len(req.texts), "texts")
    if req.truncation_direction.lower() == "left":
        raise validation(
            "Input validation error: truncation_direction Left is not supported for pairs",
            "truncation_direction",
        )
    logits, _ = await _score_pairs(
        state, [(req.query, t) for t in req.texts], Cut(_limit(state, None), bool(req.truncate))
    )
    scores = [s[0] for s in _scores(_model(state), logits, raw=req.raw_scores)]
    out = []
    for i in sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n or len(scores)]:
        r: dict[str, Any] = {"index": i, "score": scores[i]}
        if req.return_text:
            r["text"] = req.texts[i]
        out.append(r)
    return JSONResponse(out)


# ---- classification: vLLM /classify, TEI /predict -----------------------------------------------------
@router.post("/classify", summary="Sequence classification (vLLM)")
@router.post("/v1/classify", include_in_schema=False)
async def classify(request: Request) -> Response:
    state = server_state(request)
    req: ClassifyRequest = await _body(request, ClassifyRequest)
    state.admit("score").release()
    _check_name(state, req.model)
    m = _model(state)
    items = await _rows(m, _listed(req.input, "input"), _vllm_cut(state, req.truncate_prompt_tokens))
    probs = _scores(m, await _run(state, "score", items), raw=False)
    data = []
    for i, p in enumerate(probs):
        best = max(range(len(p)), key=lambda k: p[k])
        data.append({"index": i, "label": m.id2label.get(best, str(best)), "probs": p, "num_classes": len(p)})
    return JSONResponse(
        {
            "id": f"classify-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": state.model_name,
            "data": data,
            "usage": _usage(items),
        }
    )


def _predict_sequences(inputs: str | list[str | list[str]]) -> tuple[list[str | tuple[str, str]], bool]:
    """TEI's reading of `inputs`: (the sequences, whether the body was a batch)."""
    if isinstance(inputs, str):
        return [inputs], False
    if len(inputs) == 2 and all(isinstance(x, str) for x in inputs):
        return [(str(inputs[0]), str(inputs[1]))], False  # Sequence::Pair comes before a batch of two
    out: list[str | tuple[str, str]] = []
    for i, x in enumerate(inputs):
        if isinstance(x, str):
            out.append(x)
        elif len(x) == 2:
            out.append((x[0], x[1]))
        else:
            raise validation(
                f"Input validation error: inputs[{i}] must be a text or a pair [text, text], got {len(x)} texts",
                "inputs",
            )
    return out, True


@router.post("/predict", summary="Sequence classification (TEI)")
async def predict(request: Request, raw: Any = None) -> Response:
    state = server_state(request)
    req: TEIPredictRequest = await _body(request, TEIPredictRequest, raw)
    state.admit("score").release()
    m = _model(state)
    sequences, batch = _predict_sequences(req.inputs)
    if not sequences:
        raise validation("Input validation error: `inputs` cannot be empty", "inputs")
    _check_count(len(sequences), "inputs")
    left = req.truncation_direction.lower() == "left"
    if left and any(isinstance(x, tuple) for x in sequences):
        raise validation(
            "Input validation error: truncation_direction Left is not supported for pairs",
            "truncation_direction",
        )
    items = await _rows(m, list(sequences), _tei_cut(state, req.truncate, req.truncation_direction))
    rows = _scores(m, await _run(state, "score", items), raw=req.raw_scores)
    out = [
        sorted(
            ({"score": s, "label": m.id2label.get(k, str(k))} for k, s in enumerate(row)),
            key=lambda d: -float(d["score"]),  # type: ignore[arg-type]
        )
        for row in rows
    ]
    return JSONResponse(out if batch else out[0])


# ---- mounted first when a pooling model is served ----------------------------------------------------
@guard_router.post("/", include_in_schema=False)
@guard_router.post("/invocations", include_in_schema=False)
async def tei_task_route(request: Request) -> Response:
    """TEI's `POST /` and `POST /invocations` (SageMaker's route): the served task's own route, as TEI
    picks it from the model type (router/src/http/server.rs): an embedder's /embed, a reranker's
    (one label) /rerank, a classifier's /predict."""
    state = server_state(request)
    raw = await _read(request)
    if state.task == "embed":
        # huggingface_hub's sentence_similarity posts TEI's /similarity body here
        similarity = isinstance(raw, dict) and isinstance(raw.get("inputs"), dict)
        return await (tei_similarity(request, raw) if similarity else tei_embed(request, raw))
    if state.pooling is None:
        state.admit("score").release()  # raises the 503 while loading, as the task routes answer
    if _model(state).num_labels == 1:
        return await _rerank(request, tei_shape=True, raw=raw)
    return await predict(request, raw)


@guard_router.post("/generate", include_in_schema=False)
@guard_router.post("/generate_stream", include_in_schema=False)
@guard_router.post("/v1/completions", include_in_schema=False)
@guard_router.post("/v1/chat/completions", include_in_schema=False)
async def generation_refused(request: Request) -> Response:
    state = server_state(request)
    state.admit("generate")  # raises the 400 naming the model's task
    raise AssertionError("unreachable")


@guard_router.get("/v1/models/{model_id:path}", include_in_schema=False)
async def pooling_model_card(request: Request, model_id: str) -> Response:
    listed = await pooling_models(request)
    if listed.status_code != 200:
        return listed
    card = json.loads(bytes(listed.body))["data"][0]
    if card["id"] != model_id:
        return APIError(ErrorKind.NOT_FOUND, f"The model `{model_id}` does not exist.", "model").response(
            Family.OPENAI
        )
    return JSONResponse(card)


@guard_router.get("/v1/models", include_in_schema=False)
async def pooling_models(request: Request) -> Response:
    state = server_state(request)
    if state.pooling is None or state.limits is None:
        raise APIError(ErrorKind.UNAVAILABLE, "the model is still loading")
    card = {
        "id": state.model_name,
        "object": "model",
        "created": int(state.started_at),
        "owned_by": "kubeinfer",
        "root": state.config.engine.model.model,
        "parent": None,
        "max_model_len": state.limits.max_total_tokens,
        "task": state.task,
    }
    return JSONResponse({"object": "list", "data": [card]})


@guard_router.get("/info", include_in_schema=False)
async def pooling_info(request: Request) -> Response:
    state = server_state(request)
    if state.pooling is None or state.limits is None:
        return JSONResponse(
            {"error": "the model is still loading", "error_type": "unavailable"}, status_code=503
        )
    m = state.pooling.model
    kind: dict[str, Any]
    if state.task == "embed":
        kind = {"embedding": {"pooling": m.pooling.mode.value}}
        tag = "sentence-similarity"
    else:
        kind = {
            "reranker" if m.num_labels == 1 else "classifier": {
                "id2label": {str(k): v for k, v in m.id2label.items()}
            }
        }
        tag = "text-classification"
    return JSONResponse(
        {
            "model_id": state.model_name,
            "model_sha": None,
            # the dtype the projections multiply in (bf16 GEMMs over fp32 weights report bfloat16)
            "model_dtype": str(m.gemm_dtype).removeprefix("torch."),
            "model_type": kind,
            "model_pipeline_tag": tag,
            "task": state.task,
            "max_concurrent_requests": state.config.max_concurrent_requests,
            "max_input_length": state.limits.max_input_tokens,
            "max_batch_tokens": state.pooling.max_num_batched_tokens,
            "max_client_batch_size": state.pooling.max_num_seqs,
            "router": "kubeinfer",
            "version": None,
            "sha": None,
            "docker_label": None,
        }
    )
