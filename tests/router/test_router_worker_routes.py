"""The worker routes vllm-router calls, in-process on a tiny model: /health_generate runs a token
through the engine, /flush_cache and /reset_prefix_cache forget cached prefixes (the next identical
prompt gets no hit) and refuse with 503 while a request holds blocks, /get_load counts the engine's
requests, vLLM's /tokenize forms, and the API key still guards them."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from rel_support import API_KEY, SERVED_NAME, InProcServer, engine_config, scrape, serve_in_process

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def srv(tiny_model_factory: Callable[..., Path]) -> Iterator[InProcServer]:
    from server.engine import LLMEngine

    s = serve_in_process(LLMEngine(engine_config(tiny_model_factory("llama"))))
    yield s
    s.stop()


def complete(url: str, prompt: list[int], max_tokens: int = 2) -> httpx.Response:
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=120)


def test_health_generate_and_key(srv: InProcServer) -> None:
    assert httpx.get(f"{srv.url}/health_generate", timeout=5).status_code == 401
    before = scrape(srv.url)["vllm:generation_tokens_total"]
    r = httpx.get(f"{srv.url}/health_generate", headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert scrape(srv.url)["vllm:generation_tokens_total"] == before + 1


@pytest.mark.parametrize("route", ["/flush_cache", "/reset_prefix_cache"])
def test_flush_forgets_cached_prefixes(srv: InProcServer, route: str) -> None:
    prompt = list(range(100, 140))  # 2 full blocks of 16
    assert complete(srv.url, prompt).status_code == 200
    hits0 = scrape(srv.url)["vllm:prefix_cache_hits_total"]
    assert complete(srv.url, prompt).status_code == 200
    hits1 = scrape(srv.url)["vllm:prefix_cache_hits_total"]
    assert hits1 - hits0 == 32  # cached
    r = httpx.post(f"{srv.url}{route}", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    assert srv.llm.kv.pool._cached == {}
    assert complete(srv.url, prompt).status_code == 200
    assert scrape(srv.url)["vllm:prefix_cache_hits_total"] == hits1  # nothing left to hit


def test_flush_refuses_while_blocks_are_held_and_load_counts(srv: InProcServer) -> None:
    done = threading.Event()
    result: list[int] = []

    def long() -> None:
        result.append(complete(srv.url, list(range(200, 216)), max_tokens=70).status_code)
        done.set()

    t = threading.Thread(target=long)
    t.start()
    seen_load = 0
    refused = None
    while not done.is_set():
        seen_load = max(seen_load, httpx.get(f"{srv.url}/get_load", headers=AUTH, timeout=5).json()["load"])
        r = httpx.post(f"{srv.url}/flush_cache", headers=AUTH, timeout=30)
        if r.status_code == 503:
            refused = r.json()
            break
    t.join(120)
    assert result == [200]
    assert refused is not None and "retry" in refused["error"]["message"]
    assert seen_load >= 1 or refused is not None
    assert httpx.get(f"{srv.url}/get_load", headers=AUTH, timeout=5).json()["load"] == 0
    assert httpx.post(f"{srv.url}/flush_cache", headers=AUTH, timeout=30).status_code == 200


def test_vllm_tokenize_forms(srv: InProcServer) -> None:
    tok = srv.llm.tokenizer
    r = httpx.post(f"{srv.url}/tokenize", json={"prompt": "Hello world"}, headers=AUTH, timeout=10).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
    r = httpx.post(
        f"{srv.url}/tokenize",
        json={"prompt": "Hello world", "add_special_tokens": False},
        headers=AUTH,
        timeout=10,
    ).json()
    assert r["tokens"] == tok.encode("Hello world", False)
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(f"{srv.url}/tokenize", json={"messages": msgs}, headers=AUTH, timeout=10).json()
    assert r["tokens"] == tok.apply_chat_template(msgs, True)
    # TGI's form is untouched.
    tgi = httpx.post(f"{srv.url}/tokenize", json={"inputs": "Hello world"}, headers=AUTH, timeout=10).json()
    assert [t["id"] for t in tgi] == tok.encode("Hello world")
    # Unsupported fields are refused, not ignored; a wrong model is a 404.
    bad = httpx.post(f"{srv.url}/tokenize", json={"prompt": "x", "bogus": 1}, headers=AUTH, timeout=10)
    assert bad.status_code == 400 and "bogus" in bad.text
    assert (
        httpx.post(
            f"{srv.url}/tokenize", json={"prompt": "x", "model": "nope"}, headers=AUTH, timeout=10
        ).status_code
        == 404
    )


def test_server_info_reports_block_size_and_no_events(srv: InProcServer) -> None:
    info = httpx.get(f"{srv.url}/get_server_info", headers=AUTH, timeout=10).json()
    assert info["block_size"] == 16 and info["served_model_name"] == SERVED_NAME
    assert info["kv_events_config"]["enable_kv_cache_events"] is False
    assert httpx.get(f"{srv.url}/kv_event_sources", headers=AUTH, timeout=10).json() == {}
    model = httpx.get(f"{srv.url}/get_model_info", headers=AUTH, timeout=10).json()
    assert model["is_generation"] is True
