"""--reasoning-parser: the split equals vLLM's on its documented cases (deepseek_r1, qwen3), streamed
deltas add up to the whole split, and a live server over a tiny random Qwen3 with a thinking chat
template returns thinking apart from the answer on chat completions and /v1/responses. A random
model never closes its thinking on its own, so a vLLM regex grammar over the whole output forces a
thinking span and its `</think>`."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from serving import free_port, serve_in_thread

from server.api.reasoning import ReasoningParser

# ---- the split, as vLLM's tests state it ---------------------------------------------------------
R, C = "This is a reasoning section", "This is the rest"
CASES: list[tuple[str, str, str | None, str | None]] = [
    # parser, output, reasoning, content
    ("deepseek_r1", f"<think>{R}</think>{C}", R, C),
    ("deepseek_r1", f"{R}</think>{C}", R, C),  # no start tag: still split at </think>
    ("deepseek_r1", R, R, None),  # no end tag: all reasoning
    ("deepseek_r1", f"<think>{R}", R, None),
    ("deepseek_r1", f"<think>{R}</think>", R, None),
    ("deepseek_r1", f"<think>{R}\nline</think>{C}\nThat", f"{R}\nline", f"{C}\nThat"),
    ("qwen3", f"<think>{R}</think>{C}", R, C),
    ("qwen3", C, None, C),  # no </think>: all content
    ("qwen3", f"<think>{R}", None, f"<think>{R}"),  # an open tag alone: content
    ("qwen3", f"<think>{R}</think>", R, None),
    ("qwen3", f"{R}</think>{C}", R, C),  # Qwen3-Thinking: <think> was in the prompt
    ("qwen3", f"<think>{R}\nsection</think>{C}\nThat", f"{R}\nsection", f"{C}\nThat"),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_reasoning_split_matches_vllm(
    name: str, text: str, reasoning: str | None, content: str | None
) -> None:
    split = ReasoningParser(name).split(text)
    assert (split.reasoning, split.content) == (reasoning, content)


@pytest.mark.parametrize("size", [1, 2, 3, 7])
@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_reasoning_stream_adds_up(
    name: str, text: str, reasoning: str | None, content: str | None, size: int
) -> None:
    opens = name == "qwen3" and not text.startswith("<think>") and "</think>" in text
    rs = ReasoningParser(name).stream(prompt_opens_thinking=opens)
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    got_r, got_c = "", ""
    for i, p in enumerate(pieces):
        r, c = rs.feed(p, i == len(pieces) - 1)
        got_r, got_c = got_r + r, got_c + c
    if name == "qwen3" and text == f"<think>{R}":
        # vLLM streams an opened, never closed thinking block as reasoning (its non-stream split says content)
        assert (got_r, got_c) == (R, "")
    else:
        assert (got_r, got_c) == (reasoning or "", content or "")


def test_reasoning_parser_names() -> None:
    from server.config import ServerConfig

    assert ServerConfig(reasoning_parser="openai_gptoss").reasoning_parser == "openai_gptoss"  # harmony
    with pytest.raises(ValueError, match="requires reasoning_parser 'openai_gptoss'"):
        ServerConfig(tool_call_parser="openai", reasoning_parser="qwen3")
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerConfig(reasoning_parser="nope")


# ---- a live server over a tiny Qwen3 with a thinking template ------------------------------------
TEMPLATE = """{%- if tools %}<|im_start|>system
Tools: {{ tools | tojson }}<|im_end|>
{% endif %}{%- if reasoning_effort is defined %}<|im_start|>system
Reasoning effort: {{ reasoning_effort }}<|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.role == 'assistant' and m.reasoning_content %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content }}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""

NAME = "tiny-thinker"


@dataclasses.dataclass
class Thinker:
    url: str
    state: Any

    def parser(self, name: str) -> Any:
        return dataclasses.replace(self.state.config, reasoning_parser=name)


