"""`--reasoning-parser`: a thinking model's `<think>...</think>` text split from its answer, as vLLM's
parsers of the same names split it.

Whole outputs (`split`, vLLM's `extract_reasoning`):
  deepseek_r1: a leading `<think>` is dropped; without `</think>` the whole output is reasoning
      (DeepSeek-R1's template opens the thinking in the prompt); else reasoning is the text before
      `</think>` and content the text after it (None when empty).
  qwen3: without `</think>` the whole output is content (a model told not to think, or a non-thinking
      template); else as deepseek_r1 (a leading `<think>` dropped: Qwen3-Thinking models open it in
      the prompt).
Streams (`ReasoningStream`, vLLM's streaming rule): text is reasoning from the start (deepseek_r1, or
qwen3 when the output opens with `<think>` or the prompt ended inside an open `<think>`) until
`</think>`, content after it; a tag split across deltas is held back until it is whole. As in vLLM,
a qwen3 stream cut inside an opened thinking block streams reasoning where the whole-output split
would call the text content.
openai_gptoss: gpt-oss's harmony channels (harmony.py): analysis is the reasoning, final (and
commentary preambles) the content, messages to `functions.NAME` calls for `--tool-call-parser openai`;
its requests keep special tokens in the output text (the channel markers are special tokens).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from server.request import GrammarSpec

from .errors import validation
from .harmony import (
    FINAL_OPENING,
    HarmonyReasoningStream,
    HarmonySplit,
    count_harmony_reasoning_tokens,
    split_harmony,
)

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None
    content: str | None


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReasoningParser:
    """One parser by vLLM name; `split` for a whole output, `stream()` for deltas."""

    def __init__(self, name: str) -> None:
        if name not in ("deepseek_r1", "qwen3", "openai_gptoss"):
            raise ValueError(f"unknown reasoning parser {name!r}")
        self.name = name

    def split(self, text: str) -> ReasoningSplit | HarmonySplit:
        if self.name == "openai_gptoss":
            return split_harmony(text)
        if self.name == "qwen3" and END not in text:
            return ReasoningSplit(None, text)
        before, tag, after = text.partition(START)
        body = after if tag else before  # text before a <think> is dropped, as vLLM drops it
        if END not in body:
            return ReasoningSplit(body, None)
        reasoning, _, content = body.partition(END)
        return ReasoningSplit(reasoning, content or None)

    def stream(self, prompt_opens_thinking: bool = False) -> ReasoningStream | HarmonyReasoningStream:
        if self.name == "openai_gptoss":
            return HarmonyReasoningStream()
        return ReasoningStream(self.name == "deepseek_r1" or prompt_opens_thinking, self.name == "qwen3")


class ReasoningStream:
    """Text deltas -> (reasoning delta, content delta); the pieces add up to what was fed, tags aside."""

    def __init__(self, thinking: bool, wait_for_start: bool) -> None:
        self._buf = ""
        # None: not known yet whether the output opens a thinking block (qwen3 without a prompt hint)
        self._thinking: bool | None = True if thinking else (None if wait_for_start else False)
        self._started = False  # a leading <think> was consumed or ruled out
        self.reasoning_text = ""
        self.content_text = ""
        self.ended = False  # </think> seen

    @property
    def in_reasoning(self) -> bool:
        return bool(self._thinking) and not self.ended

    def split_so_far(self) -> ReasoningSplit:
        """What was streamed, as a split (reasoning None when the output never thought)."""
        thought = self.ended or bool(self.reasoning_text)
        return ReasoningSplit(self.reasoning_text if thought else None, self.content_text or None)

    def feed(self, delta: str, finished: bool) -> tuple[str, str]:
        self._buf += delta
        reasoning, content = "", ""
        while True:
            if not self._started:
                stripped = self._buf.lstrip()
                if stripped.startswith(START):
                    self._buf = stripped[len(START) :]
                    self._started = True
                    self._thinking = True
                    continue
                if START.startswith(stripped) and not finished:
                    break  # may still become <think>
                self._started = True
                if self._thinking is None:
                    self._thinking = False
                continue
            if self._thinking and not self.ended:
                at = self._buf.find(END)
                if at != -1:
                    reasoning += self._buf[:at]
                    self._buf = self._buf[at + len(END) :]
                    self.ended = True
                    continue
                keep = 0 if finished else _held(self._buf, END)
                reasoning += self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep :]
                break
            content += self._buf
            self._buf = ""
            break
        self.reasoning_text += reasoning
        self.content_text += content
        return reasoning, content


def count_reasoning_tokens(token_texts: list[str], split: ReasoningSplit | HarmonySplit) -> int:
    """How many output tokens the reasoning took: those up to the one completing `</think>`, or all
    of them when the whole output is reasoning (usage's reasoning_tokens); harmony: the tokens of its
    analysis messages."""
    if split.reasoning is None:
        return 0
    if isinstance(split, HarmonySplit):
        return count_harmony_reasoning_tokens(token_texts)
    seen = ""
    for i, t in enumerate(token_texts):
        seen += t
        if END in seen:
            return i + 1
    return len(token_texts)


# ---- the routes' side -----------------------------------------------------------------------------
# Names the template call sets itself; chat_template_kwargs may not override them.
_RESERVED_TEMPLATE_KEYS = frozenset(
    {"messages", "tools", "tokenize", "add_generation_prompt", "continue_final_message", "chat_template"}
)
EFFORTS = ("minimal", "low", "medium", "high")


def template_kwargs(
    tokenizer: Any, kwargs: dict[str, Any] | None, effort: str | None, effort_param: str
) -> dict[str, Any]:
    """vLLM's chat_template_kwargs plus `reasoning_effort` for the template; an effort the template
    would not read is a 400 naming `effort_param`."""
    out = dict(kwargs or {})
    bad = sorted(_RESERVED_TEMPLATE_KEYS & out.keys())
    if bad:
        raise validation(f"chat_template_kwargs may not set {bad[0]!r}", "chat_template_kwargs")
    if effort is not None:
        if effort not in EFFORTS:
            raise validation(f"{effort_param} must be one of {', '.join(EFFORTS)}", effort_param)
        if not tokenizer.chat_template_mentions("reasoning_effort"):
            raise validation(
                f"{effort_param}: this model's chat template takes no reasoning_effort", effort_param
            )
        out["reasoning_effort"] = effort
    return out


# What ReasoningParser.stream returns: the <think> tag stream or harmony's (one interface).
AnyReasoningStream = ReasoningStream | HarmonyReasoningStream


@dataclass(frozen=True)
class ReasoningPlan:
    """How a request's output is split: the parser (None: no --reasoning-parser, or thinking closed in
    the prompt), whether the prompt ends inside an open thinking block (the stream starts in
    reasoning), and the token ids after which an answer's grammar starts (empty: from the first token).
    """

    parser: ReasoningParser | None
    opens_thinking: bool = False
    grammar_start: tuple[int, ...] = ()

    @property
    def keep_special_tokens(self) -> bool:
        """Whether the request's output text must keep special tokens (harmony's channel markers)."""
        return self.parser is not None and self.parser.name == "openai_gptoss"

    def stream(self) -> AnyReasoningStream | None:
        return self.parser.stream(self.opens_thinking) if self.parser is not None else None

    def answer_grammar(self, spec: GrammarSpec) -> GrammarSpec:
        """An answer's grammar (response_format, text.format, a forced tool call), started after
        the thinking when this request thinks."""
        return dataclasses.replace(spec, start_after=self.grammar_start) if self.grammar_start else spec


def plan_reasoning(
    parser_name: str | None, tokenizer: Any, prompt_ids: list[int], answer_constraint: str | None
) -> ReasoningPlan:
    """The request's ReasoningPlan. `answer_constraint` names a field whose grammar is meant for the
    answer (response_format, text.format, a forced tool_choice): under a reasoning parser, unless the
    prompt already closed the thinking (e.g. enable_thinking false), the grammar starts after the
    model's `</think>` (as vLLM's structured outputs wait for the reasoning to end), which needs
    `</think>` to be one token (it is for Qwen3 and DeepSeek-R1); otherwise the request is refused
    rather than the grammar forbidding the thinking. A model that never closes its thinking is never
    constrained (its output is all reasoning)."""
    if parser_name is None:
        return ReasoningPlan(None)
    if parser_name == "openai_gptoss":
        if answer_constraint is None:
            return ReasoningPlan(ReasoningParser(parser_name))
        if answer_constraint not in ("response_format", "text.format"):
            # a forced call is a commentary message to=functions.NAME, not the final channel's text
            raise validation(
                f"{answer_constraint} with --reasoning-parser openai_gptoss is not supported: harmony "
                "writes calls in its commentary channel; use tool_choice auto",
                answer_constraint,
            )
        # the answer's grammar holds from the final channel's body on: analysis and preambles are free
        marker = tokenizer.encode(FINAL_OPENING, add_special_tokens=False)
        return ReasoningPlan(ReasoningParser(parser_name), grammar_start=tuple(int(t) for t in marker))
    tail = tokenizer.decode(prompt_ids[-8:]).rstrip()
    if tail.endswith(END):  # thinking is off for this request: the whole output is the answer
        return ReasoningPlan(None)
    start: tuple[int, ...] = ()
    if answer_constraint is not None:
        marker = tokenizer.encode(END, add_special_tokens=False)
        if len(marker) != 1:
            raise validation(
                f"{answer_constraint} with --reasoning-parser needs the thinking closed in the prompt "
                '(e.g. chat_template_kwargs {"enable_thinking": false}) with this tokenizer: it writes '
                "</think> as several tokens, so the grammar cannot wait for it",
                answer_constraint,
            )
        start = (int(marker[0]),)
    return ReasoningPlan(ReasoningParser(parser_name), tail.endswith(START), start)
