"""Tokenizer wrapper, chat template, and the incremental detokenizer with stop-string hold-back."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.chat_tokens import ContentTextEncoder
from server.core.finish import stops_count
from server.request import SamplingParams

# Tokens of prompt context decoded with the first output tokens, so that leading spaces and merged
# characters come out as they would in a full decode.
_PROMPT_CONTEXT = 5
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, reversed: each printable stand-in character -> its byte
    (the `bytes_to_unicode` table of openai/gpt-2's encoder.py, used by Hugging Face ByteLevel)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table: dict[str, int] = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = _byte_level_decoder()


def load_hf_tokenizer(folder: Path) -> Any:
    """transformers' `AutoTokenizer.from_pretrained(folder)`, without importing the model's config class
    where tokenizer_config.json names the tokenizer class (and neither file asks for remote code).

    AutoTokenizer reads config.json through AutoConfig, which imports the model's configuration module,
    and Llama's (model_type llama: Llama 2/3, SmolLM2, their fine-tunes and embedders; a few others in
    transformers 5.23) imports transformers.activations and through its hub-kernel integration
    torch._dynamo (with sympy, torch._inductor and triton where installed: 70-144
    MiB of resident memory a server never uses; tests/models/test_loader_imports.py). Given a config,
    AutoTokenizer reads only its model_type, name and tokenizer_class to pick the class (transformers
    5.23, models/auto/tokenization_auto.py), and the class is named: so it gets transformers' base
    PreTrainedConfig carrying those three, and picks the same class."""
    import json

    from transformers import AutoTokenizer, PreTrainedConfig

    try:
        model_cfg = json.loads((folder / "config.json").read_text())
        tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return AutoTokenizer.from_pretrained(str(folder))
    if (
        not isinstance(model_cfg, dict)
        or not isinstance(tok_cfg, dict)
        or not tok_cfg.get("tokenizer_class")
        or "auto_map" in model_cfg
        or "auto_map" in tok_cfg
    ):
        return AutoTokenizer.from_pretrained(str(folder))
    base: Any = PreTrainedConfig  # its **kwargs become attributes; model_type is a class attribute there
    config = base(name_or_path=str(folder), tokenizer_class=model_cfg.get("tokenizer_class"))
    config.model_type = str(model_cfg.get("model_type", ""))
    return AutoTokenizer.from_pretrained(str(folder), config=config)


class Tokenizer:
    def __init__(
        self,
        folder: Path | str,
        chat_template: str | None = None,
        special_tokens_in_content: bool = False,
        hf: Any = None,
    ) -> None:
        """chat_template: Jinja text that replaces the model's own (--chat-template).
        special_tokens_in_content: parse special-token strings inside chat messages as control tokens
        (--allow-special-tokens-in-content); by default they are text (server/chat_tokens.py).
        hf: an already loaded transformers tokenizer to wrap (a pooling model's) instead of loading
        `folder`'s."""
        self._tok = hf if hf is not None else load_hf_tokenizer(Path(folder))
        if chat_template is not None:
            self._tok.chat_template = chat_template
        self._content_text: ContentTextEncoder | None = None
        if not special_tokens_in_content and getattr(self._tok, "backend_tokenizer", None) is not None:
            self._content_text = ContentTextEncoder(self._tok)
        self.vocab_size = len(self._tok)
        self.all_special_ids = frozenset(self._tok.all_special_ids)
        self._added_ids = frozenset(getattr(self._tok, "added_tokens_decoder", {}) or ())
        backend = getattr(self._tok, "backend_tokenizer", None)
        self._byte_level = backend is not None and "ByteLevel" in repr(backend.decoder)
        self._bytes_cache: dict[int, bytes] = {}

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

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a single token stands for, so that the bytes of consecutive output tokens join
        to the UTF-8 of the output text, also when a token holds only part of a character (OpenAI's
        logprob `bytes`). Byte-level BPE (GPT-2 alphabet) and SentencePiece pieces (`<0xNN>` byte
        fallback, U+2581 for a space) map exactly; added/special tokens give their text's UTF-8.
        A SentencePiece tokenizer's decode drops the first token's leading space; the bytes keep it."""
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        if token_id in self._added_ids or token_id in self.all_special_ids:
            out = self.token_text(token_id).encode()
        else:
            piece = str(self._tok.convert_ids_to_tokens(token_id))
            m = _BYTE_PIECE.fullmatch(piece)
            if self._byte_level and all(c in _BYTE_LEVEL for c in piece):
                out = bytes(_BYTE_LEVEL[c] for c in piece)
            elif m is not None:
                out = bytes([int(m.group(1), 16)])
            elif not self._byte_level:
                out = piece.replace("\u2581", " ").encode()
            else:
                out = self.token_text(token_id).encode()
        self._bytes_cache[token_id] = out
        return out

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

    def chat_template_mentions(self, name: str) -> bool:
        """Whether the chat template reads a variable of this name at all (e.g. reasoning_effort)."""
        template = self._tok.chat_template
        return isinstance(template, str) and name in template

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Prompt ids for a conversation. template_kwargs: extra variables for the template (vLLM's
        chat_template_kwargs, e.g. enable_thinking; reasoning_effort). continue_final_message: leave the last (assistant) message
        open, without its end-of-turn tokens, so that the model continues it (vLLM's flag).
        add_special_tokens: also add the tokenizer's own BOS/EOS around the templated text (off by
        default: templates write their special tokens themselves).
        Special-token strings inside the messages and tools are encoded as text unless the tokenizer
        was built with special_tokens_in_content (server/chat_tokens.py)."""
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        tool_list: list[Any] | None = list(tools) if tools else None

        def render(msgs: list[Any], tool_defs: list[Any] | None) -> str:
            return str(
                self._tok.apply_chat_template(
                    msgs,
                    tools=tool_defs,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    **(template_kwargs or {}),
                )
            )

        content = self._content_text
        if content is not None and content.holds_special(messages, tool_list):
            return content.encode(messages, tool_list, render, add_special_tokens)
        return self.encode(render(messages, tool_list), add_special_tokens=add_special_tokens)


def shipped_chat_template(name: str) -> str:
    """A chat template shipped in server/templates/ (e.g. "smollm2_tools")."""
    return (Path(__file__).parent / "templates" / f"{name}.jinja").read_text()


@dataclass
class DetokenizerUpdate:
    """What one push released.

    text: newly released output text (held back while it may still become a stop string).
    stop_string: the stop string that ended the request, if any.
    stop_index: index into the pushed ids of the token whose text completed `stop_string`.
    token_texts: each pushed token's own text (TGI's token.text), one per pushed id: the decode
        delta of that token alone, "" while it holds an incomplete UTF-8 character (the token that
        completes the character carries it). Independent of stop strings and hold-back.
    """

    text: str
    stop_string: str | None
    stop_index: int | None = None
    token_texts: list[str] = field(default_factory=list)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas. Text that could still turn into a stop
    string is held back until it cannot, or until the request ends.

    Stop strings are looked for only in text completed by output tokens past `min_tokens` (the rule
    of server.core.finish.stops_count); the stop string is cut from the output unless
    `include_stop_str_in_output`."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams) -> None:
        self._tok = tokenizer
        self._params = params
        self._skip_special = params.skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stops = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.output_text = ""
        self._released = 0
        self._num_output = 0
        self.finished = False

    def _decode_delta(self) -> str:
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special)
        full = self._tok.decode(self._ids[self._prefix_offset :], self._skip_special)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(prefix) :]
        return ""

    def push(self, token_ids: list[int], drop_last: bool = False) -> DetokenizerUpdate:
        """Adds output tokens. drop_last: the last token ended the request by itself (EOS or a stop
        token id) and its text stays out of the output (its own text is still reported)."""
        if self.finished:
            return DetokenizerUpdate("", None, None, ["" for _ in token_ids])
        token_texts: list[str] = []
        stop_hit: str | None = None
        stop_index: int | None = None
        for i, tid in enumerate(token_ids):
            self._ids.append(tid)
            self._num_output += 1
            delta = self._decode_delta()
            token_texts.append(delta)
            if self.finished or (drop_last and i == len(token_ids) - 1) or not delta:
                continue
            search_from = max(0, len(self.output_text) - self._hold)
            self.output_text += delta
            if self._stops and stops_count(self._params, self._num_output):
                best: tuple[int, str] | None = None
                for s in self._stops:
                    idx = self.output_text.find(s, search_from)
                    if idx != -1 and (best is None or idx < best[0]):
                        best = (idx, s)
                if best is not None:
                    idx, stop_hit = best
                    stop_index = i
                    end = idx + len(stop_hit) if self._include_stop else idx
                    self.output_text = self.output_text[:end]
                    self.finished = True
        limit = (
            len(self.output_text)
            if self.finished
            else max(self._released, len(self.output_text) - self._hold)
        )
        return DetokenizerUpdate(self._release(limit), stop_hit, stop_index, token_texts)

    def flush(self) -> str:
        """Release everything held back (the request ended for another reason)."""
        self.finished = True
        return self._release(len(self.output_text))

    def _release(self, upto: int) -> str:
        out = self.output_text[self._released : upto]
        self._released = max(self._released, upto)
        return out
