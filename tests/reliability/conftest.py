"""Reliability fixtures: the tiny random-weight model, and the app served in-process by uvicorn on a
thread (so tests can monkeypatch the engine and capture its logs)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from rel_support import InProcServer, engine_config, serve_in_process


@pytest.fixture(scope="session")
def rel_model(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def rel_server(rel_model: Path) -> Iterator[InProcServer]:
    """One in-process server (API key on, default 2 MB payload limit) shared by the reliability tests
    that do not break it."""
    from server.engine import LLMEngine

    srv = serve_in_process(LLMEngine(engine_config(rel_model)))
    yield srv
    srv.stop()
