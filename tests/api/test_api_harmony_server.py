"""gpt-oss's harmony output through a live server (`--reasoning-parser openai_gptoss`, `--tool-call-parser
openai`): a tiny random model whose tokenizer holds harmony's markers as special tokens (SmolLM2's ids
3-9 renamed) and a harmony chat template; its logits are scripted to write a given harmony token
sequence (a random model never would), so the real path runs: sampling, detokenization with special
tokens kept, the split, chat completions (whole and streamed, tools) and /v1/responses."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from serving import free_port, serve_in_thread

MARKERS = {3: "<|start|>", 4: "<|end|>", 5: "<|message|>", 6: "<|channel|>", 7: "<|constrain|>"}
MARKERS |= {8: "<|return|>", 9: "<|call|>"}
TEMPLATE = (  # harmony's shape: tools in a developer message, then the turns
    "{% if tools %}<|start|>developer<|message|># Tools {{ tools | tojson }}<|end|>{% endif %}"
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
NAME, EOS = "tiny-harmony", 2
R, C = "User wants weather. Call the tool.", "Sunny and mild."
ARGS = '{"city": "Paris"}'
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def harmony_tokenizer(src: Path, dst: Path) -> None:
    """SmolLM2's tokenizer with its special tokens 3-9 renamed to harmony's markers (still special,
    still one id each, as in o200k_harmony)."""
    tj = json.loads((src / "tokenizer.json").read_text())
    for tok in tj["added_tokens"]:
        if tok["id"] in MARKERS:
            old, tok["content"] = tok["content"], MARKERS[tok["id"]]
            tj["model"]["vocab"][tok["content"]] = tj["model"]["vocab"].pop(old)
    (dst / "tokenizer.json").write_text(json.dumps(tj))
    tc = json.loads((src / "tokenizer_config.json").read_text())
    for key, tok in (tc.get("added_tokens_decoder") or {}).items():
        if int(key) in MARKERS:
            tok["content"] = MARKERS[int(key)]
    tc["additional_special_tokens"] = list(MARKERS.values())
    tc["chat_template"] = TEMPLATE
    (dst / "tokenizer_config.json").write_text(json.dumps(tc))
    (dst / "chat_template.jinja").unlink(missing_ok=True)


class Script:
    """The token ids the model writes next, one per forward (requests run one at a time here)."""

    def __init__(self) -> None:
        self.ids: list[int] = []

    def logits(self, hidden: torch.Tensor, vocab: int) -> torch.Tensor:
        out = torch.full((hidden.shape[0], vocab), -1e4)
        out[:, self.ids.pop(0) if self.ids else EOS] = 0.0
        return out


class Harmony:
    def __init__(self, url: str, script: Script, tokenizer: Any) -> None:
        self.url, self.script, self.tokenizer = url, script, tokenizer

    def will_write(self, text: str) -> int:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.script.ids = [*ids, EOS]
        return len(ids)


@pytest.fixture(scope="module")
def harmony(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Harmony]:

    from server.api.app import create_app
    from server.api.state import ServerState
    from server.config import CacheConfig, EngineConfig, ModelConfig, ServerConfig
    from server.engine import LLMEngine

    src = tiny_model_factory("llama")
    folder = tmp_path_factory.mktemp("harmony")
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, folder / f.name)
    harmony_tokenizer(src, folder)
    engine_cfg = EngineConfig(
        model=ModelConfig(model=str(folder), dtype="float32", served_model_name=NAME),
        cache=CacheConfig(num_kv_blocks=64),
        max_num_seqs=4,
        num_threads=1,
    )
    port = free_port()
    config = ServerConfig(
        engine=engine_cfg, host="127.0.0.1", port=port, reasoning_parser="openai_gptoss",
        tool_call_parser="openai", enable_auto_tool_choice=True,
    )  # fmt: skip
    llm = LLMEngine(engine_cfg)
    script = Script()
    model: Any = llm.loaded.model
    vocab = model.config.vocab_size
    model.compute_logits = lambda hidden: script.logits(hidden, vocab)
    state = ServerState(config, engine_factory=lambda: llm)
    running = serve_in_thread(create_app(state), port)
    from server.tokenizer import Tokenizer

    yield Harmony(running.url, script, Tokenizer(folder))
    running.stop()


def _client(url: str) -> Any:  # Any: the SDK's TypedDicts would want every literal below typed
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


ANSWER = f"<|channel|>analysis<|message|>{R}<|end|><|start|>assistant<|channel|>final<|message|>{C}<|return|>"
CALL = (
    f"<|channel|>analysis<|message|>{R}<|end|><|start|>assistant<|channel|>commentary "
    f"to=functions.get_weather <|constrain|>json<|message|>{ARGS}<|call|>"
)
USER = [{"role": "user", "content": "Weather in Paris?"}]


def test_chat_reasoning_and_answer_whole_and_streamed(harmony: Harmony) -> None:
    client = _client(harmony.url)
    analysis_tokens = len(harmony.tokenizer.encode(f"<|channel|>analysis<|message|>{R}<|end|>", False))
    harmony.will_write(ANSWER)
    r = client.chat.completions.create(model=NAME, messages=USER, max_tokens=100, temperature=0.0)
    msg = r.choices[0].message.model_dump()
    assert (msg["reasoning_content"], msg["content"]) == (R, C)
    assert r.usage.completion_tokens_details.reasoning_tokens == analysis_tokens
    harmony.will_write(ANSWER)
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(
        model=NAME,
        messages=USER,
        max_tokens=100,
        temperature=0.0,
        stream=True,
    ):
        if chunk.choices:
            d = chunk.choices[0].delta.model_dump()
            reasoning += d.get("reasoning_content") or ""
            content += d.get("content") or ""
    assert (reasoning, content) == (R, C)


def test_chat_tool_call_from_the_commentary_channel(harmony: Harmony) -> None:
    client = _client(harmony.url)
    harmony.will_write(CALL)
    r = client.chat.completions.create(
        model=NAME,
        messages=USER,
        tools=[WEATHER],
        max_tokens=100,
        temperature=0.0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == R
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", json.loads(ARGS))
    ]
    harmony.will_write(CALL)
    streamed: list[Any] = []
    for chunk in client.chat.completions.create(
        model=NAME,
        messages=USER,
        tools=[WEATHER],
        max_tokens=100,
        temperature=0.0,
        stream=True,
    ):
        if chunk.choices and chunk.choices[0].delta.tool_calls:
            streamed += chunk.choices[0].delta.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed] == [
        ("get_weather", json.loads(ARGS))
    ]


def test_responses_reasoning_item_and_message(harmony: Harmony) -> None:
    client = _client(harmony.url)
    harmony.will_write(ANSWER)
    r = client.responses.create(model=NAME, input="Weather in Paris?", max_output_tokens=100, temperature=0.0)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == R and r.output_text == C


def test_response_format_holds_from_the_final_channel(harmony: Harmony) -> None:
    """The answer's grammar starts after `<|channel|>final<|message|>`: the scripted analysis (which a
    grammar from the first token would mask, so greedy could not write it) passes, the final JSON is
    constrained; a forced tool_choice is refused (harmony calls live in the commentary channel)."""
    client = _client(harmony.url)
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}}
    harmony.will_write(
        f"<|channel|>analysis<|message|>{R}<|end|><|start|>assistant<|channel|>final<|message|>{ARGS}"
    )
    r = client.chat.completions.create(
        model=NAME, messages=USER, max_tokens=100, temperature=0.0, response_format=fmt
    )
    msg = r.choices[0].message
    assert msg.reasoning_content == R and json.loads(msg.content) == json.loads(ARGS)
    assert r.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=NAME,
            messages=USER,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
    body: Any = e.value.body
    assert body["param"] == "tool_choice"