@pytest.fixture(scope="module")
def thinker(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Thinker]:

    from server.api.app import create_app
    from server.api.state import ServerState
    from server.config import CacheConfig, EngineConfig, ModelConfig, ServerConfig
    from server.engine import LLMEngine

    template = tmp_path_factory.mktemp("thinker") / "thinking.jinja"
    template.write_text(TEMPLATE)
    engine_cfg = EngineConfig(
        model=ModelConfig(
            model=str(tiny_model_factory("qwen3")),
            dtype="float32",
            served_model_name=NAME,
            chat_template=str(template),
        ),
        cache=CacheConfig(num_kv_blocks=64),
        max_num_seqs=8,
        num_threads=1,
    )
    port = free_port()
    config = ServerConfig(engine=engine_cfg, host="127.0.0.1", port=port, reasoning_parser="deepseek_r1")
    llm = LLMEngine(engine_cfg)
    state = ServerState(config, engine_factory=lambda: llm)
    running = serve_in_thread(create_app(state), port)
    url = running.url
    yield Thinker(url, state)
    running.stop()


FORCED = r"[a-z]{3,8} [a-z]{3,8}</think>\n\n[A-Z][a-z]{2,8}\."
USER = [{"role": "user", "content": "Think, then answer."}]


def _reasoning_counter(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kubeinfer_reasoning_tokens_total{")
    ]
    return sum(values)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


def _chat_stream(client: openai.OpenAI, **kw: Any) -> tuple[str, str, dict[str, Any]]:
    reasoning, content = "", ""
    last: dict[str, Any] = {}
    usage = None
    for chunk in client.chat.completions.create(
        model=NAME,
        messages=USER,  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
        **kw,
    ):
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        if chunk.choices:
            d = chunk.choices[0].delta.model_dump()
            assert d.get("reasoning") == d.get("reasoning_content")
            reasoning += d.get("reasoning_content") or ""
            content += d.get("content") or ""
            last = chunk.model_dump()
    return reasoning, content, {**last, "final_usage": usage}


def test_api_reasoning_chat_split_stream_and_template_kwargs(
    thinker: Thinker, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = _client(thinker.url)
    forced = {"extra_body": {"structured_outputs": {"regex": FORCED}}, "seed": 3, "temperature": 1.0}
    before = _reasoning_counter(thinker.url)
    r = client.chat.completions.create(model=NAME, messages=USER, max_tokens=80, **forced)  # type: ignore[arg-type]
    msg = r.choices[0].message.model_dump()
    reasoning, content = msg["reasoning_content"], msg["content"]
    assert msg["reasoning"] == reasoning and reasoning and content
    assert re.fullmatch(FORCED, reasoning + "</think>" + content), (reasoning, content)
    details = r.usage.completion_tokens_details  # type: ignore[union-attr]
    assert details is not None and 0 < (details.reasoning_tokens or 0) < r.usage.completion_tokens  # type: ignore[union-attr]
    # Streamed with the same seed: the deltas add up to the same split, and usage counts the same.
    # The metric counts thinking apart from the answer (vllm:generation_tokens counts both).
    assert _reasoning_counter(thinker.url) - before == details.reasoning_tokens
    streamed = _chat_stream(client, max_tokens=80, **forced)
    assert streamed[:2] == (reasoning, content)
    assert (
        streamed[2]["final_usage"]["completion_tokens_details"]["reasoning_tokens"]
        == details.reasoning_tokens
    )
    # Cut by max_tokens inside the thinking: all reasoning (deepseek_r1), streamed or not.
    cut = {"extra_body": {"structured_outputs": {"regex": "[a-z]{40,60}</think>ok"}}, "seed": 1}
    r = client.chat.completions.create(model=NAME, messages=USER, max_tokens=4, **cut)  # type: ignore[arg-type]
    msg = r.choices[0].message.model_dump()
    assert r.choices[0].finish_reason == "length" and msg["content"] is None and msg["reasoning_content"]
    assert r.usage.completion_tokens_details.reasoning_tokens == r.usage.completion_tokens == 4  # type: ignore[union-attr]
    assert _chat_stream(client, max_tokens=4, **cut)[:2] == (msg["reasoning_content"], "")
    # qwen3's rule for the same cut: no </think>, so all content (vLLM).
    monkeypatch.setattr(thinker.state, "config", thinker.parser("qwen3"))
    r = client.chat.completions.create(model=NAME, messages=USER, max_tokens=4, **cut)  # type: ignore[arg-type]
    assert r.choices[0].message.content == msg["reasoning_content"]
    assert r.choices[0].message.model_dump()["reasoning_content"] is None
    monkeypatch.undo()
    # An answer's grammar while the prompt leaves thinking open: refused, naming the field.
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=NAME, messages=USER, max_tokens=8, response_format={"type": "json_object"}
        )
    assert e.value.body["param"] == "response_format"  # type: ignore[index]
    # chat_template_kwargs enable_thinking false: the template closes the thinking, the grammar
    # applies to the whole output, which is the answer.
    r = client.chat.completions.create(
        model=NAME,
        messages=USER,
        max_tokens=60,
        seed=0,
        response_format={"type": "json_object"},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    msg = r.choices[0].message.model_dump()
    assert msg["reasoning_content"] is None and msg["content"].lstrip().startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(msg["content"]), dict)
    # reasoning_effort reaches a template that reads it; template keys of the call itself are refused.
    plain = client.chat.completions.create(model=NAME, messages=USER, max_tokens=1)
    high = client.chat.completions.create(model=NAME, messages=USER, max_tokens=1, reasoning_effort="high")
    assert high.usage.prompt_tokens > plain.usage.prompt_tokens  # type: ignore[union-attr]
    for extra, param in (
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ):
        resp = httpx.post(
            f"{thinker.url}/v1/chat/completions",
            json={"model": NAME, "messages": USER, "max_tokens": 1, **extra},
            timeout=60,
        )
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_api_reasoning_responses_items_and_events(thinker: Thinker) -> None:
    client = _client(thinker.url)
    # Cut inside the thinking (a random model never writes </think>): one reasoning item, incomplete.
    r = client.responses.create(model=NAME, input="Think.", max_output_tokens=6, temperature=0.0)
    assert r.status == "incomplete" and [o.type for o in r.output] == ["reasoning"]
    text = r.output[0].content[0].text  # type: ignore[union-attr,index]
    assert text and r.output_text == ""
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 6  # type: ignore[union-attr]
    with client.responses.stream(model=NAME, input="Think.", max_output_tokens=6, temperature=0.0) as stream:
        events = list(stream)
    final = events[-1].response  # type: ignore[union-attr]  # response.incomplete (the SDK waits for .completed)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == text  # type: ignore[union-attr]
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert done.text == text and kinds[-1] == "response.incomplete"  # type: ignore[union-attr]
    assert final.output[0].type == "reasoning" and final.usage.output_tokens_details.reasoning_tokens == 6  # type: ignore[union-attr]
    # The reasoning item goes back into the next turn's template (reasoning_content).
    follow = client.responses.create(
        model=NAME, input="And?", previous_response_id=r.id, max_output_tokens=1, temperature=0.0
    )
    fresh = client.responses.create(model=NAME, input="And?", max_output_tokens=1, temperature=0.0)
    assert follow.usage.input_tokens > fresh.usage.input_tokens + 6  # type: ignore[union-attr]
    # reasoning.effort where the template reads it; a forced tool while thinking is open: 400.
    low = client.responses.create(
        model=NAME, input="Think.", max_output_tokens=1, reasoning={"effort": "low"}
    )
    assert low.usage.input_tokens > r.usage.input_tokens and low.reasoning.effort == "low"  # type: ignore[union-attr]
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model=NAME,
            input="x",
            tools=[tool],
            tool_choice={"type": "function", "name": "f"},  # type: ignore[list-item,typeddict-item]
        )
    assert e.value.body["param"] == "tool_choice"  # type: ignore[index]


CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,6}"\}\}</tool_call>'
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_api_reasoning_tool_calls_come_from_the_answer(
    thinker: Thinker, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = dataclasses.replace(thinker.state.config, enable_auto_tool_choice=True, tool_call_parser="hermes")
    monkeypatch.setattr(thinker.state, "config", cfg)
    client = _client(thinker.url)
    common: dict[str, Any] = {"tools": [WEATHER], "tool_choice": "auto", "max_tokens": 80, "seed": 2}
    # A call after </think> is a call; the thinking stays apart.
    after = {"structured_outputs": {"regex": f"[a-z]{{3,8}}</think>\n\n{CALL}"}}
    r = client.chat.completions.create(model=NAME, messages=USER, extra_body=after, **common)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls and not msg.content
    assert msg.tool_calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert msg.model_dump()["reasoning_content"]
    reasoning, content, last = _chat_stream(client, extra_body=after, **common)
    assert reasoning == msg.model_dump()["reasoning_content"] and content == ""
    assert last["choices"][0]["finish_reason"] == "tool_calls"
    # A call written inside the thinking is thinking, not a call.
    inside = {"structured_outputs": {"regex": f"{CALL}[a-z]{{3,8}}</think>\n\nDone\\."}}
    r = client.chat.completions.create(model=NAME, messages=USER, extra_body=inside, **common)
    msg = r.choices[0].message
    assert not msg.tool_calls and r.choices[0].finish_reason == "stop"
    assert "<tool_call>" in msg.model_dump()["reasoning_content"] and msg.content == "\n\nDone."
    # /v1/responses with tools, cut inside the thinking: a reasoning item and no call parsed from it.
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}  # type: ignore[index]
    events = []
    with httpx.stream(
        "POST",
        f"{thinker.url}/v1/responses",
        json={"model": NAME, "input": "Weather?", "tools": [tool], "max_output_tokens": 6, "stream": True},
        timeout=120,
    ) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert events[-1]["type"] == "response.incomplete"
    assert [o["type"] for o in events[-1]["response"]["output"]] == ["reasoning"]
    assert "response.reasoning_text.done" in [e["type"] for e in events]


