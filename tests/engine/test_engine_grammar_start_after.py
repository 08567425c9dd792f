"""GrammarSpec.start_after (a reasoning model's `</think>`): the output is free until the marker
appears, then the grammar holds. Greedy: the prefix up to the marker equals the free run, and what
follows equals transformers' greedy generate with xgrammar's own HF logits processor continued from
the prompt plus that prefix; under preemption the same; a marker never written leaves the row free."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from engine_driver import run_staggered

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.request import GrammarSpec, SamplingParams

REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
MAX = 28


def _engine(folder: Path, **kw: object) -> LLMEngine:
    cache = kw.pop("cache", CacheConfig())
    return LLMEngine(EngineConfig(model=ModelConfig(model=str(folder), dtype="float32"), cache=cache, **kw))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tiny(tiny_model_factory) -> Path:  # type: ignore[no-untyped-def]
    return Path(tiny_model_factory("llama", tie=False))


def _hf_constrained(
    folder: Path, engine: LLMEngine, prompt: list[int], spec: GrammarSpec, n: int
) -> list[int]:
    import xgrammar.contrib.hf as xhf
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    proc = xhf.LogitsProcessor(engine.grammars.compile(spec))
    with torch.no_grad():
        ids = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            do_sample=False,
            logits_processor=[proc],
            eos_token_id=2,
            pad_token_id=2,
        )
    return [int(t) for t in ids[0, len(prompt) :].tolist()]


def test_grammar_starts_after_its_marker(tiny: Path) -> None:
    engine = _engine(tiny)
    prompt = engine.tokenizer.encode("The plan:")
    free = engine.generate([prompt], SamplingParams(max_tokens=MAX, temperature=0.0))[0]
    # The marker: a token the free run writes at position 3 for the first time (a stand-in for </think>).
    k = next(i for i in range(3, MAX) if free[i] not in free[:i])
    marker = (free[k],)
    spec = GrammarSpec("regex", REGEX, start_after=marker)
    params = SamplingParams(max_tokens=MAX, temperature=0.0, structured=spec)
    out = engine.generate([prompt], params)[0]
    assert out[: k + 1] == free[: k + 1]  # free until (and including) the marker
    answer = out[k + 1 :]
    assert re.fullmatch(REGEX, engine.tokenizer.decode(answer[:-1] if answer[-1] == 2 else answer))
    ref = _hf_constrained(
        tiny, engine, prompt + free[: k + 1], dataclasses.replace(spec, start_after=()), MAX - k - 1
    )
    assert answer == ref[: len(answer)] and ref[len(answer) :] in ([], [2])
    # The same under chunked prefill and preemption (the matcher is rebuilt from the output tokens).
    tight = _engine(tiny, cache=CacheConfig(block_size=4, num_kv_blocks=12), max_num_batched_tokens=8)
    got = run_staggered(tight, [prompt * 3] * 3, params)
    ref3 = engine.generate([prompt * 3] * 3, params)
    assert tight.stats().num_preemptions > 0 and got == ref3
    # A marker the output never holds: the row stays free, token for token.
    never = SamplingParams(
        max_tokens=MAX, temperature=0.0, structured=GrammarSpec("regex", REGEX, start_after=(1,))
    )
    assert engine.generate([prompt], never)[0] == free
    assert engine.stats().num_free_blocks == engine.info.num_kv_blocks
