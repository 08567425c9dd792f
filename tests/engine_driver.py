"""Drives an LLMEngine in tests the way live traffic would: requests arriving at different steps."""

from __future__ import annotations

from server.engine import LLMEngine
from server.request import SamplingParams

# The files that make a model folder's tokenizer (copied next to tiny random models' weights).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def run_staggered(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Request i arrives before step i, so prefills and decodes share steps; returns each one's tokens."""
    got: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        if pending:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, params)
            got[f"r{i}"] = []
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
    return [got[f"r{i}"] for i in range(len(prompts))]
