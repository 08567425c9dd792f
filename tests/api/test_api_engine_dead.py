"""When the engine loop dies, liveness fails (so Kubernetes restarts the pod) and requests get errors
in each client's format instead of hanging. Uses a tiny random-weight model: only the plumbing matters."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from serving import free_port, serve_in_thread


@pytest.fixture
def tiny_server(tiny_model_factory: Callable[..., Path]) -> Iterator[tuple[str, object]]:

    from server.api.app import create_app
    from server.api.state import ServerState
    from server.config import CacheConfig, EngineConfig, ModelConfig, ServerConfig
    from server.engine import LLMEngine

    engine_cfg = EngineConfig(
        model=ModelConfig(model=str(tiny_model_factory()), dtype="float32"),
        cache=CacheConfig(num_kv_blocks=32),
        num_threads=1,
    )
    llm = LLMEngine(engine_cfg)
    port = free_port()
    state = ServerState(
        ServerConfig(engine=engine_cfg, host="127.0.0.1", port=port), engine_factory=lambda: llm
    )
    running = serve_in_thread(create_app(state), port)
    url = running.url
    yield url, llm
    running.stop()


def test_api_engine_loop_death(tiny_server: tuple[str, object]) -> None:
    url, llm = tiny_server
    ok = httpx.post(
        f"{url}/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}}, timeout=60
    )
    assert ok.status_code == 200

    def broken_step() -> list:
        raise RuntimeError("injected engine crash")

    llm.step = broken_step  # type: ignore[attr-defined]
    r = httpx.post(
        f"{url}/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}}, timeout=60
    )
    assert r.status_code == 500 and r.json()["error_type"] == "incomplete_generation"
    assert "injected engine crash" in r.json()["error"]
    h = httpx.get(f"{url}/health", timeout=60)
    assert h.status_code == 503 and h.json()["status"] == "dead"
    assert httpx.get(f"{url}/ready", timeout=60).status_code == 503
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=10)
    assert r.status_code == 500 and "engine" in r.json()["error"]["message"]
