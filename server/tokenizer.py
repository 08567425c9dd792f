"""Tokenizer wrapper, chat template, and the incremental detokenizer with stop-string hold-back."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.request import SamplingParams

# Tokens of prompt context decoded with the first output tokens, so that leading spaces and merged
# characters come out as they would in a full decode.
_PROMPT_CONTEXT = 5


class Tokenizer:
    def __init__(self, folder: Path | str, chat_template: str | None = None) -> None:
        """chat_template: Jinja text that replaces the model's own (--chat-template)."""
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(folder))
        if chat_template is not None:
            self._tok.chat_template = chat_template
        self.vocab_size = len(self._tok)
        self.all_special_ids = frozenset(self._tok.all_special_ids)

    @property
    def hf(self) -> Any:
        return self._tok

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self._tok.bos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(self._tok.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """The text a single token contributes (TGI's token.text)."""
        return str(self._tok.decode([token_id], skip_special_tokens=False))

    def offsets(self, text: str) -> list[tuple[int, str, int, int]]:
        """(id, text, start, stop) per token, for TGI's /tokenize."""
        enc = self._tok(text, return_offsets_mapping=True, add_special_tokens=True)
        out = []
        for tid, (start, stop) in zip(enc["input_ids"], enc["offset_mapping"], strict=True):
            out.append((int(tid), text[start:stop], int(start), int(stop)))
        return out

    @property
    def chat_template_knows_tools(self) -> bool:
        """Whether the template renders `tools` at all (a template that ignores them would drop them)."""
        template = self._tok.chat_template
        return isinstance(template, str) and "tools" in template

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        tool_list: list[Any] | None = list(tools) if tools else None
        text = self._tok.apply_chat_template(
            messages, tools=tool_list, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return self.encode(str(text), add_special_tokens=False)


def shipped_chat_template(name: str) -> str:
    """A chat template shipped in server/templates/ (e.g. "smollm2_tools")."""
    return (Path(__file__).parent / "templates" / f"{name}.jinja").read_text()


@dataclass
class DetokenizerUpdate:
    text: str  # newly released text
    stop_string: str | None  # the stop string that ended the request, if any


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas. Text that could still turn into a stop
    string is held back until it cannot, or until the request ends."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams) -> None:
        self._tok = tokenizer
        self._skip_special = params.skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stops = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.output_text = ""
        self._released = 0
        self.finished = False

    def _decode_delta(self) -> str:
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special)
        full = self._tok.decode(self._ids[self._prefix_offset :], self._skip_special)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(prefix) :]
        return ""

    def push(self, token_ids: list[int]) -> DetokenizerUpdate:
        if self.finished:
            return DetokenizerUpdate("", None)
        self._ids.extend(token_ids)
        delta = self._decode_delta()
        stop_hit: str | None = None
        if delta:
            search_from = max(0, len(self.output_text) - self._hold)
            self.output_text += delta
            if self._stops:
                best: tuple[int, str] | None = None
                for s in self._stops:
                    idx = self.output_text.find(s, search_from)
                    if idx != -1 and (best is None or idx < best[0]):
                        best = (idx, s)
                if best is not None:
                    idx, stop_hit = best
                    end = idx + len(stop_hit) if self._include_stop else idx
                    self.output_text = self.output_text[:end]
                    self.finished = True
        limit = (
            len(self.output_text)
            if self.finished
            else max(self._released, len(self.output_text) - self._hold)
        )
        return DetokenizerUpdate(self._release(limit), stop_hit)

    def flush(self) -> str:
        """Release everything held back (the request ended for another reason)."""
        self.finished = True
        return self._release(len(self.output_text))

    def _release(self, upto: int) -> str:
        out = self.output_text[self._released : upto]
        self._released = max(self._released, upto)
        return out
