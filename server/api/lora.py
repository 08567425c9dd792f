"""vLLM's run-time LoRA routes: POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Mounted only with --allow-runtime-lora-updating (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), since
they let any client with the API key make the server read folders (or hub repos); local folders are
confined to `--lora-allowed-paths` (server/lora/paths.py). Responses and errors
follow vLLM's `serving_models.py`: a plain-text success line; 400 for a missing field, a name loaded
twice or an adapter that cannot be served; 404 for an unknown name or a path with no adapter.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from server.config import default_cache_dir
from server.lora.adapter import LoRAAdapterError, fetch_hub_adapter
from server.lora.paths import (
    AdapterInputError,
    AdapterPathRefused,
    allowed_roots,
    check_input,
    confine,
    is_hub_id,
)
from server.lora.registry import LoRAConflictError, LoRANotFoundError

from .errors import APIError, ErrorKind, Family, validation
from .generation import read_json
from .state import ServerState, server_state

router = APIRouter()


def _field(body: Any, name: str) -> str | None:
    value = body.get(name) if isinstance(body, dict) else None
    if value is not None and not isinstance(value, str):
        raise validation(f"'{name}' must be a string", name)
    return value or None


async def _confined_folder(state: ServerState, name: str, path: str) -> Path:
    """The adapter folder `path` names, inside the allowed roots (server/lora/paths.py); a hub id is
    fetched into the cache first. Raises APIError (one 404 for every path outside or absent)."""
    assert state.llm is not None and state.llm.lora is not None
    try:
        check_input(name, path)
    except AdapterInputError as e:
        raise validation(str(e), e.field) from None
    cache_dir = state.llm.lora.cache_dir or default_cache_dir()
    roots = allowed_roots(state.config.engine.lora, cache_dir)
    try:
        if is_hub_id(path):
            fetched = await asyncio.to_thread(fetch_hub_adapter, path, cache_dir)
            return confine(str(fetched), roots)
        return confine(path, roots)
    except AdapterPathRefused as e:
        raise APIError(ErrorKind.NOT_FOUND, str(e), "lora_path") from None


@router.post("/v1/load_lora_adapter", summary="Load a LoRA adapter at run time (vLLM)")
async def load_lora_adapter(request: Request) -> Response:
    state = server_state(request)
    try:
        if state.llm is None or state.llm.lora is None:
            raise APIError(ErrorKind.UNAVAILABLE, "the model is still loading")
        body = await read_json(request, state.config.max_payload_bytes)
        name, path = _field(body, "lora_name"), _field(body, "lora_path")
        if not name or not path:
            raise validation("Both 'lora_name' and 'lora_path' must be provided.")
        if name in (state.llm.info.served_model_name, state.model_name):
            # requests naming the base model would be served by the adapter, or the other way round
            raise validation(f"'lora_name' {name!r} is the base model's name", "lora_name")
        registry = state.llm.lora
        try:
            folder = await _confined_folder(state, name, path)
            # reading safetensors takes a while: off the event loop
            await asyncio.to_thread(registry.add, name, str(folder))
        except LoRAConflictError as e:
            raise validation(str(e), "lora_name") from None
        except LoRAAdapterError as e:
            kind = ErrorKind.NOT_FOUND if "No adapter found" in str(e) else ErrorKind.VALIDATION
            raise APIError(kind, str(e), "lora_path") from None
    except APIError as e:
        return e.response(Family.OPENAI)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", summary="Unload a LoRA adapter at run time (vLLM)")
async def unload_lora_adapter(request: Request) -> Response:
    state = server_state(request)
    try:
        if state.llm is None or state.llm.lora is None:
            raise APIError(ErrorKind.UNAVAILABLE, "the model is still loading")
        body = await read_json(request, state.config.max_payload_bytes)
        name = _field(body, "lora_name")
        if not name:
            raise validation("'lora_name' needs to be provided to unload a LoRA adapter.")
        try:
            state.llm.lora.remove(name)
        except LoRANotFoundError as e:
            raise APIError(ErrorKind.NOT_FOUND, str(e.args[0]), "lora_name") from None
    except APIError as e:
        return e.response(Family.OPENAI)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