class _Tok:
    """A tokenizer whose `</think>` is one token (id 7), as Qwen3's and DeepSeek-R1's are, or several."""

    def __init__(self, prompt_tail: str, single: bool) -> None:
        self.tail, self.single = prompt_tail, single

    def decode(self, ids: list[int]) -> str:
        return self.tail

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert text == "</think>" and not add_special_tokens
        return [7] if self.single else [3, 4, 5]


def test_reasoning_plan_starts_answer_grammars_after_think() -> None:
    from server.api.errors import APIError
    from server.api.reasoning import plan_reasoning
    from server.request import GrammarSpec

    spec = GrammarSpec("json_object")
    plan = plan_reasoning("qwen3", _Tok("<|im_start|>assistant\n<think>\n", True), [1], "response_format")
    assert plan.opens_thinking and plan.answer_grammar(spec).start_after == (7,)
    plan = plan_reasoning("deepseek_r1", _Tok("<|Assistant|>", True), [1], "tool_choice")
    assert not plan.opens_thinking and plan.answer_grammar(spec).start_after == (7,)
    # Thinking closed in the prompt: no split, the grammar holds from the first token.
    plan = plan_reasoning("qwen3", _Tok("<think>\n\n</think>\n\n", True), [1], "response_format")
    assert plan.parser is None and plan.answer_grammar(spec) == spec
    # No answer grammar: nothing to start; no parser: nothing at all.
    assert plan_reasoning("qwen3", _Tok("<think>\n", False), [1], None).grammar_start == ()
    assert plan_reasoning(None, _Tok("<think>\n", True), [1], "response_format") == plan_reasoning(
        None, None, [], None
    )
    with pytest.raises(APIError) as e:
        plan_reasoning("qwen3", _Tok("<think>\n", False), [1], "text.format")
    assert e.value.param == "text.format" and "several tokens" in e.value.message
