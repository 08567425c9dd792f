"""LoRA over HTTP on a tiny Qwen2 with peft-made adapters: the real `openai` client picks an adapter by
`model`, huggingface_hub's TGI client by `adapter_id`; /v1/models lists adapters with their parent;
vLLM's run-time load/unload routes with their responses and errors; vllm:lora_requests_info."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import scrape_metric
from lora_adapters import make_adapter, peft_greedy
from serving import free_port, serve_in_thread

PROMPT = "Once upon a time, in a small village by the sea,"
MAX = 8
BASE = "tiny-base"


@dataclass
class LoRAServer:
    url: str
    llm: Any
    adapters: dict[str, Path]
    refs: dict[str, str]  # adapter name (or BASE) -> greedy completion text from transformers + peft
    ref_ids: dict[str, list[int]]


@pytest.fixture(scope="module")
def lora_server(tiny_model_factory, tmp_path_factory) -> Iterator[LoRAServer]:  # type: ignore[no-untyped-def]

    from server.api.app import create_app
    from server.api.state import ServerState
    from server.config import CacheConfig, EngineConfig, LoRAConfig, LoRAModule, ModelConfig, ServerConfig
    from server.engine import LLMEngine

    base = tiny_model_factory("qwen2", tie=False, heads=4, kv_heads=2)
    other = tiny_model_factory("llama", tie=True, hidden=32, heads=2, kv_heads=1)
    root = tmp_path_factory.mktemp("api-lora")
    all7 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapters = {
        "sql": make_adapter(base, root / "sql", 8, all7, seed=1, std=0.15),
        "chat": make_adapter(base, root / "chat", 4, ("q_proj", "v_proj", "down_proj"), seed=2, std=0.2),
        "late": make_adapter(base, root / "late", 16, ("o_proj", "up_proj"), seed=3, std=0.15, rslora=True),
        "huge": make_adapter(base, root / "huge", 32, ("q_proj",), seed=4),
        "foreign": make_adapter(other, root / "foreign", 4, ("q_proj",), seed=5),
    }
    engine_cfg = EngineConfig(
        model=ModelConfig(model=str(base), dtype="float32", served_model_name=BASE),
        cache=CacheConfig(block_size=8, num_kv_blocks=256),
        num_threads=1,
        lora=LoRAConfig(
            enable_lora=True,
            lora_modules=(
                LoRAModule("sql", str(adapters["sql"])),
                LoRAModule("chat", str(adapters["chat"]), base_model_name="tiny-parent"),
            ),
            max_loras=2,
            max_lora_rank=16,
            max_cpu_loras=3,
            allow_runtime_updating=True,
            allowed_paths=(str(root),),  # the run-time route loads `late` etc. from here
        ),
    )
    llm = LLMEngine(engine_cfg)
    ids = llm.tokenizer.encode(PROMPT)
    ref_ids = {n: peft_greedy(base, adapters[n], [ids], MAX)[0] for n in ("sql", "chat", "late")}
    ref_ids[BASE] = peft_greedy(base, None, [ids], MAX)[0]
    refs = {n: llm.tokenizer.decode(t) for n, t in ref_ids.items()}
    assert len(set(refs.values())) == 4  # every adapter changes the output
    port = free_port()
    config = ServerConfig(engine=engine_cfg, host="127.0.0.1", port=port, max_concurrent_requests=32)
    state = ServerState(config, engine_factory=lambda: llm)
    running = serve_in_thread(create_app(state), port, name="api-lora-server")
    url = running.url
    yield LoRAServer(url, llm, adapters, refs, ref_ids)
    running.stop()


def _client(s: LoRAServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0)


def test_models_list_adapters_with_parent(lora_server: LoRAServer) -> None:
    data = {m.id: m.to_dict() for m in _client(lora_server).models.list().data}
    assert set(data) == {BASE, "sql", "chat"}
    assert data["sql"]["parent"] == BASE
    assert data["chat"]["parent"] == "tiny-parent"  # the JSON form's base_model_name
    assert data[BASE]["parent"] is None
    assert data["sql"]["root"] == str(lora_server.adapters["sql"])


def test_openai_client_picks_adapter_by_model(lora_server: LoRAServer) -> None:
    client = _client(lora_server)
    for name in (BASE, "sql", "chat"):
        r = client.completions.create(model=name, prompt=PROMPT, max_tokens=MAX, temperature=0.0)
        assert r.model == name
        assert r.choices[0].text == lora_server.refs[name], name
    stream = client.completions.create(
        model="sql", prompt=PROMPT, max_tokens=MAX, temperature=0.0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == lora_server.refs["sql"]
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)


def test_tgi_adapter_id(lora_server: LoRAServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub's InferenceClient is the TGI client that sends `adapter_id` (text-generation 0.7
    has no such argument)."""
    from huggingface_hub import InferenceClient, constants

    # The suite runs hub-offline; this client talks to our local server only.
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "is_offline_mode", lambda: False)

    hub = InferenceClient(base_url=lora_server.url)
    out = hub.text_generation(PROMPT, max_new_tokens=MAX, adapter_id="chat", details=True)
    assert out.generated_text == lora_server.refs["chat"]
    assert [t.id for t in out.details.tokens] == lora_server.ref_ids["chat"]
    base = hub.text_generation(PROMPT, max_new_tokens=MAX)
    assert base == lora_server.refs[BASE]
    r = httpx.post(
        f"{lora_server.url}/generate",
        json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2, "adapter_id": "nope"}},
        timeout=60,
    )
    assert r.status_code == 422 and "adapter `nope` is not loaded" in r.json()["error"]


