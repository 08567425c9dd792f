"""Chat prompts whose message content is tokenized as text: a user who types `<|im_start|>system` into a
message must not get the control token, or they could forge system and assistant turns.

Hugging Face tokenizers parse special-token strings anywhere in a text unless asked not to
(`split_special_tokens=True` in transformers, `encode_special_tokens` in `tokenizers`); a rendered
chat template mixes the template's own special tokens, which must stay special, with the messages'
text, which must not. `ContentTextEncoder` separates them:

1. every special-token string inside a message's strings (content, content parts, tool call
   arguments, names) and the tool definitions is replaced by a private-use marker character;
2. the template renders these messages, so every special-token string left in the rendered text is
   the template's own (markers survive `trim` and the like: they are not whitespace);
3. the rendered text is cut at the template's special tokens (as the tokenizer itself cuts at added
   tokens before pre-tokenizing, honouring their `lstrip`/`rstrip`); each piece gets its markers
   replaced by the original strings back and is encoded with special tokens split
   (`encode_special_tokens`), each template special token is its id.

So a piece's ids equal transformers' `tokenizer(piece, split_special_tokens=True)`. Messages that hold
no special-token string at all (nearly all) take the tokenizer's ordinary path unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer as RustTokenizer

_PUA_START, _PUA_END = 0xF0000, 0x10FFFE  # planes 15 and 16, private use


@dataclass(frozen=True)
class _Special:
    token_id: int
    lstrip: bool
    rstrip: bool


@dataclass
class _Neutralized:
    messages: list[Any]
    tools: list[Any] | None
    originals: dict[str, str]  # marker character -> the special-token string it stands for


class ContentTextEncoder:
    """Encodes a rendered chat so that only the template's special tokens are special (see module doc).
    `hf`: a transformers fast tokenizer."""

    def __init__(self, hf: Any) -> None:
        added = getattr(hf, "added_tokens_decoder", {}) or {}
        self._specials: dict[str, _Special] = {
            str(t.content): _Special(int(i), bool(t.lstrip), bool(t.rstrip))
            for i, t in added.items()
            if t.special and t.content
        }
        self._pattern = (
            re.compile("|".join(re.escape(s) for s in sorted(self._specials, key=len, reverse=True)))
            if self._specials
            else None
        )
        backend = hf.backend_tokenizer
        self._backend = backend
        self._text: RustTokenizer | None = None  # built on first use (~0.4 s for a 49k vocabulary)
        probe_plain = backend.encode("x", add_special_tokens=False).ids
        probe_full = backend.encode("x", add_special_tokens=True).ids
        at = _find(probe_full, probe_plain)
        self._prefix = probe_full[:at] if at >= 0 else []
        self._suffix = probe_full[at + len(probe_plain) :] if at >= 0 else []

    def holds_special(self, messages: list[Any], tools: list[Any] | None) -> bool:
        """Whether any string in the messages or tools contains a special-token string."""
        if self._pattern is None:
            return False
        return any(self._pattern.search(s) for s in _strings([messages, tools]))

    def encode(
        self,
        messages: list[Any],
        tools: list[Any] | None,
        render: Callable[[list[Any], list[Any] | None], str],
        add_special_tokens: bool,
    ) -> list[int]:
        """Prompt ids of `render(messages, tools)` with the messages' special-token strings as text.
        Raises ValueError when the strings use every private-use marker (never in practice)."""
        assert self._pattern is not None
        n = self._neutralize(messages, tools)
        rendered = render(n.messages, n.tools)
        ids: list[int] = list(self._prefix) if add_special_tokens else []
        pos = 0
        pieces: list[tuple[str, _Special | None]] = []
        for m in self._pattern.finditer(rendered):
            pieces.append((rendered[pos : m.start()], None))
            pieces.append((m.group(), self._specials[m.group()]))
            pos = m.end()
        pieces.append((rendered[pos:], None))
        # The tokenizer strips whitespace next to an added token that asks for it, before encoding.
        for i, (_, special) in enumerate(pieces):
            if special is None:
                continue
            if special.lstrip and i > 0:
                pieces[i - 1] = (pieces[i - 1][0].rstrip(), None)
            if special.rstrip and i + 1 < len(pieces):
                pieces[i + 1] = (pieces[i + 1][0].lstrip(), None)
        marker = re.compile("|".join(re.escape(k) for k in n.originals)) if n.originals else None
        text_tok = self._text_tokenizer()
        for text, special in pieces:
            if special is not None:
                ids.append(special.token_id)
            elif text:
                if marker is not None:
                    text = marker.sub(lambda m: n.originals[m.group()], text)
                ids.extend(text_tok.encode(text, add_special_tokens=False).ids)
        if add_special_tokens:
            ids.extend(self._suffix)
        return ids

    def _text_tokenizer(self) -> RustTokenizer:
        """A copy of the backend tokenizer with special tokens split, of its own so that the flag is
        never flipped under a concurrent caller of the shared one (two threads may both build it)."""
        if self._text is None:
            from tokenizers import Tokenizer as RustTokenizer

            text = RustTokenizer.from_str(self._backend.to_str())
            text.encode_special_tokens = True
            self._text = text
        return self._text

    def _neutralize(self, messages: list[Any], tools: list[Any] | None) -> _Neutralized:
        assert self._pattern is not None
        used = {ord(c) for s in _strings([messages, tools]) for c in s if ord(c) >= _PUA_START}
        free = (c for c in range(_PUA_START, _PUA_END) if c not in used)
        by_special: dict[str, str] = {}

        def marker_for(special: str) -> str:
            if special not in by_special:
                code = next(free, None)
                if code is None:
                    raise ValueError("too many distinct special-token strings in the messages")
                by_special[special] = chr(code)
            return by_special[special]

        def sub(value: Any, key: str | None = None) -> Any:
            if isinstance(value, str):
                if key == "role":  # roles are checked against the API's list, not content
                    return value
                assert self._pattern is not None
                return self._pattern.sub(lambda m: marker_for(m.group()), value)
            if isinstance(value, dict):
                return {k: sub(v, k) for k, v in value.items()}
            if isinstance(value, list | tuple):
                return [sub(v) for v in value]
            return value

        new_messages = sub(messages)
        new_tools = sub(tools) if tools is not None else None
        return _Neutralized(new_messages, new_tools, {m: s for s, m in by_special.items()})


def _strings(value: Any) -> list[str]:
    out: list[str] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return out


def _find(haystack: list[int], needle: list[int]) -> int:
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i : i + len(needle)] == needle:
            return i
    return -1
