"""gpt-oss's harmony output format, read from the output text (special tokens kept): the thinking split
from the answer (`--reasoning-parser openai_gptoss`) and function calls (`--tool-call-parser openai`),
as vLLM names both.

Format (OpenAI's harmony docs, "OpenAI Harmony Response Format"): the prompt ends with
`<|start|>assistant`; the model then writes messages, each a header, `<|message|>`, a body and a
terminator:
    <|channel|>analysis<|message|>...thinking...<|end|>
    <|start|>assistant<|channel|>final<|message|>...answer...<|return|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}<|call|>
The header holds the role (after `<|start|>`), `<|channel|>NAME` (analysis, commentary, final), the
recipient `to=functions.NAME` (before or after the channel), and the content type (`<|constrain|>json`
or a bare `json`). `<|return|>` and `<|call|>` end the turn (they are EOS tokens, so the text may stop
without them); `<|end|>` ends one message.

Channels become: analysis -> reasoning; final and commentary without a recipient (a preamble) -> the
answer's content; a message to `functions.NAME` -> a function call whose arguments are its body. The
reasoning stream writes such a call into the answer text in one canonical form,
`<|channel|>commentary to=functions.NAME<|message|>ARGS<|call|>`, which `HarmonyToolParser` (the tool
parser `openai`) turns into a call; without tools in the request it stays visible in the content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .tool_parsers import ParsedCall, ParsedToolOutput

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
TERMINATORS = (END, RETURN, CALL)
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)
FUNCTIONS = "functions."
# what opens the answer's body (after `<|start|>assistant`): an answer grammar starts after it
FINAL_OPENING = f"{CHANNEL}final{MESSAGE}"


@dataclass(frozen=True)
class HarmonyHeader:
    role: str | None
    channel: str | None
    recipient: str | None  # e.g. "functions.get_weather"
    content_type: str | None  # e.g. "json"

    @property
    def function(self) -> str | None:
        """The called function's name for a message to `functions.NAME`, else None."""
        r = self.recipient
        return r[len(FUNCTIONS) :] if r is not None and r.startswith(FUNCTIONS) and len(r) > 10 else None


def parse_header(text: str) -> HarmonyHeader:
    """The text between a message's start (after `<|start|>`) and `<|message|>`."""
    before, has_channel, after = text.partition(CHANNEL)
    role_words = before.replace(CONSTRAIN, " ").split()
    chan_words = after.replace(CONSTRAIN, " ").split() if has_channel else []
    role = role_words[0] if role_words and not role_words[0].startswith("to=") else None
    channel = chan_words[0] if chan_words and not chan_words[0].startswith("to=") else None
    recipient = content_type = None
    for w in role_words[1 if role else 0 :] + chan_words[1 if channel else 0 :]:
        if w.startswith("to="):
            recipient = w[3:] or None
        elif content_type is None:
            content_type = w
    return HarmonyHeader(role, channel, recipient, content_type)


