"""Grammar-constrained decoding in the engine: greedy constrained outputs equal transformers' greedy
generate with xgrammar's own HF logits processor (an independent path: HF forward + xgrammar's matcher),
in mixed batches with free rows (whose outputs stay unchanged), under chunked prefill and preemption;
sampled outputs always match; a failing grammar state fails its request alone."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from engine_driver import run_staggered

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.request import FinishReason, GrammarSpec, SamplingParams

PROMPTS = ["Contact:", "The answer is", "def f(x):", "Email me at"]
EMAIL = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
SPECS = [
    GrammarSpec("regex", EMAIL),
    GrammarSpec("json", json.dumps(SCHEMA)),
    GrammarSpec("choice", '["red", "green"]'),
]
MAX = 24


def _engine(folder: Path, **kw: object) -> LLMEngine:
    cache = kw.pop("cache", CacheConfig())
    return LLMEngine(EngineConfig(model=ModelConfig(model=str(folder), dtype="float32"), cache=cache, **kw))  # type: ignore[arg-type]


def _hf_constrained(folder: Path, engine: LLMEngine, prompt: list[int], spec: GrammarSpec) -> list[int]:
    import xgrammar.contrib.hf as xhf
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    proc = xhf.LogitsProcessor(engine.grammars.compile(spec))
    with torch.no_grad():
        ids = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX,
            do_sample=False,
            logits_processor=[proc],
            eos_token_id=2,
            pad_token_id=2,
        )
    return [int(t) for t in ids[0, len(prompt) :].tolist()]


@pytest.fixture(scope="module")
def tiny(tiny_model_factory) -> Path:  # type: ignore[no-untyped-def]
    return Path(tiny_model_factory("llama", tie=False))


def _check_valid(engine: LLMEngine, spec: GrammarSpec, tokens: list[int]) -> None:
    text = engine.tokenizer.decode(tokens)
    if spec.kind == "regex":
        assert re.fullmatch(EMAIL, text), text
    elif spec.kind == "choice":
        assert text in ("red", "green"), text
    else:
        obj = json.loads(text)
        assert set(obj) == {"ok", "n"} and isinstance(obj["ok"], bool) and 0 <= obj["n"] <= 9


def test_constrained_greedy_matches_hf_with_xgrammar_mixed_batch(tiny: Path) -> None:
    engine = _engine(tiny)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    free = SamplingParams(max_tokens=MAX, temperature=0.0)
    free_ref = engine.generate(prompts, free)
    params = [SamplingParams(max_tokens=MAX, temperature=0.0, structured=s) for s in SPECS] + [free]
    outs = engine.generate(prompts, params)
    assert outs[3] == free_ref[3]  # the free row is unchanged by its constrained neighbours
    for spec, prompt, out in zip(SPECS, prompts, outs, strict=False):
        ref = _hf_constrained(tiny, engine, prompt, spec)
        assert out == ref[: len(out)] and ref[len(out) :] in ([], [2])  # HF keeps the EOS token
        _check_valid(engine, spec, out[:-1] if out and out[-1] == 2 else out)
    assert engine.stats().num_free_blocks == engine.info.num_kv_blocks


def test_constrained_under_chunked_prefill_and_preemption(tiny: Path) -> None:
    base = _engine(tiny)
    prompts = [base.tokenizer.encode(p * 3) for p in PROMPTS]
    params = SamplingParams(max_tokens=MAX, temperature=0.0, structured=SPECS[0])
    ref = base.generate(prompts, params)
    tight = _engine(tiny, cache=CacheConfig(block_size=4, num_kv_blocks=14), max_num_batched_tokens=8)
    got = run_staggered(tight, prompts, params)
    assert tight.stats().num_preemptions > 0
    assert got == ref
    for out in got:
        _check_valid(tight, SPECS[0], out[:-1] if out[-1] == 2 else out)
    assert tight.stats().num_free_blocks == 14


def test_sampled_outputs_always_valid_and_stop_length(tiny: Path) -> None:
    engine = _engine(tiny)
    prompt = engine.tokenizer.encode("Data:")
    for spec in SPECS:
        params = [SamplingParams(max_tokens=MAX, temperature=1.0, seed=s, structured=spec) for s in range(12)]
        for out in engine.generate([prompt] * len(params), params):
            assert out[-1] == 2  # the grammar completed, then only EOS was allowed
            _check_valid(engine, spec, out[:-1])
    # Cut by max_tokens: the request ends (finish reason length) with a valid prefix.
    engine.add_request("short", prompt, SamplingParams(max_tokens=2, temperature=0.0, structured=SPECS[1]))
    reasons = []
    while engine.has_unfinished():
        reasons += [o.finish_reason for o in engine.step() if o.finished]
    assert reasons == [FinishReason.LENGTH]


def test_grammar_failure_fails_only_that_request(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(tiny)
    prompt = engine.tokenizer.encode("Hi")
    manager = engine.runner.structured
    assert manager is not None
    original = manager._state

    def broken(req):  # type: ignore[no-untyped-def]
        if req.request_id == "bad" and req.output_token_ids:
            raise RuntimeError("injected matcher fault")
        return original(req)

    monkeypatch.setattr(manager, "_state", broken)
    engine.add_request("bad", prompt, SamplingParams(max_tokens=MAX, temperature=0.0, structured=SPECS[1]))
    engine.add_request("good", prompt, SamplingParams(max_tokens=MAX, temperature=0.0, structured=SPECS[1]))
    engine.add_request("free", prompt, SamplingParams(max_tokens=4, temperature=0.0))
    final = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
    assert final["bad"].finish_reason is FinishReason.ERROR and "injected" in (final["bad"].error or "")
    assert final["good"].finish_reason is FinishReason.STOP
    assert final["free"].finish_reason is FinishReason.LENGTH
    engine.step()  # the scheduler hands finished ids to the worker with the next step
    assert manager.num_active == 0 and engine.stats().num_free_blocks == engine.info.num_kv_blocks


def test_compile_cache_and_errors(tiny: Path) -> None:
    from server.structured import GrammarError

    engine = _engine(tiny)
    spec = GrammarSpec("json", json.dumps(SCHEMA))
    assert engine.grammars.compile(spec) is engine.grammars.compile(GrammarSpec("json", json.dumps(SCHEMA)))
    for bad, fragment in [
        (GrammarSpec("regex", "a(b"), "parenthesis"),
        (GrammarSpec("json", '{"type": "foo"}'), "foo"),
        (GrammarSpec("grammar", "root ::= "), "grammar"),
        (GrammarSpec("choice", "[]"), "choice"),
    ]:
        with pytest.raises(GrammarError, match=fragment):
            engine.grammars.compile(bad)
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(structured=spec, ignore_eos=True)
