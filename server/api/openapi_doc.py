"""The OpenAPI document, completed with what FastAPI cannot infer from the routes.

The generation routes read their JSON bodies themselves (to enforce the payload limit while reading,
and to answer bad input in each client family's error format), so FastAPI sees neither their request
bodies nor their error statuses nor their event-stream responses. This module adds them, so that
clients, code generators and fuzzers (schemathesis) see the contract the server actually keeps.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from .embeddings import (
    ClassifyRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    TEIDecodeRequest,
    TEIEmbedAllRequest,
    TEIEmbedRequest,
    TEIPredictRequest,
    TEIRerankRequest,
    TEISimilarityRequest,
)
from .errors import Family, family_of_path
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TGIRequest,
    TGITokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from .responses_protocol import ResponsesRequest

_REF = "#/components/schemas/{model}"

_TGI_ERROR = {
    "type": "object",
    "required": ["error", "error_type"],
    "properties": {"error": {"type": "string"}, "error_type": {"type": "string"}},
}
_OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer"},
            },
        }
    },
}
_TGI_GENERATION = {
    "type": "object",
    "required": ["generated_text"],
    "properties": {"generated_text": {"type": "string"}, "details": {"type": "object"}},
}
_OPENAI_COMPLETION = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {
        "id": {"type": "string"},
        "object": {"type": "string"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {"type": "array", "items": {"type": "object"}},
        "usage": {"type": "object"},
    },
}
_TOKENS = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["id", "text", "start", "stop"],
        "properties": {
            "id": {"type": "integer"},
            "text": {"type": "string"},
            "start": {"type": "integer"},
            "stop": {"type": "integer"},
        },
    },
}
_STATUS = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}
# Before OpenAPI 3.2's itemSchema, an event-stream schema describes one event (as schemathesis reads it).
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {"type": "string", "contentMediaType": "application/json"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}
_EVENT_STREAM = {"text/event-stream": {"schema": _SSE_EVENT}}

# Statuses each family of generation route can answer with, besides 200.
_TGI_ERRORS = {
    401: "Missing or wrong API key",
    413: "Request body over the payload limit",
    422: "Validation error (malformed JSON, wrong types, out-of-range parameters, token limits)",
    424: "The engine failed this request (error_type generation)",
    429: "Over --max-concurrent-requests (error_type overloaded)",
    500: "The request ended early (error_type incomplete_generation)",
    503: "Loading or draining (error_type unavailable)",
}
_OPENAI_ERRORS = {
    400: "Validation error (malformed JSON, wrong types, out-of-range parameters, token limits)",
    401: "Missing or wrong API key",
    404: "Unknown model",
    413: "Request body over the payload limit",
    429: "Over --max-concurrent-requests",
    500: "The engine failed this request, or it ended early",
    503: "Loading or draining",
}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _body(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template=_REF)
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return {"required": True, "content": _json({"$ref": _REF.format(model=model.__name__)})}


def _errors(table: dict[int, str], schema: dict[str, Any]) -> dict[str, Any]:
    return {str(code): {"description": text, "content": _json(schema)} for code, text in table.items()}


def _generation_routes(components: dict[str, Any]) -> dict[str, dict[str, Any]]:
    tgi, openai = _errors(_TGI_ERRORS, _TGI_ERROR), _errors(_OPENAI_ERRORS, _OPENAI_ERROR)
    tgi_body = _body(TGIRequest, components)
    # /tokenize takes TGI's body or one of vLLM's two, and answers in the shape of the body it got
    tokenize_refs = [
        _body(m, components)["content"]["application/json"]["schema"]
        for m in (TGITokenizeRequest, TokenizeCompletionRequest, TokenizeChatRequest)
    ]
    tokenize_body = {"required": True, "content": _json({"oneOf": tokenize_refs})}
    vllm_tokens = {
        "type": "object",
        "required": ["count", "max_model_len", "tokens"],
        "properties": {
            "count": {"type": "integer"},
            "max_model_len": {"type": "integer"},
            "tokens": {"type": "array", "items": {"type": "integer"}},
            "token_strs": {"type": "array", "items": {"type": "string"}},
        },
    }
    return {
        "/generate": {
            "requestBody": tgi_body,
            "responses": {"200": {"description": "Generated text", "content": _json(_TGI_GENERATION)}, **tgi},
        },
        "/generate_stream": {
            "requestBody": tgi_body,
            "responses": {
                "200": {"description": "Server-sent events, one per token", "content": _EVENT_STREAM},
                **tgi,
            },
        },
        "/": {
            "requestBody": tgi_body,
            "responses": {
                "200": {
                    "description": "A one-element list, or server-sent events when stream is true",
                    "content": {**_json({"type": "array", "items": _TGI_GENERATION}), **_EVENT_STREAM},
                },
                **tgi,
            },
        },
        "/tokenize": {
            "requestBody": tokenize_body,
            "responses": {
                "200": {
                    "description": "TGI: tokens with their character offsets; vLLM: token ids and count",
                    "content": _json({"oneOf": [_TOKENS, vllm_tokens]}),
                },
                **{k: v for k, v in tgi.items() if k in ("401", "413", "422", "503")},
                **{k: v for k, v in openai.items() if k in ("400", "404")},
            },
        },
        "/detokenize": {
            "requestBody": _body(DetokenizeRequest, components),
            "responses": {
                "200": {
                    "description": "The text of the token ids",
                    "content": _json(
                        {
                            "type": "object",
                            "required": ["prompt"],
                            "properties": {"prompt": {"type": "string"}},
                        }
                    ),
                },
                **{k: v for k, v in openai.items() if k in ("400", "401", "404", "413", "503")},
            },
        },
        "/v1/completions": {
            "requestBody": _body(CompletionRequest, components),
            "responses": {
                "200": {
                    "description": "A completion, or server-sent events when stream is true",
                    "content": {**_json(_OPENAI_COMPLETION), **_EVENT_STREAM},
                },
                **openai,
            },
        },
        "/v1/chat/completions": {
            "requestBody": _body(ChatCompletionRequest, components),
            "responses": {
                "200": {
                    "description": "A chat completion, or server-sent events when stream is true",
                    "content": {**_json(_OPENAI_COMPLETION), **_EVENT_STREAM},
                },
                **openai,
            },
        },
        "/v1/responses": {
            "requestBody": _body(ResponsesRequest, components),
            "responses": {
                "200": {
                    "description": "A response object, or its semantic events when stream is true",
                    "content": {**_json({"type": "object"}), **_EVENT_STREAM},
                },
                **openai,
            },
        },
    }


def _lora_routes() -> dict[str, dict[str, Any]]:
    """vLLM's run-time LoRA routes (mounted with --allow-runtime-lora-updating): plain-text success."""
    name = {"type": "string", "maxLength": 256}
    text = {"text/plain": {"schema": {"type": "string"}}}
    errors = _errors(
        {
            400: "Missing or malformed field, or an adapter that cannot be served",
            404: "No adapter under the allowed paths / no adapter by that name",
            503: "The model is still loading",
        },
        _OPENAI_ERROR,
    )

    def body(required: list[str], props: dict[str, Any]) -> dict[str, Any]:
        return {
            "required": True,
            "content": _json({"type": "object", "required": required, "properties": props}),
        }

    return {
        "/v1/load_lora_adapter": {
            "requestBody": body(
                ["lora_name", "lora_path"],
                {"lora_name": name, "lora_path": {"type": "string", "maxLength": 1024}},
            ),
            "responses": {"200": {"description": "Loaded", "content": text}, **errors},
        },
        "/v1/unload_lora_adapter": {
            "requestBody": body(["lora_name"], {"lora_name": name}),
            "responses": {"200": {"description": "Unloaded", "content": text}, **errors},
        },
    }