def _held(text: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of some marker (held back)."""
    best = 0
    for m in MARKERS:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


@dataclass(frozen=True)
class HarmonyEvent:
    kind: str  # "open" (header known), "text" (a piece of the body), "close" (the message ended)
    header: HarmonyHeader
    text: str = ""  # "text": the piece; "close": its terminator ("" when the output stopped first)


@dataclass(frozen=True)
class MessageSpan:
    """Where one message lies in the output text: [start, end) covers header, body and terminator."""

    header: HarmonyHeader
    start: int
    end: int


class HarmonySplitter:
    """Output text deltas -> HarmonyEvents, holding back a marker split across deltas. The output starts
    inside a header (the prompt ended with `<|start|>assistant`). Text that never reaches a
    `<|message|>` (a model not writing harmony, or cut inside a header) is, at the end, one body of
    an unnamed message when it holds no marker, else dropped."""

    def __init__(self) -> None:
        self._buf = ""
        self._offset = 0  # output offset of _buf[0]
        self._header: HarmonyHeader | None = None  # None: reading a header
        self._start = 0  # output offset where the current message began
        self.spans: list[MessageSpan] = []

    @property
    def current(self) -> HarmonyHeader | None:
        """The header of the message whose body is being read, None while in a header."""
        return self._header

    def _consume(self, n: int) -> None:
        self._buf = self._buf[n:]
        self._offset += n

    def feed(self, delta: str, finished: bool) -> list[HarmonyEvent]:
        self._buf += delta
        events: list[HarmonyEvent] = []
        while True:
            if self._header is None:
                at = self._buf.find(MESSAGE)
                if at == -1:
                    if finished and self._buf:
                        if not any(m in self._buf for m in MARKERS):
                            h = HarmonyHeader(None, None, None, None)
                            events += [HarmonyEvent("open", h), HarmonyEvent("text", h, self._buf)]
                            events.append(HarmonyEvent("close", h))
                            self.spans.append(MessageSpan(h, self._offset, self._offset + len(self._buf)))
                        self._consume(len(self._buf))
                    break
                head = self._buf[:at]
                head = head[head.rfind(START) + len(START) :] if START in head else head
                self._header = parse_header(head)
                self._start = self._offset
                self._consume(at + len(MESSAGE))
                events.append(HarmonyEvent("open", self._header))
                continue
            hits = [(i, m) for m in (*TERMINATORS, START) if (i := self._buf.find(m)) != -1]
            if hits:
                at, marker = min(hits)
                if at:
                    events.append(HarmonyEvent("text", self._header, self._buf[:at]))
                term = marker if marker != START else ""  # a new message without <|end|>: not consumed
                self._consume(at + len(term))
                events.append(HarmonyEvent("close", self._header, term))
                self.spans.append(MessageSpan(self._header, self._start, self._offset))
                self._header = None
                continue
            keep = 0 if finished else _held(self._buf)
            if len(self._buf) > keep:
                events.append(HarmonyEvent("text", self._header, self._buf[: len(self._buf) - keep]))
                self._consume(len(self._buf) - keep)
            if finished:
                events.append(HarmonyEvent("close", self._header))
                self.spans.append(MessageSpan(self._header, self._start, self._offset))
                self._header = None
            break
        return events


def tool_call_text(name: str) -> str:
    """The canonical opening of a call in the answer text (module docstring); the body and `<|call|>`
    follow."""
    return f"{CHANNEL}commentary to={FUNCTIONS}{name}{MESSAGE}"


class HarmonyReasoningStream:
    """ReasoningStream's interface over harmony: deltas -> (reasoning, answer) pieces."""

    def __init__(self) -> None:
        self.splitter = HarmonySplitter()
        self.reasoning_text = ""
        self.content_text = ""
        self.thought = False  # an analysis message was opened

    @property
    def in_reasoning(self) -> bool:
        h = self.splitter.current
        return h is not None and h.channel == "analysis"

    @property
    def ended(self) -> bool:
        return self.thought and not self.in_reasoning

    def split_so_far(self) -> HarmonySplit:
        return HarmonySplit(self.reasoning_text if self.thought else None, self.content_text or None)

    def feed(self, delta: str, finished: bool) -> tuple[str, str]:
        reasoning, content = "", ""
        for ev in self.splitter.feed(delta, finished):
            h, fn = ev.header, ev.header.function
            if h.channel == "analysis" and fn is None:
                if ev.kind == "open":
                    self.thought = True
                reasoning += ev.text if ev.kind == "text" else ""
            elif fn is not None:  # <|call|> only where the model wrote one: a cut call stays open
                content += {"open": tool_call_text(fn), "text": ev.text, "close": ev.text and CALL}[ev.kind]
            elif ev.kind == "text":
                content += ev.text
        self.reasoning_text += reasoning
        self.content_text += content
        return reasoning, content


@dataclass(frozen=True)
class HarmonySplit:
    """reasoning.ReasoningSplit's fields (reasoning.py imports this module, not the other way)."""

    reasoning: str | None
    content: str | None


def split_harmony(text: str) -> HarmonySplit:
    """A whole output's split (the stream's, fed at once)."""
    rs = HarmonyReasoningStream()
    rs.feed(text, True)
    return rs.split_so_far()


def count_harmony_reasoning_tokens(token_texts: list[str]) -> int:
    """Output tokens that belong to analysis messages (header, body and terminator): usage's
    reasoning_tokens."""
    splitter = HarmonySplitter()
    splitter.feed("".join(token_texts), True)
    spans = [(s.start, s.end) for s in splitter.spans if s.header.channel == "analysis"]
    count, pos = 0, 0
    for t in token_texts:
        if any(a <= pos < b for a, b in spans):
            count += 1
        pos += len(t)
    return count


_CALL_RE = re.compile(
    re.escape(CHANNEL) + r"[^<]*?to=functions\.([^\s<]+)[^<]*(?:" + re.escape(CONSTRAIN) + r"[^<]*)?"
    + re.escape(MESSAGE) + r"(.*?)(" + re.escape(CALL) + r"|\Z)",
    re.DOTALL,
)  # fmt: skip


class HarmonyToolParser:
    """`--tool-call-parser openai`: the answer text of `HarmonyReasoningStream` (plain content with
    calls in the canonical form) -> content + calls. Follows tool_parsers' rules: while streaming only
    closed calls and content before an open one; an unfinished last call is kept once named with the
    argument text so far; a closed call whose arguments are not a JSON object is dropped."""

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        content: list[str] = []
        calls: list[ParsedCall] = []
        pos = 0
        for m in _CALL_RE.finditer(text):
            content.append(text[pos : m.start()])
            pos = m.end()
            name, body, closed = m.group(1), m.group(2), bool(m.group(3))
            if closed:
                try:
                    args = json.loads(body)
                except json.JSONDecodeError:
                    continue
                if isinstance(args, dict):
                    calls.append(ParsedCall(name, json.dumps(args, ensure_ascii=False)))
            elif final:  # cut before <|call|>: a named call with the argument text so far
                calls.append(ParsedCall(name, body.strip()))
            else:
                pos = m.start()  # still being written: nothing of it (or after it) is known yet
                break
        rest = text[pos:]
        if not final:
            at = rest.find(CHANNEL)  # an opening whose header is not complete yet
            rest = rest[:at] if at != -1 else rest[: len(rest) - _held(rest)]
        content.append(rest)
        return ParsedToolOutput("".join(content), calls)
