"""Engine fault isolation over HTTP: an exception injected in one request's detokenization or sampling
fails that request with the right error (TGI 424 `generation`, OpenAI 500) while the requests running
beside it finish normally; a dead engine loop turns /health to 503."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from rel_support import InProcServer, engine_config, scrape, serve_in_process

FAULT_TEXT = "qzfaultinjected"
NORMAL_NEW = 80  # long enough that the faulty requests run while these do


def _contains(seq: list[int], sub: list[int]) -> bool:
    n = len(sub)
    return n > 0 and any(seq[i : i + n] == sub for i in range(len(seq) - n + 1))


@pytest.fixture
def fault_ids(rel_server: InProcServer) -> list[int]:
    ids: list[int] = rel_server.llm.tokenizer.encode(FAULT_TEXT, False)
    assert ids
    return ids


@pytest.fixture
def detok_fault(
    monkeypatch: pytest.MonkeyPatch, fault_ids: list[int], rel_server: InProcServer
) -> Iterator[list[int]]:
    """IncrementalDetokenizer.push raises for requests whose prompt holds the fault marker; records how
    many requests were running at each fault (read on the engine thread, where push runs)."""
    from server.tokenizer import IncrementalDetokenizer

    real_init = IncrementalDetokenizer.__init__
    real_push = IncrementalDetokenizer.push
    hits: list[int] = []

    def init(self: Any, tokenizer: Any, prompt_ids: list[int], params: Any) -> None:
        real_init(self, tokenizer, prompt_ids, params)
        self._rel_fault = _contains(list(prompt_ids), fault_ids)

    def push(self: Any, token_ids: list[int], drop_last: bool = False) -> Any:
        if getattr(self, "_rel_fault", False):
            hits.append(rel_server.llm.stats().num_running)
            raise RuntimeError("injected detokenization fault")
        return real_push(self, token_ids, drop_last)

    monkeypatch.setattr(IncrementalDetokenizer, "__init__", init)
    monkeypatch.setattr(IncrementalDetokenizer, "push", push)
    yield hits


@pytest.fixture
def sampling_fault(monkeypatch: pytest.MonkeyPatch, fault_ids: list[int]) -> Iterator[list[int]]:
    """Sampler raises whenever its batch holds a request whose prompt has the fault marker."""
    from server.worker.sampler import Sampler

    real_call = Sampler.__call__
    hits: list[int] = []

    def call(self: Any, logits: Any, rows: list[Any], *args: Any) -> Any:
        if any(_contains(r.request.prompt_token_ids, fault_ids) for r in rows):
            hits.append(len(rows))
            raise RuntimeError("injected sampling fault")
        return real_call(self, logits, rows, *args)

    monkeypatch.setattr(Sampler, "__call__", call)
    yield hits


async def _normal_stream(client: httpx.AsyncClient, i: int, started: asyncio.Event, seen: list[int]) -> int:
    """A long greedy TGI stream that must finish with all its tokens."""
    body = {"inputs": f"normal request {i} about rivers", "parameters": {"max_new_tokens": NORMAL_NEW}}
    events = []
    async with client.stream("POST", "/generate_stream", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
                seen[i] += 1
                if all(seen):
                    started.set()
    assert all("error" not in e for e in events), events[-1]
    last = events[-1]
    assert last["details"]["finish_reason"] in ("length", "eos_token"), last
    return int(last["details"]["generated_tokens"])


async def _faulty_requests(client: httpx.AsyncClient) -> dict[str, tuple[int, Any]]:
    """The same marked prompt through each route, all at once."""
    prompt = f"{FAULT_TEXT} please fail"

    async def plain(path: str, body: dict[str, Any]) -> tuple[int, Any]:
        r = await client.post(path, json=body)
        return r.status_code, r.json()

    async def tgi_stream() -> tuple[int, Any]:
        body = {"inputs": prompt, "parameters": {"max_new_tokens": 8}}
        async with client.stream("POST", "/generate_stream", json=body) as r:
            return r.status_code, [json.loads(x[5:]) async for x in r.aiter_lines() if x.startswith("data:")]

    async def openai_stream() -> tuple[int, Any]:
        body = {"prompt": prompt, "max_tokens": 8, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            return r.status_code, [x[5:].strip() async for x in r.aiter_lines() if x.startswith("data:")]

    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 8}
    results = await asyncio.gather(
        plain("/generate", {"inputs": prompt, "parameters": {"max_new_tokens": 8}}),
        plain("/v1/completions", {"prompt": prompt, "max_tokens": 8}),
        plain("/v1/chat/completions", chat),
        tgi_stream(),
        openai_stream(),
    )
    return dict(zip(("tgi", "openai", "chat", "tgi_stream", "openai_stream"), results, strict=True))


def _run_isolation(srv: InProcServer) -> tuple[list[int], dict[str, tuple[int, Any]]]:
    async def scenario() -> tuple[list[int], dict[str, tuple[int, Any]]]:
        n = 4
        seen = [0] * n
        started = asyncio.Event()
        async with httpx.AsyncClient(base_url=srv.url, headers=srv.auth, timeout=120) as client:
            normals = [asyncio.create_task(_normal_stream(client, i, started, seen)) for i in range(n)]
            await asyncio.wait_for(started.wait(), 60)
            faulty = await _faulty_requests(client)
            tokens = await asyncio.gather(*normals)
        return list(tokens), faulty

    return asyncio.run(scenario())


def _assert_failed_right(faulty: dict[str, tuple[int, Any]], reason: str) -> None:
    status, body = faulty["tgi"]
    assert status == 424 and body["error_type"] == "generation", (status, body)
    assert reason in body["error"]
    for key in ("openai", "chat"):
        status, body = faulty[key]
        assert status == 500, (key, status, body)
        assert body["error"]["type"] == "InternalServerError" and body["error"]["code"] == 500, body
        assert reason in body["error"]["message"]
    status, events = faulty["tgi_stream"]
    assert status == 200
    assert events[-1]["error_type"] == "generation" and reason in events[-1]["error"], events
    status, frames = faulty["openai_stream"]
    assert status == 200 and frames[-1] == "[DONE]"
    err = json.loads(frames[-2])
    assert err["error"]["code"] == 500 and reason in err["error"]["message"], err


def _assert_server_healthy(srv: InProcServer) -> None:
    assert httpx.get(f"{srv.url}/health", timeout=60).status_code == 200
    r = httpx.post(
        f"{srv.url}/generate",
        json={"inputs": "still alive?", "parameters": {"max_new_tokens": 3, "details": True}},
        headers=srv.auth,
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["details"]["generated_tokens"] == 3
    m = scrape(srv.url)
    assert m["vllm:kv_cache_usage_perc"] == 0.0
    assert m["vllm:num_requests_running"] == 0.0 and m["vllm:num_requests_waiting"] == 0.0


def test_rel_fault_detokenization_fails_only_that_request(
    rel_server: InProcServer, detok_fault: list[int]
) -> None:
    tokens, faulty = _run_isolation(rel_server)
    assert detok_fault, "the injected fault never fired"
    # At least once the failing request was detokenized in a step with other running requests.
    assert max(detok_fault) > 1, detok_fault
    _assert_failed_right(faulty, "detokenization failed")
    assert all(1 <= t <= NORMAL_NEW for t in tokens), tokens
    _assert_server_healthy(rel_server)


def test_rel_fault_sampling_fails_only_that_request(
    rel_server: InProcServer, sampling_fault: list[int]
) -> None:
    tokens, faulty = _run_isolation(rel_server)
    assert sampling_fault, "the injected fault never fired"
    # At least once the marked request shared a batch with the normal ones (the isolation path).
    assert max(sampling_fault) > 1, sampling_fault
    _assert_failed_right(faulty, "sampling failed")
    assert all(1 <= t <= NORMAL_NEW for t in tokens), tokens
    _assert_server_healthy(rel_server)


def test_rel_fault_dead_engine_loop_turns_health_503(rel_model: Path) -> None:
    """A crash of the step loop itself (not one request) kills the engine: in-flight requests get an
    error instead of hanging, /health and /ready turn 503, and new requests are refused."""
    from server.engine import LLMEngine

    llm = LLMEngine(engine_config(rel_model, num_kv_blocks=16))
    srv = serve_in_process(llm, api_key=None)
    try:
        assert httpx.get(f"{srv.url}/health", timeout=60).status_code == 200
        real_step = llm.step
        calls = []

        def dying_step() -> Any:
            calls.append(1)
            if len(calls) > 2:
                raise RuntimeError("injected engine loop crash")
            return real_step()

        llm.step = dying_step  # type: ignore[method-assign]  # looked up on every loop iteration
        r = httpx.post(
            f"{srv.url}/generate", json={"inputs": "doomed", "parameters": {"max_new_tokens": 20}}, timeout=60
        )
        assert r.status_code == 500 and r.json()["error_type"] == "incomplete_generation", r.text
        assert "engine loop died" in r.json()["error"]
        health = httpx.get(f"{srv.url}/health", timeout=60)
        assert health.status_code == 503 and health.json()["status"] == "dead", health.text
        assert "injected engine loop crash" in health.json()["error"]
        assert httpx.get(f"{srv.url}/ready", timeout=60).status_code == 503
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "after", "max_tokens": 2}, timeout=30)
        assert r.status_code >= 500 and r.json()["error"]["code"] == r.status_code, r.text
        assert httpx.get(f"{srv.url}/metrics", timeout=60).status_code == 200  # still observable
    finally:
        srv.stop()
