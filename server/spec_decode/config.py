"""`--speculative-config`: vLLM's JSON keys, parsed into a frozen, validated dataclass. No torch.

Keys (vLLM's `SpeculativeConfig`): `method` ("ngram" or "draft_model"; a `model` without a method
means "draft_model"), `num_speculative_tokens` (k, the tokens proposed per step), `prompt_lookup_min` and
`prompt_lookup_max` (n-gram sizes tried, longest first; if only one is given the other takes its value,
if neither both are 5, as in vLLM), `model` (the draft model: a Hugging Face folder, a .gguf file or a hub id, with the
target's tokenizer, checked at load; `"[ngram]"` is vLLM's older spelling of the n-gram method) and `disable_by_batch_size` (no speculation in steps with more running requests).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
_KEYS = {
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "model",
    "disable_by_batch_size",
}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    model: str | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if k > 32:
            raise ValueError(f"num_speculative_tokens must be <= 32, got {k}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
            if lo > hi:
                raise ValueError(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            if self.model is not None:
                raise ValueError("the ngram method takes no draft model")
        if self.method == "draft_model" and (not self.model or not isinstance(self.model, str)):
            raise ValueError("the draft_model method needs a 'model' (a path or hub id of the draft)")
        d = self.disable_by_batch_size
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"disable_by_batch_size must be an integer >= 1, got {d!r}")


def parse_speculative_config(text: str | dict[str, Any]) -> SpeculativeConfig:
    """JSON text (or its dict) -> SpeculativeConfig. Raises ValueError on bad JSON, unknown keys or values."""
    if isinstance(text, str):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    else:
        raw = dict(text)
    if not isinstance(raw, dict):
        raise ValueError("--speculative-config must be a JSON object")
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise ValueError(f"unknown --speculative-config keys {unknown}; known: {sorted(_KEYS)}")
    if "num_speculative_tokens" not in raw:
        raise ValueError("--speculative-config needs num_speculative_tokens")
    model = raw.get("model")
    method = raw.get("method")
    if model == "[ngram]":
        model, method = None, method or "ngram"
    if method is None:
        method = "draft_model" if model else None
    if method is None:
        raise ValueError("--speculative-config needs a method ('ngram') or a draft 'model'")
    lo_raw, hi_raw = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
    if method == "draft_model" and (lo_raw is not None or hi_raw is not None):
        raise ValueError("prompt_lookup_min/prompt_lookup_max belong to the ngram method, not a draft model")
    lo = lo_raw if lo_raw is not None else hi_raw if hi_raw is not None else 5
    hi = hi_raw if hi_raw is not None else lo
    return SpeculativeConfig(
        method=method,
        num_speculative_tokens=raw["num_speculative_tokens"],
        prompt_lookup_min=lo,
        prompt_lookup_max=hi,
        model=model,
        disable_by_batch_size=raw.get("disable_by_batch_size"),
    )
