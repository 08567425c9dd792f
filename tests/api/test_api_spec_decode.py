"""Speculative decoding behind the real HTTP server: the `openai` client's greedy completions (n > 1,
stop strings, streaming) equal plain decoding's, and /metrics exposes vLLM's spec_decode counters."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import scrape_metric
from serving import free_port, serve_in_thread

from server.cli import build_parser, config_from_args
from server.config import CacheConfig, EngineConfig, ModelConfig, ServerConfig
from server.engine import LLMEngine
from server.request import SamplingParams
from server.spec_decode.config import SpeculativeConfig

PROMPT = "one two three four one two three four one two"


def engine_config(folder: Path, spec: SpeculativeConfig | None) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(folder), dtype="float32", served_model_name="tiny"),
        cache=CacheConfig(block_size=8, num_kv_blocks=128),
        speculative=spec,
    )


@pytest.fixture(scope="module")
def spec_server(tiny_model_factory) -> Iterator[tuple[str, LLMEngine]]:  # type: ignore[no-untyped-def]

    from server.api.app import create_app
    from server.api.state import ServerState

    folder = tiny_model_factory("llama")
    plain = LLMEngine(engine_config(folder, None))
    cfg = engine_config(folder, SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=3))
    port = free_port()
    state = ServerState(
        ServerConfig(engine=cfg, host="127.0.0.1", port=port), engine_factory=lambda: LLMEngine(cfg)
    )
    running = serve_in_thread(create_app(state), port, name="spec-test-server")
    url = running.url
    yield url, plain
    running.stop()


def test_openai_completions_match_plain_decoding(spec_server: tuple[str, LLMEngine]) -> None:
    import openai

    url, plain = spec_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    prompt_ids = plain.tokenizer.encode(PROMPT)
    ref_ids = plain.generate([prompt_ids], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    ref = plain.tokenizer.decode(ref_ids)
    res = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0.0, n=2)
    assert [c.text for c in res.choices] == [ref, ref]
    assert res.usage is not None and res.usage.completion_tokens == 48
    stop = ref[: len(ref) // 2]
    chunks = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=24, temperature=0.0, stop=[stop], stream=True
    )
    pieces = list(chunks)
    assert "".join(c.choices[0].text for c in pieces if c.choices) == ""  # the stop string starts the text
    assert [c.choices[0].finish_reason for c in pieces if c.choices][-1] == "stop"
    stop = ref[len(ref) // 2 : len(ref) // 2 + 4]
    res = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0.0, stop=[stop])
    assert res.choices[0].text == ref[: ref.index(stop)] and res.choices[0].finish_reason == "stop"

    drafts = scrape_metric(url, "vllm:spec_decode_num_drafts_total")
    proposed = scrape_metric(url, "vllm:spec_decode_num_draft_tokens_total")
    accepted = scrape_metric(url, "vllm:spec_decode_num_accepted_tokens_total")
    per_pos = scrape_metric(url, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert drafts > 0 and 0 < accepted <= proposed and per_pos == accepted


def test_cli_flag() -> None:
    args = build_parser({}).parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}']
    )
    assert config_from_args(args).engine.speculative == SpeculativeConfig("ngram", 4, 3, 3)
    env = {"KUBEINFER_SPECULATIVE_CONFIG": '{"method": "ngram", "num_speculative_tokens": 0}'}
    with pytest.raises(ValueError, match="num_speculative_tokens must be"):
        config_from_args(build_parser(env).parse_args([]))
    assert config_from_args(build_parser({}).parse_args([])).engine.speculative is None
    draft = '{"model": "/models/draft", "num_speculative_tokens": 2}'
    args = build_parser({}).parse_args(["--speculative-config", draft])
    assert config_from_args(args).engine.speculative == SpeculativeConfig(
        "draft_model", 2, model="/models/draft"
    )
    with pytest.raises(ValueError, match="draft model does not work with --tensor-parallel-size"):
        config_from_args(
            build_parser({}).parse_args(["--speculative-config", draft, "--tensor-parallel-size", "2"])
        )