# The pooling routes' bodies (server/api/embeddings.py), so a fuzzer sends them more than empty bodies.
_POOLING_BODIES: dict[str, tuple[type[BaseModel], ...]] = {
    "/v1/embeddings": (EmbeddingRequest,),
    "/embed": (TEIEmbedRequest,),
    "/embed_all": (TEIEmbedAllRequest,),
    "/similarity": (TEISimilarityRequest,),
    "/score": (ScoreRequest,),
    "/v1/score": (ScoreRequest,),
    "/rerank": (TEIRerankRequest, RerankRequest),
    "/v1/rerank": (TEIRerankRequest, RerankRequest),
    "/v2/rerank": (TEIRerankRequest, RerankRequest),
    "/classify": (ClassifyRequest,),
    "/v1/classify": (ClassifyRequest,),
    "/predict": (TEIPredictRequest,),
    "/pooling": (PoolingRequest,),
    "/decode": (TEIDecodeRequest,),
}


def _pooling_routes(components: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Bodies and error shapes of the pooling routes (TEI's family outside /v1, vLLM's /pooling and
    /v1 routes in OpenAI's)."""
    out = {}
    for path, models in _POOLING_BODIES.items():
        refs = [_body(m, components)["content"]["application/json"]["schema"] for m in models]
        schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
        tgi = family_of_path(path) is Family.TGI
        errors = _errors(_TGI_ERRORS, _TGI_ERROR) if tgi else _errors(_OPENAI_ERRORS, _OPENAI_ERROR)
        out[path] = {"requestBody": {"required": True, "content": _json(schema)}, "responses": errors}
    return out


def _other_routes(metrics_content_type: str) -> dict[str, dict[str, Any]]:
    return {
        "/health": {"responses": {"503": {"description": "The engine loop died", "content": _json(_STATUS)}}},
        "/ready": {
            "responses": {"503": {"description": "Loading, draining or dead", "content": _json(_STATUS)}}
        },
        "/metrics": {
            "responses": {
                "200": {
                    "description": "Prometheus text format",
                    "content": {metrics_content_type.split(";")[0]: {"schema": {"type": "string"}}},
                }
            }
        },
        "/info": {
            "responses": {"503": {"description": "The model is still loading", "content": _json(_TGI_ERROR)}}
        },
        "/v1/models": {
            "responses": {
                "401": {"description": "Missing or wrong API key", "content": _json(_OPENAI_ERROR)},
                "503": {"description": "The model is still loading", "content": _json(_OPENAI_ERROR)},
            }
        },
    }


def install_openapi(app: FastAPI, metrics_content_type: str, open_paths: frozenset[str]) -> None:
    """Replaces app.openapi with a builder that adds request bodies, error responses, event-stream
    responses and the bearer scheme (on every route outside `open_paths`)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        components = schema.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        components.setdefault("securitySchemes", {})["bearerAuth"] = {"type": "http", "scheme": "bearer"}
        extra = {
            **_generation_routes(schemas),
            **_pooling_routes(schemas),
            **_lora_routes(),
            **_other_routes(metrics_content_type),
        }
        for path, item in schema.get("paths", {}).items():
            for method, op in item.items():
                add = extra.get(path, {})
                if method == "post" and "requestBody" in add:
                    op["requestBody"] = add["requestBody"]
                for code, resp in add.get("responses", {}).items():
                    op.setdefault("responses", {})[code] = resp
                if path not in open_paths:
                    op["security"] = [{"bearerAuth": []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