def test_mixed_concurrent_requests_beyond_max_loras(lora_server: LoRAServer) -> None:
    """12 concurrent requests over 2 adapters and the base model (the max_loras cap makes some wait)."""
    client = openai.AsyncOpenAI(base_url=f"{lora_server.url}/v1", api_key="none", max_retries=0)
    names = [BASE, "sql", "chat"] * 4

    async def run() -> list[str]:
        rs = await asyncio.gather(
            *(
                client.completions.create(model=n, prompt=PROMPT, max_tokens=MAX, temperature=0.0)
                for n in names
            )
        )
        return [r.choices[0].text for r in rs]

    assert asyncio.run(run()) == [lora_server.refs[n] for n in names]
    pool = lora_server.llm.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_runtime_load_unload_routes(lora_server: LoRAServer) -> None:
    url, ad = lora_server.url, lora_server.adapters

    def load(body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60)

    def unload(body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{url}/v1/unload_lora_adapter", json=body, timeout=60)

    r = load({"lora_name": "late"})
    assert (
        r.status_code == 400
        and r.json()["error"]["message"] == "Both 'lora_name' and 'lora_path' must be provided."
    )
    r = load({"lora_name": "sql", "lora_path": str(ad["late"])})
    assert (
        r.status_code == 400
        and "The lora adapter 'sql' has already been loaded." in r.json()["error"]["message"]
    )
    r = load({"lora_name": "x", "lora_path": "/does/not/exist"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    r = load({"lora_name": "x", "lora_path": str(ad["huge"])})
    assert r.status_code == 400 and "greater than max_lora_rank 16" in r.json()["error"]["message"]
    r = load({"lora_name": "x", "lora_path": str(ad["foreign"])})
    assert r.status_code == 400 and "another model" in r.json()["error"]["message"]

    r = load({"lora_name": "late", "lora_path": str(ad["late"])})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' added successfully."
    client = _client(lora_server)
    text = (
        client.completions.create(model="late", prompt=PROMPT, max_tokens=MAX, temperature=0.0)
        .choices[0]
        .text
    )
    assert text == lora_server.refs["late"]
    assert "late" in {m.id for m in client.models.list().data}

    r = unload({"lora_name": "late"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' removed successfully."
    r = unload({"lora_name": "late"})
    assert r.status_code == 404 and r.json()["error"]["message"] == "The lora adapter 'late' cannot be found."
    r = unload({})
    assert r.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt=PROMPT, max_tokens=2)
    # the others keep serving
    text = (
        client.completions.create(model="sql", prompt=PROMPT, max_tokens=MAX, temperature=0.0).choices[0].text
    )
    assert text == lora_server.refs["sql"]
    pool = lora_server.llm.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_lora_metrics(lora_server: LoRAServer) -> None:
    _client(lora_server).completions.create(model="chat", prompt=PROMPT, max_tokens=2)
    text = httpx.get(f"{lora_server.url}/metrics", timeout=60).text
    info = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0]
    assert 'running_lora_adapters=""' in info[0] and 'waiting_lora_adapters=""' in info[0]  # idle now
    assert scrape_metric(lora_server.url, "kubeinfer_lora_requests_total") >= 1
    assert 'lora_name="chat"' in text


# The model server protocol the Gateway API Inference Extension's endpoint picker scrapes (its
# docs/proposals/003-model-server-protocol: the vLLM column): name -> (type, labels it reads).
EPP_SCRAPED = {
    "vllm:num_requests_waiting": ("gauge", set()),
    "vllm:num_requests_running": ("gauge", set()),
    "vllm:kv_cache_usage_perc": ("gauge", set()),
    "vllm:lora_requests_info": ("gauge", {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}),
    "vllm:cache_config_info": ("gauge", {"block_size", "num_gpu_blocks"}),
}


def test_metrics_the_endpoint_picker_scrapes(lora_server: LoRAServer) -> None:
    """spec.routing.gateway's picker chooses a pod from these: each is served with its type and labels,
    the KV usage is a fraction, and the LoRA info's value is the time it was last updated."""
    import time

    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{lora_server.url}/metrics", timeout=60).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, (kind, wanted_labels) in EPP_SCRAPED.items():
        family = families.get(name)
        assert family is not None, name
        assert family.type == kind, (name, family.type)
        assert family.samples, name
        for sample in family.samples:
            assert wanted_labels <= set(sample.labels), (name, sample.labels)
    usage = families["vllm:kv_cache_usage_perc"].samples[0].value
    assert 0.0 <= usage <= 1.0
    (info,) = families["vllm:lora_requests_info"].samples
    assert abs(info.value - time.time()) < 3600 and info.labels["max_lora"] == "2"
    (cache,) = families["vllm:cache_config_info"].samples
    assert int(cache.labels["block_size"]) > 0 and int(cache.labels["num_gpu_blocks"]) > 0
