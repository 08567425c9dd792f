"""gpt-oss's harmony format (server/api/harmony.py): `--reasoning-parser openai_gptoss` splits the analysis
channel (reasoning) from the final channel (content), `--tool-call-parser openai` turns messages to
`functions.NAME` into calls; whole outputs and streams in every chunking agree; hand-written harmony
outputs as OpenAI's harmony docs write them, and the same text through a real tokenizer holding the
harmony special tokens, detokenized token by token with special tokens kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server.api.harmony import (
    HarmonySplitter,
    HarmonyToolParser,
    count_harmony_reasoning_tokens,
    parse_header,
)
from server.api.reasoning import ReasoningParser, count_reasoning_tokens
from server.api.structured import ToolPlan, ToolStream

R, C = "The user asks for the weather. I should call the tool.", "It is sunny in SF."
ARGS = '{"location": "San Francisco", "unit": "c"}'
ANALYSIS = f"<|channel|>analysis<|message|>{R}<|end|>"
CALL_RAW = (
    f"<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}"
)

# output text (the prompt ended with `<|start|>assistant`), reasoning, content, calls (name, args)
CASES: list[tuple[str, str | None, str | None, list[tuple[str, str]]]] = [
    (f"{ANALYSIS}<|start|>assistant<|channel|>final<|message|>{C}<|return|>", R, C, []),
    (
        f"{ANALYSIS}<|start|>assistant<|channel|>final<|message|>{C}",
        R,
        C,
        [],
    ),  # <|return|> is EOS: not in text
    (f"<|channel|>final<|message|>{C}", None, C, []),  # no thinking
    (f"<|channel|>analysis<|message|>{R[:20]}", R[:20], None, []),  # cut inside the thinking
    (f"{ANALYSIS}<|start|>assistant<|channel|>final<|message|>", R, None, []),  # cut after the header
    (  # two analysis messages: one reasoning text
        f"{ANALYSIS}<|start|>assistant<|channel|>analysis<|message|> More.<|end|>"
        f"<|start|>assistant<|channel|>final<|message|>{C}",
        R + " More.",
        C,
        [],
    ),
    (f"{ANALYSIS}{CALL_RAW}<|call|>", R, None, [("get_weather", ARGS)]),
    (f"{ANALYSIS}{CALL_RAW}", R, None, [("get_weather", ARGS)]),  # <|call|> is EOS too
    (  # the recipient in the role part, the content type bare
        '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"q": 1}<|call|>',
        None,
        None,
        [("lookup", '{"q": 1}')],
    ),
    (  # a preamble (commentary to nobody) is content; then a call
        f"{ANALYSIS}<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>{CALL_RAW}<|call|>",
        R,
        "Checking.",
        [("get_weather", ARGS)],
    ),
    ("Just text, no harmony.", None, "Just text, no harmony.", []),  # not harmony at all: content
]


def _tool_plan() -> ToolPlan:
    tools = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "lookup")]
    return ToolPlan("auto", tools, parser=HarmonyToolParser())


def _norm(calls: list[tuple[str, str]]) -> list[tuple[str, object]]:
    return [(n, json.loads(a)) for n, a in calls]


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), CASES)
def test_harmony_split_and_calls(
    text: str, reasoning: str | None, content: str | None, calls: list[tuple[str, str]]
) -> None:
    split = ReasoningParser("openai_gptoss").split(text)
    assert split.reasoning == reasoning
    parsed = _tool_plan().parse(split.content or "")
    assert (parsed.content or None) == content
    assert _norm([(c.name, c.arguments) for c in parsed.calls]) == _norm(calls)


@pytest.mark.parametrize("size", [1, 2, 5, 13])
@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), CASES)
def test_harmony_stream_adds_up(
    text: str, reasoning: str | None, content: str | None, calls: list[tuple[str, str]], size: int
) -> None:
    """Deltas of any size (markers split across them) add up to the whole split; the tool stream over
    the streamed answer sends the same calls and content."""
    rs = ReasoningParser("openai_gptoss").stream()
    ts = ToolStream(_tool_plan())
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    got_r, got_c, got_calls = "", "", []
    for i, p in enumerate(pieces):
        last = i == len(pieces) - 1
        r, answer = rs.feed(p, last)
        assert "<|" not in r  # no marker ever leaks into the reasoning
        delta = ts.feed(answer, last)
        got_r += r
        got_c += delta.get("content", "")
        got_calls += [
            (c["function"]["name"], c["function"]["arguments"]) for c in delta.get("tool_calls", [])
        ]
    assert (got_r, got_c, _norm(got_calls)) == (reasoning or "", content or "", _norm(calls))
    whole = rs.split_so_far()
    assert whole.reasoning == reasoning


def test_harmony_call_cut_by_max_tokens_keeps_the_named_call() -> None:
    text = f"{ANALYSIS}{CALL_RAW[:-10]}"  # the arguments cut short
    split = ReasoningParser("openai_gptoss").split(text)
    parsed = _tool_plan().parse(split.content or "")
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", ARGS[:-10])]
    # a malformed closed call is dropped, as the other tool parsers drop one
    bad = ReasoningParser("openai_gptoss").split(f"{CALL_RAW[:-3]}<|call|>")
    assert _tool_plan().parse(bad.content or "").calls == []


def test_harmony_header_forms() -> None:
    h = parse_header("assistant<|channel|>commentary to=functions.get_weather <|constrain|>json")
    assert (h.role, h.channel, h.recipient, h.content_type, h.function) == (
        "assistant", "commentary", "functions.get_weather", "json", "get_weather",
    )  # fmt: skip
    h = parse_header("assistant to=functions.f<|channel|>commentary json")
    assert (h.channel, h.function, h.content_type) == ("commentary", "f", "json")
    h = parse_header("<|channel|>analysis")
    assert (h.role, h.channel, h.recipient) == (None, "analysis", None)
    assert parse_header("assistant<|channel|>commentary to=browser.search").function is None


def test_harmony_reasoning_tokens_are_the_analysis_messages() -> None:
    tokens = ["<|channel|>", "analysis", "<|message|>", "Think", "ing.", "<|end|>"]
    tokens += ["<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "Answer", "."]
    assert count_harmony_reasoning_tokens(tokens) == 6
    split = ReasoningParser("openai_gptoss").split("".join(tokens))
    assert count_reasoning_tokens(tokens, split) == 6
    final_only = tokens[6:]
    split = ReasoningParser("openai_gptoss").split("".join(final_only))
    assert count_reasoning_tokens(final_only, split) == 0


def test_splitter_spans_cover_the_output() -> None:
    text = CASES[0][0]
    sp = HarmonySplitter()
    sp.feed(text, True)
    assert [s.header.channel for s in sp.spans] == ["analysis", "final"]
    assert sp.spans[0].start == 0 and sp.spans[-1].end == len(text)
    assert sp.spans[0].end == sp.spans[1].start


HARMONY_SPECIALS = [
    "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>",
]  # fmt: skip


def test_harmony_through_a_real_tokenizer(smollm2_dir: Path, tmp_path: Path) -> None:
    """A byte-level BPE tokenizer with harmony's special tokens (each one id, as in o200k_harmony):
    the output detokenized token by token with special tokens kept (what the routes ask for under
    openai_gptoss) splits as the text does; with them skipped the channels would be lost."""
    from transformers import AutoTokenizer

    from server.request import SamplingParams
    from server.tokenizer import IncrementalDetokenizer, Tokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_dir))
    hf.add_special_tokens({"additional_special_tokens": HARMONY_SPECIALS})
    tok = Tokenizer(tmp_path, hf=hf)
    text = f"{ANALYSIS}{CALL_RAW}<|call|>"
    ids = tok.encode(text, add_special_tokens=False)
    for marker in HARMONY_SPECIALS:
        assert len(tok.encode(marker, add_special_tokens=False)) == 1
    prompt = tok.encode("<|start|>assistant", add_special_tokens=False)
    for skip in (False, True):
        detok = IncrementalDetokenizer(
            tok, prompt, SamplingParams(max_tokens=len(ids), skip_special_tokens=skip)
        )
        rs = ReasoningParser("openai_gptoss").stream()
        ts = ToolStream(_tool_plan())
        reasoning, calls = "", []
        for i, t in enumerate(ids):
            last = i == len(ids) - 1
            r, answer = rs.feed(detok.push([t]).text, last)
            reasoning += r
            calls += ts.feed(answer, last).get("tool_calls", [])
        if skip:
            assert calls == [] and reasoning == ""  # the markers are gone: nothing to split on
        else:
            assert reasoning == R
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
                ("get_weather", json.loads(ARGS))
            ]
