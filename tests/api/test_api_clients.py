"""The real `openai` and `text-generation` clients against a live server: greedy outputs equal the
engine's own offline outputs, streaming and not; 20 concurrent streams; probes, info and metrics."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from conftest import (
    CHAT_MAX,
    CHAT_MESSAGES,
    SERVED_NAME,
    STREAM_MAX,
    STREAM_PROMPTS,
    TGI_MAX_NEW,
    TGI_PROMPT,
    LiveServer,
)
from text_generation import AsyncClient, Client


def test_api_probes_info_models(live_server: LiveServer) -> None:
    url = live_server.url
    assert httpx.get(f"{url}/health", timeout=60).status_code == 200
    r = httpx.get(f"{url}/ready", timeout=60)
    assert r.status_code == 200 and r.json() == {"status": "ready"}
    info = httpx.get(f"{url}/info", timeout=60).json()
    for key in (
        "model_id",
        "model_sha",
        "model_pipeline_tag",
        "max_concurrent_requests",
        "max_best_of",
        "max_stop_sequences",
        "max_input_tokens",
        "max_total_tokens",
        "validation_workers",
        "max_client_batch_size",
        "router",
        "version",
        "sha",
        "docker_label",
        "dtype",
        "quantization",
        "kv_block_size",
        "kv_blocks",
    ):
        assert key in info, key
    assert info["max_concurrent_requests"] == 64
    assert info["dtype"] == "float32"
    assert info["gemm_dtype"] == "float32"  # --dtype float32: the GGUF dequantized, nothing block-quantized
    assert info["kv_blocks"] == 192 and info["kv_block_size"] == 16
    # SmolLM2's 30 layers all attend globally: one KV group of every block
    assert info["kv_groups"] == [{"layers": list(range(30)), "blocks": 192, "sliding_window": None}]
    assert info["max_input_tokens"] < info["max_total_tokens"]
    models = httpx.get(f"{url}/v1/models", timeout=60).json()
    assert models["object"] == "list" and models["data"][0]["id"] == SERVED_NAME
    toks = httpx.post(f"{url}/tokenize", json={"inputs": TGI_PROMPT}, timeout=60).json()
    assert [t["id"] for t in toks] == live_server.refs["tgi"].prompt_ids
    assert "".join(t["text"] for t in toks) == TGI_PROMPT
    assert all(TGI_PROMPT[t["start"] : t["stop"]] == t["text"] for t in toks)


def test_api_tgi_client_generate_matches_engine(live_server: LiveServer) -> None:
    ref = live_server.refs["tgi"]
    client = Client(live_server.url, timeout=120)
    resp = client.generate(TGI_PROMPT, max_new_tokens=TGI_MAX_NEW, decoder_input_details=True)
    assert resp.generated_text == ref.text
    d = resp.details
    assert [t.id for t in d.tokens] == ref.token_ids
    assert d.generated_tokens == len(ref.token_ids)
    assert d.finish_reason.value in ("length", "eos_token")
    assert d.seed is None  # greedy
    assert all(t.logprob is not None and t.logprob <= 0 for t in d.tokens)
    assert [t.id for t in d.prefill] == ref.prompt_ids
    assert d.prefill[0].logprob is None and all(t.logprob is not None for t in d.prefill[1:])
    # Full text and stop sequences: the stop sequence stays in TGI's generated_text.
    stop_word = ref.text.split()[0]
    resp = client.generate(
        TGI_PROMPT, max_new_tokens=TGI_MAX_NEW, stop_sequences=[stop_word], return_full_text=True
    )
    assert resp.generated_text.startswith(TGI_PROMPT) and resp.generated_text.endswith(stop_word)
    assert resp.details.finish_reason.value == "stop_sequence"


def test_api_tgi_client_stream_matches_engine(live_server: LiveServer) -> None:
    ref = live_server.refs["tgi"]
    client = Client(live_server.url, timeout=120)
    events = list(client.generate_stream(TGI_PROMPT, max_new_tokens=TGI_MAX_NEW, top_n_tokens=2))
    assert [e.token.id for e in events] == ref.token_ids
    assert "".join(e.token.text for e in events if not e.token.special) == ref.text
    assert all(e.generated_text is None for e in events[:-1])
    assert events[-1].generated_text == ref.text
    assert events[-1].details is not None and events[-1].details.generated_tokens == len(ref.token_ids)
    # top_n_tokens: the chosen greedy token is the most likely alternative.
    assert all(e.top_tokens and len(e.top_tokens) == 2 and e.top_tokens[0].id == e.token.id for e in events)


def test_api_tgi_raw_sse_and_headers(live_server: LiveServer) -> None:
    ref = live_server.refs["tgi"]
    body = {"inputs": TGI_PROMPT, "parameters": {"max_new_tokens": TGI_MAX_NEW}}
    r = httpx.post(f"{live_server.url}/generate", json=body, timeout=120)
    assert r.status_code == 200 and r.json() == {"generated_text": ref.text}
    assert r.headers["x-prompt-tokens"] == str(len(ref.prompt_ids))
    assert r.headers["x-generated-tokens"] == str(len(ref.token_ids))
    for h in ("x-compute-time", "x-queue-time", "x-inference-time", "x-compute-type", "x-total-time"):
        assert h in r.headers
    with httpx.stream("POST", f"{live_server.url}/", json={**body, "stream": True}, timeout=120) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        frames = [line for line in s.iter_lines() if line]
    assert all(f.startswith("data:{") for f in frames)
    last = json.loads(frames[-1].removeprefix("data:"))
    assert last["generated_text"] == ref.text and last["details"]["input_length"] == len(ref.prompt_ids)
    # POST / without stream answers a one-element list.
    r = httpx.post(f"{live_server.url}/", json=body, timeout=120)
    assert r.json() == [{"generated_text": ref.text}]


def test_api_tgi_sampling_best_of(live_server: LiveServer) -> None:
    client = Client(live_server.url, timeout=120)
    resp = client.generate(TGI_PROMPT, max_new_tokens=4, do_sample=True, best_of=2)
    d = resp.details
    assert d.seed is not None and d.best_of_sequences is not None and len(d.best_of_sequences) == 1
    best = sum(t.logprob for t in d.tokens)
    other = sum(t.logprob for t in d.best_of_sequences[0].tokens)
    assert best >= other
    # Seeded sampling is reproducible.
    a = client.generate(TGI_PROMPT, max_new_tokens=4, do_sample=True, seed=7)
    b = client.generate(TGI_PROMPT, max_new_tokens=4, do_sample=True, seed=7)
    assert a.generated_text == b.generated_text and a.details.seed == 7


def test_api_openai_completions_match_engine(live_server: LiveServer) -> None:
    ref = live_server.refs["tgi"]
    client = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="unused")
    r = client.completions.create(
        model=SERVED_NAME, prompt=TGI_PROMPT, max_tokens=TGI_MAX_NEW, temperature=0, logprobs=2, n=2
    )
    assert [c.text for c in r.choices] == [ref.text, ref.text]
    assert r.usage.prompt_tokens == len(ref.prompt_ids)
    assert r.usage.completion_tokens == 2 * len(ref.token_ids)
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(ref.token_ids) and "".join(lp.tokens) == ref.text
    assert all(len(d) >= 1 for d in lp.top_logprobs)
    # Token-id prompts give the same result.
    r2 = client.completions.create(
        model=SERVED_NAME, prompt=ref.prompt_ids, max_tokens=TGI_MAX_NEW, temperature=0
    )
    assert r2.choices[0].text == ref.text
    chunks = list(
        client.completions.create(
            model=SERVED_NAME,
            prompt=TGI_PROMPT,
            max_tokens=TGI_MAX_NEW,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals in (["length"], ["stop"])


def test_api_openai_chat_matches_engine(live_server: LiveServer) -> None:
    ref = live_server.refs["chat"]
    client = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="unused")
    r = client.chat.completions.create(
        model=SERVED_NAME,
        messages=CHAT_MESSAGES,
        max_tokens=CHAT_MAX,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == ref.text
    assert r.usage.prompt_tokens == len(ref.prompt_ids)
    assert c.logprobs is not None and c.logprobs.content is not None
    assert len(c.logprobs.content) == len(ref.token_ids)
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token for t in c.logprobs.content)
    stream = client.chat.completions.create(
        model=SERVED_NAME, messages=CHAT_MESSAGES, max_tokens=CHAT_MAX, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_api_twenty_concurrent_streams(live_server: LiveServer) -> None:
    refs = live_server.refs

    async def one(client: AsyncClient, prompt: str) -> str:
        text = ""
        async for ev in client.generate_stream(prompt, max_new_tokens=STREAM_MAX):
            if not ev.token.special:
                text += ev.token.text
            if ev.generated_text is not None:
                assert ev.generated_text == text
        return text

    async def main() -> list[str]:
        client = AsyncClient(live_server.url, timeout=180)
        return await asyncio.gather(*(one(client, p) for p in STREAM_PROMPTS))

    before = live_server.metric("vllm:request_success_total")
    texts = asyncio.run(main())
    assert texts == [refs[p].text for p in STREAM_PROMPTS]
    assert live_server.metric("vllm:request_success_total") - before == len(STREAM_PROMPTS)


def test_api_metrics_names(live_server: LiveServer) -> None:
    text = httpx.get(f"{live_server.url}/metrics", timeout=60).text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_preemptions_total",
        "vllm:request_success_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
        # issue 50 item 9: names dashboards query
        "vllm:time_per_output_token_seconds_bucket",
        "vllm:request_inference_time_seconds_bucket",
        "vllm:request_prefill_time_seconds_bucket",
        "vllm:request_decode_time_seconds_bucket",
        "vllm:request_params_n_bucket",
        "vllm:cache_config_info",
        "vllm:iteration_tokens_total_bucket",
        "tgi_queue_size",
        "tgi_batch_current_size",
        "tgi_request_count",
        "tgi_request_duration_bucket",
        "kubeinfer_http_requests_total",
    ):
        assert f"\n{name}{{" in text, name
    for name in ("tgi_request_count", "tgi_request_success", "tgi_request_failure"):  # as TGI types them
        assert f"# TYPE {name} counter\n" in text, name
    assert f'model_name="{SERVED_NAME}"' in text
    assert (
        f'kubeinfer_http_requests_total{{model_name="{SERVED_NAME}",route="/generate",status="200"}}' in text
    )
    assert live_server.metric("vllm:generation_tokens_total") > 0


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics", "/info"])
def test_api_open_routes_without_key(live_server: LiveServer, path: str) -> None:
    assert httpx.get(f"{live_server.url}{path}", timeout=60).status_code == 200
