"""The request `priority` field (vLLM's) end to end: refused under fcfs unless 0, and under
--scheduling-policy priority an interactive request overtakes a running batch request that holds the
only seat (the batch one is preempted, recomputed, and still finishes whole)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import SERVED_NAME, LiveServer
from serving import free_port, serve_in_thread


def test_api_priority_field(live_server: LiveServer) -> None:
    """The shared live server schedules fcfs: a non-zero priority is a 400 naming the field and the
    flag (as vLLM), 0 is everyone's default."""
    url = live_server.url
    for route, body in (
        ("/v1/completions", {"model": SERVED_NAME, "prompt": "Hi", "max_tokens": 1}),
        (
            "/v1/chat/completions",
            {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
        ),
    ):
        r = httpx.post(f"{url}{route}", json={**body, "priority": 3}, timeout=60)
        assert r.status_code == 400, r.text
        assert (
            "priority" in r.json()["error"]["message"]
            and "--scheduling-policy" in r.json()["error"]["message"]
        )
        r = httpx.post(f"{url}{route}", json={**body, "priority": 0}, timeout=60)
        assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def priority_server(tiny_model_factory: Callable[..., Path]) -> Iterator[str]:

    from server.api.app import create_app
    from server.api.state import ServerState
    from server.config import CacheConfig, EngineConfig, ModelConfig, ServerConfig
    from server.engine import LLMEngine

    engine_cfg = EngineConfig(
        model=ModelConfig(model=str(tiny_model_factory("llama")), dtype="float32", served_model_name="tiny"),
        cache=CacheConfig(num_kv_blocks=64),
        max_num_seqs=1,  # one seat: the interactive request can only run by taking it
        num_threads=1,
        scheduling_policy="priority",
    )
    llm = LLMEngine(engine_cfg)
    port = free_port()
    config = ServerConfig(
        engine=engine_cfg,
        host="127.0.0.1",
        port=port,
        max_concurrent_requests=8,
        # as the operator renders --objective-priority from spec.routing.gateway.priority
        objective_priorities=(("batch-pool", 10), ("chat-pool", 0)),
    )
    state = ServerState(config, engine_factory=lambda: llm)
    running = serve_in_thread(create_app(state), port)
    url = running.url
    yield url
    running.stop()


@pytest.mark.parametrize(
    "batch_priority",
    [
        pytest.param(({"priority": 10}, {}), id="body"),
        # the gateway's objective header, no priority in the body: --objective-priority maps it to 10
        pytest.param(({}, {"x-gateway-inference-objective": "batch-pool"}), id="objective-header"),
    ],
)
def test_an_interactive_request_overtakes_a_batch_request(
    priority_server: str, batch_priority: tuple[dict[str, Any], dict[str, str]]
) -> None:
    url = priority_server
    batch_body, batch_headers = batch_priority
    batch_tokens = 400
    seen_first = threading.Event()
    result: dict[str, Any] = {}

    def run_batch() -> None:
        body = {
            "model": "tiny",
            "prompt": "Once upon a time",
            "max_tokens": batch_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            **batch_body,
        }
        chunks = 0
        with httpx.stream(
            "POST", f"{url}/v1/completions", json=body, headers=batch_headers, timeout=300
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    seen_first.set()
        result["batch_done"] = time.monotonic()
        result["batch_chunks"] = chunks

    t = threading.Thread(target=run_batch)
    t.start()
    assert seen_first.wait(120)
    start = time.monotonic()
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": "tiny", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True, "priority": 0},
        timeout=300,
    )
    interactive_done = time.monotonic()
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    t.join(300)
    # The interactive request did not wait for the batch request to finish.
    assert interactive_done < result["batch_done"], (interactive_done - start, result)
    # The batch request was preempted and recomputed, and still streamed every token.
    assert result["batch_chunks"] == batch_tokens
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    preemptions = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("vllm:num_preemptions_total")
    ]
    assert preemptions and max(preemptions) >= 1


def test_objective_header_maps_only_bodies_without_priority() -> None:
    from server.api.objectives import apply_objective_priority

    objectives = (("pool-a", 5), ("pool-b", -2))
    header = {"x-gateway-inference-objective": "pool-b"}
    assert apply_objective_priority(header, {"prompt": "x"}, objectives) == {"prompt": "x", "priority": -2}
    assert apply_objective_priority(header, {"priority": None}, objectives) == {"priority": -2}  # null: unset
    # the body's own priority wins; unknown objectives, no header, no mapping and non-objects pass unchanged
    assert apply_objective_priority(header, {"priority": 1}, objectives) == {"priority": 1}
    assert apply_objective_priority({"x-gateway-inference-objective": "other"}, {}, objectives) == {}
    assert apply_objective_priority({}, {}, objectives) == {}
    assert apply_objective_priority(header, {}, ()) == {}
    assert apply_objective_priority(header, [1], objectives) == [1]


def test_objective_priority_flag_and_its_policy() -> None:
    import argparse

    from server.cli import parse_objective_priorities
    from server.config import EngineConfig, ServerConfig

    assert parse_objective_priorities("a=1, b=-3") == (("a", 1), ("b", -3))
    assert parse_objective_priorities('["a=0"]') == (("a", 0),)
    for bad in ("a", "=1", "a=x", "a=1,a=2"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_objective_priorities(bad)
    # under fcfs every mapped non-zero priority would be refused per request: refused at start instead
    with pytest.raises(ValueError, match="scheduling_policy 'priority'"):
        ServerConfig(objective_priorities=(("a", 1),))
    ServerConfig(engine=EngineConfig(scheduling_policy="priority"), objective_priorities=(("a", 1),))
