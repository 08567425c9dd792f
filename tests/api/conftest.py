"""API test fixtures: one in-process server on a free port sharing a preloaded engine, whose greedy
reference outputs are computed with LLMEngine.generate before the server takes the engine over."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from serving import free_port, serve_in_thread

SERVED_NAME = "smollm2-test"
TGI_PROMPT = "The capital of France is"
TGI_MAX_NEW = 8
CHAT_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_MAX = 8
STREAM_PROMPTS = [
    f"List {i}: apples, pears," if i % 2 else f"Numbers: {i}, {i + 1}, {i + 2}," for i in range(20)
]
STREAM_MAX = 6


@dataclass
class Reference:
    """Greedy token ids and text the engine produces offline for a prompt."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str


@dataclass
class LiveServer:
    url: str
    state: Any  # ServerState
    llm: Any  # LLMEngine
    refs: dict[str, Reference] = field(default_factory=dict)

    def metric(self, name: str, default: float | None = None) -> float:
        return scrape_metric(self.url, name, default)


def scrape_metric(url: str, name: str, default: float | None = None) -> float:
    """The sum of a metric's samples `name{...} value` over label sets; `default` if it has none yet
    (a labelled counter has no sample before its first increment)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        metric = line.split("{", 1)[0].split(" ", 1)[0]
        if metric == name:
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        if default is not None:
            return default
        raise AssertionError(f"metric {name} not exposed")
    return total


@pytest.fixture(scope="session")
def live_server(smollm2_dir: Path) -> Iterator[LiveServer]:

    from server.api.app import create_app
    from server.api.state import ServerState
    from server.config import CacheConfig, EngineConfig, ModelConfig, ServerConfig
    from server.engine import LLMEngine
    from server.request import SamplingParams

    engine_cfg = EngineConfig(
        model=ModelConfig(model=None, dtype="float32", served_model_name=SERVED_NAME),
        cache=CacheConfig(num_kv_blocks=192),
        max_num_seqs=32,
        num_threads=1,
    )
    llm = LLMEngine(engine_cfg)
    tok = llm.tokenizer
    greedy = SamplingParams(temperature=0.0, max_tokens=TGI_MAX_NEW)
    refs: dict[str, Reference] = {}

    def add_refs(keys: list[str], prompts: list[list[int]], params: SamplingParams) -> None:
        outs = llm.generate(prompts, params)
        for key, ids, out in zip(keys, prompts, outs, strict=True):
            refs[key] = Reference(ids, out, tok.decode(out))

    add_refs(["tgi"], [tok.encode(TGI_PROMPT)], greedy)
    add_refs(
        ["chat"],
        [tok.apply_chat_template(CHAT_MESSAGES)],
        SamplingParams(temperature=0.0, max_tokens=CHAT_MAX),
    )
    add_refs(
        STREAM_PROMPTS,
        [tok.encode(p) for p in STREAM_PROMPTS],
        SamplingParams(temperature=0.0, max_tokens=STREAM_MAX),
    )

    port = free_port()
    config = ServerConfig(engine=engine_cfg, host="127.0.0.1", port=port, max_concurrent_requests=64)
    state = ServerState(config, engine_factory=lambda: llm)
    app = create_app(state)
    running = serve_in_thread(app, port, name="api-test-server")
    url = running.url
    yield LiveServer(url=url, state=state, llm=llm, refs=refs)
    running.stop()
