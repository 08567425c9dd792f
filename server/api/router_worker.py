"""What vLLM's router (`vllm-router`, and SGLang's router it grew from) calls on a worker, besides the
OpenAI routes and the health check. Found by running vllm-router 0.1.17 against this server
(tests/router/test_router_worker_routes.py and test_router_e2e.py exercise them):

- GET  /get_load         per-worker load for the router's /get_loads: {"load": requests in the engine}
- GET  /get_model_info   proxied from the router's /get_model_info (SGLang's fields)
- GET  /get_server_info  proxied from the router's /get_server_info; also where a KV-aware router
                         reads the KV block size
- GET  /health_generate  a one-token generation through the engine (SGLang's deep health check)
- POST /flush_cache      the router's cache flush (SGLang's name); POST /reset_prefix_cache is vLLM's
- GET  /kv_event_sources where the KV-cache events are published, which vllm-router --policy
                         kv_aware reads for workers given without static KV sources (e.g. discovered)
- POST /tokenize         vLLM's form ({"prompt"} or {"messages"} -> {"count", "tokens", ...}), which
                         the router asks for to route by tokens: served by utility.py with TGI's form

Health: the router checks `--health-check-endpoint`; point it at /ready (the operator does), which
is 503 while loading or draining, so such a replica gets no new requests.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.engine import EngineDeadError
from server.request import SamplingParams

from .errors import APIError, ErrorKind, Family
from .state import ServerState, server_state

router = APIRouter(tags=["Router worker"])


def _loaded(state: ServerState) -> None:
    if state.llm is None or state.engine is None:
        raise APIError(ErrorKind.UNAVAILABLE, "the model is still loading; retry when /ready returns 200")


@router.get("/get_load", summary="Requests in the engine (running + waiting), for vllm-router's /get_loads")
async def get_load(request: Request) -> Response:
    state = server_state(request)
    stats = state.engine.last_stats if state.engine is not None else None
    running = stats.num_running if stats else 0
    waiting = stats.num_waiting if stats else 0
    return JSONResponse(
        {
            "load": running + waiting,
            "num_requests_running": running,
            "num_requests_waiting": waiting,
            "kv_cache_usage_perc": stats.kv_cache_usage if stats else 0.0,
            "requests_in_flight": state.in_flight,
        }
    )


@router.get("/get_model_info", summary="Model identity (SGLang's fields, as vllm-router proxies them)")
async def get_model_info(request: Request) -> Response:
    state = server_state(request)
    try:
        _loaded(state)
    except APIError as e:
        return e.response(Family.OPENAI)
    assert state.llm is not None
    info = state.llm.info
    return JSONResponse(
        {
            "model_path": info.model_id,
            "tokenizer_path": info.model_id,
            "served_model_name": info.served_model_name,
            "is_generation": True,
            "max_model_len": state.llm.max_model_len,
            "architecture": info.architecture,
        }
    )


@router.get("/get_server_info", summary="Server settings a router needs (KV block size, KV events)")
async def get_server_info(request: Request) -> Response:
    state = server_state(request)
    try:
        _loaded(state)
    except APIError as e:
        return e.response(Family.OPENAI)
    assert state.llm is not None
    info = state.llm.info
    ev = state.config.engine.kv_events
    pub = state.llm.kv_events
    return JSONResponse(
        {
            "model": info.model_id,
            "served_model_name": info.served_model_name,
            "block_size": info.block_size,
            "num_gpu_blocks": info.num_kv_blocks,
            "max_model_len": state.llm.max_model_len,
            "max_num_seqs": info.max_num_seqs,
            "max_num_batched_tokens": info.max_num_batched_tokens,
            "enable_prefix_caching": state.config.engine.cache.enable_prefix_caching,
            "kv_events_config": {
                "enable_kv_cache_events": ev.enable_kv_cache_events,
                "publisher": ev.publisher,
                "endpoint": pub.endpoint if pub else ev.endpoint,
                "replay_endpoint": pub.replay_address if pub else ev.replay_endpoint,
                "topic": ev.topic,
            },
            "kv_events_published_total": pub.num_events_published if pub else 0,
            "kv_events_dropped_total": pub.num_dropped if pub else 0,
            "status": state.phase.value,
        }
    )


def _routable(endpoint: str, host: str | None) -> str:
    """A bound wildcard address (tcp://0.0.0.0:5557, tcp://[::]:5557) with the host the caller reached
    us by, which a router can connect to (vllm-router refuses wildcard hosts)."""
    if host is None:
        return endpoint
    for wildcard in ("tcp://0.0.0.0:", "tcp://[::]:", "tcp://*:"):
        if endpoint.startswith(wildcard):
            host = f"[{host}]" if ":" in host else host
            return f"tcp://{host}:{endpoint.removeprefix(wildcard)}"
    return endpoint


@router.get("/kv_event_sources", summary="Where this server publishes KV-cache events, for KV-aware routers")
async def kv_event_sources(request: Request) -> Response:
    """A map from data-parallel rank ("0" here) to that rank's publisher: the endpoints (a wildcard
    bind address given the host the caller reached us by) and vLLM's kv-events settings; {} when
    events are off. This is the form vllm-router 0.1.17 parses (found by running it: a bare list or a
    {"sources": ...} envelope fail its decoding); it then subscribes to workers it discovered itself."""
    state = server_state(request)
    pub = state.llm.kv_events if state.llm is not None else None
    if pub is None:
        return JSONResponse({})
    host = request.url.hostname
    replay = pub.replay_address
    cfg = pub.config
    return JSONResponse(
        {
            "0": {
                "endpoint": _routable(pub.endpoint, host),
                "replay_endpoint": None if replay is None else _routable(replay, host),
                "topic": cfg.topic,
                "hwm": cfg.hwm,
                "buffer_steps": cfg.buffer_steps,
                "publisher": cfg.publisher,
                "encoding": "msgpack",
                "schema_version": 1,
                "enable_kv_cache_events": cfg.enable_kv_cache_events,
            }
        }
    )


@router.get("/health_generate", summary="Deep health check: one greedy token through the engine")
async def health_generate(request: Request) -> Response:
    state = server_state(request)
    try:
        slot = state.admit()
    except APIError as e:
        return e.response(Family.OPENAI)
    try:
        assert state.engine is not None and state.llm is not None
        prompt = state.llm.tokenizer.encode("ping") or [0]
        async for out in state.engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0)):
            if out.finished and out.error:
                raise APIError(ErrorKind.GENERATION, out.error)
    except (EngineDeadError, ValueError) as e:
        return APIError(ErrorKind.INCOMPLETE, f"generation failed: {e}").response(Family.OPENAI)
    except APIError as e:
        return e.response(Family.OPENAI)
    finally:
        slot.release()
    return JSONResponse({"status": "ok"})


async def _reset(request: Request) -> Response:
    state = server_state(request)
    if state.pooling is not None and state.ready:
        # A pooling engine keeps no KV between requests: nothing to forget (a 503 here would never clear).
        return JSONResponse({"status": "ok"})
    try:
        _loaded(state)
        assert state.engine is not None
        ok = await state.engine.reset_prefix_cache()
    except APIError as e:
        return e.response(Family.OPENAI)
    except EngineDeadError as e:
        return APIError(ErrorKind.INCOMPLETE, str(e)).response(Family.OPENAI)
    if not ok:
        return APIError(
            ErrorKind.UNAVAILABLE, "requests still hold KV blocks; retry the cache flush when idle"
        ).response(Family.OPENAI)
    return JSONResponse({"status": "ok"})


@router.post("/flush_cache", summary="Forget every cached prefix (the router's cache flush)")
async def flush_cache(request: Request) -> Response:
    return await _reset(request)


@router.post("/reset_prefix_cache", summary="Forget every cached prefix (vLLM's route)")
async def reset_prefix_cache(request: Request) -> Response:
    return await _reset(request)
