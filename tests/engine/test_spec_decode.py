"""Speculative decoding through the engine on a tiny random model: greedy outputs identical to plain
decoding (k in {1, 3, 5}, staggered batches, prefix caching, n > 1, forced preemption, stop strings and
stop tokens inside an accepted run), no KV leaks (also on aborts mid-speculation), and sampled rows
distributed exactly as the target (chi-square tests that catch a biased acceptance rule)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from engine_driver import run_staggered
from spec_checks import (
    assert_no_kv_held,
    chi_square_p,
    collect,
    distribution_prompt,
    joint_counts,
    spec_engine,
    two_sample_p,
)

import server.spec_decode.rejection_sampler as rs
from server.config import EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.request import Request, SamplingParams
from server.spec_decode.config import SpeculativeConfig

TEXTS = [
    "one two three four one two three four one two",
    "The cat sat on the mat. The cat sat on the",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "hello",
    "a b c d e f a b c",
    "Rain, rain, go away; come again another day. Rain, rain,",
]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
ALPHA = 0.001  # significance level of the distribution tests


def make_engine(folder: Path, k: int | None = None, blocks: int = 256, **kw: object) -> LLMEngine:
    spec = SpeculativeConfig("ngram", k, prompt_lookup_min=1, prompt_lookup_max=3) if k else None
    return spec_engine(folder, spec, blocks, **kw)


@pytest.fixture(scope="module")
def folder(tiny_model_factory) -> Path:  # type: ignore[no-untyped-def]
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def base(folder: Path) -> tuple[LLMEngine, list[list[int]], list[list[int]]]:
    engine = make_engine(folder)
    prompts = [engine.tokenizer.encode(t) for t in TEXTS]
    return engine, prompts, run_staggered(engine, prompts, GREEDY)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_parity_staggered(folder: Path, base, k: int) -> None:  # type: ignore[no-untyped-def]
    _, prompts, ref = base
    engine = make_engine(folder, k)
    assert run_staggered(engine, prompts, GREEDY) == ref
    st = engine.stats()
    # Both outcomes happened: drafts accepted and drafts rejected, in batches with prefill rows.
    assert st.spec_num_drafts > 10
    assert 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens
    assert sum(st.spec_accepted_per_pos) == st.spec_num_accepted_tokens and len(st.spec_accepted_per_pos) == k
    # Every verified row emits its accepted drafts plus one token: fewer steps than tokens.
    assert st.num_generation_tokens == sum(len(r) for r in ref)
    assert_no_kv_held(engine)


def test_greedy_parity_prefix_caching_and_n_copies(folder: Path, base) -> None:  # type: ignore[no-untyped-def]
    _, prompts, ref = base
    engine = make_engine(folder, 3)
    # n > 1: three copies of each prompt in one batch share their prompt's cached blocks
    outs = engine.generate([p for p in prompts[:3] for _ in range(3)], GREEDY)
    assert outs == [r for r in ref[:3] for _ in range(3)]
    hits = engine.stats().prefix_cache_hits
    assert hits > 0
    # the same prompts again, one by one: found in the cache, blocks that held drafts were never hashed
    assert [engine.generate([p], GREEDY)[0] for p in prompts] == ref
    assert engine.stats().prefix_cache_hits > hits
    assert engine.stats().spec_num_accepted_tokens > 0
    assert_no_kv_held(engine)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_parity_under_forced_preemption(folder: Path, base, k: int) -> None:  # type: ignore[no-untyped-def]
    _, prompts, ref = base
    # 24 blocks of 4 tokens cannot hold 6 sequences of up to ~60 tokens; an 8-token budget chunks prompts.
    engine = make_engine(folder, k, blocks=24, caching=False, max_num_batched_tokens=8)
    assert run_staggered(engine, prompts, GREEDY) == ref
    st = engine.stats()
    assert st.num_preemptions > 0 and st.spec_num_accepted_tokens > 0
    assert_no_kv_held(engine)


def test_stop_strings_and_stop_tokens_inside_accepted_runs(folder: Path, base) -> None:  # type: ignore[no-untyped-def]
    plain, prompts, ref = base
    engine = make_engine(folder, 5)
    cut_inside_run = 0
    original = engine.scheduler.discard_output_tail

    def counting(req: Request, n: int) -> None:
        nonlocal cut_inside_run
        cut_inside_run += n > 0
        original(req, n)

    engine.scheduler.discard_output_tail = counting  # type: ignore[method-assign]
    cases = 0
    for prompt, out in zip(prompts, ref, strict=True):
        text = plain.tokenizer.decode(out, True)
        # The output's own first m characters first occur ending at character m: a stop string that
        # ends at every position of the output, inside accepted runs and at their ends.
        for m in range(3, min(len(text), 100), 11):
            params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, stop=(text[:m], "\x00"))
            want = collect(plain, prompt, params)
            got = collect(engine, prompt, params)
            assert got == want
            cases += 1
        # a stop token id (the EOS path of _check_stop) at each later position of the greedy output
        for tok in sorted(set(out[3:]))[:4]:
            params = SamplingParams(max_tokens=32, temperature=0.0, stop_token_ids=(tok,))
            assert collect(engine, prompt, params) == collect(plain, prompt, params)
    assert cases > 20 and cut_inside_run > 0
    assert_no_kv_held(engine)


def test_abort_mid_speculation_leaks_no_blocks(folder: Path, base) -> None:  # type: ignore[no-untyped-def]
    _, prompts, _ = base
    engine = make_engine(folder, 5)
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, GREEDY)
    speculated = 0
    for _ in range(6):
        engine.step()
        speculated += sum(bool(r.spec_token_ids) for r in engine.scheduler.running)
    assert speculated > 0
    # abort while drafts are proposed and their slots about to be taken: half before the step,
    # half after scheduling (aborted while the step runs)
    for i in range(0, len(prompts), 2):
        engine.abort_request(f"a{i}")
    sched = engine.scheduler.schedule()
    assert any(item.spec_token_ids for item in sched.scheduled)
    for i in range(1, len(prompts), 2):
        engine.abort_request(f"a{i}")
    engine.scheduler.update_from_output(sched, engine.runner.execute(sched))
    assert_no_kv_held(engine)
    engine.step()  # the worker drops the finished ids


def test_seeded_sampling_is_reproducible_with_speculation(folder: Path, base) -> None:  # type: ignore[no-untyped-def]
    _, prompts, _ = base
    engine = make_engine(folder, 3)
    params = SamplingParams(max_tokens=24, temperature=0.8, top_k=20, seed=7, ignore_eos=True)
    alone = engine.generate([prompts[0]], params)[0]
    noisy = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)
    mixed = engine.generate([prompts[1], prompts[0], prompts[2]], [noisy, params, noisy])[1]
    assert mixed == alone and engine.stats().spec_num_drafts > 0
    assert_no_kv_held(engine)


# ---- distribution ------------------------------------------------------------------------------


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:  # [V] -> [V]
    # Reference written out here (not the sampler's helpers): temperature, then top-k, then top-p.
    x = logits / params.temperature
    kth = torch.topk(x, params.top_k).values[-1]
    x = x.masked_fill(x < kth, float("-inf"))
    p = x.softmax(-1)
    sp, idx = p.sort(descending=True)
    keep = sp.cumsum(-1) - sp < params.top_p
    p = torch.zeros_like(p).scatter_(0, idx, sp * keep)
    return p / p.sum()


def draws(n: int, draft: list[int], logits: torch.Tensor, params: SamplingParams) -> list[list[int]]:
    out = []
    for seed in range(n):
        req = Request("d", [1, 2, 3], SamplingParams(**{**params.__dict__, "seed": seed}))
        out.append(rs.verify_drafts(logits, req, draft))
    return out


@pytest.fixture(scope="module")
def fixed_logits() -> torch.Tensor:  # [3, V]: the target's logits at three positions
    g = torch.Generator().manual_seed(3)
    return torch.randn(3, 12, generator=g) * 1.5


SAMPLED = SamplingParams(max_tokens=8, temperature=0.9, top_k=8, top_p=0.95)


def test_rejection_sampler_matches_the_target_distribution(fixed_logits: torch.Tensor) -> None:
    p0, p1 = (target_probs(fixed_logits[j], SAMPLED) for j in range(2))
    # drafts: a likely token then an unlikely one, so both acceptance and rejection are frequent
    draft = [int(p0.argmax()), int(p1.argsort()[-4])]
    samples = draws(6000, draft, fixed_logits, SAMPLED)
    first = Counter(s[0] for s in samples)
    # the second token only follows an accepted first draft; given that, it is distributed as p1
    second = Counter(s[1] for s in samples if s[0] == draft[0])
    assert 0.2 < first[draft[0]] / len(samples) < 0.95
    assert chi_square_p(first, p0) > ALPHA
    assert chi_square_p(second, p1) > ALPHA
    assert all(len(s) >= 1 and len(s) <= 3 for s in samples)


def test_chi_square_catches_a_biased_acceptance_rule(fixed_logits: torch.Tensor, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    p0 = target_probs(fixed_logits[0], SAMPLED)
    draft = [int(p0.argsort()[-2])]
    # A classic bug: on rejection resample from p itself instead of (p - q)+, over-weighting the draft.
    monkeypatch.setattr(rs, "_residual", lambda probs, x: probs.clone())
    biased = Counter(s[0] for s in draws(6000, draft, fixed_logits[:2], SAMPLED))
    assert chi_square_p(biased, p0) < ALPHA


@pytest.fixture(scope="module")
def plain_distribution(folder: Path) -> tuple[list[int], Counter[tuple[int, ...]]]:
    """The prompt and the plain engine's joint distribution of its first sampled tokens."""
    plain = make_engine(folder, max_num_seqs=128)
    prompt = distribution_prompt(plain)
    return prompt, joint_counts(plain, prompt, N_DIST)


N_DIST = 1200  # seeds per engine in the engine-level distribution tests


@pytest.mark.slow
def test_engine_sampled_distribution_matches_plain_decoding(folder: Path) -> None:
    """Joint distribution of the first four sampled tokens over many seeds, speculation on vs off,
    on the tiny model (penalties and min-p on): a two-sample chi-square test. (The engine-level test
    that a biased acceptance rule fails is in test_spec_decode_draft.py.)"""
    plain, spec = make_engine(folder, max_num_seqs=128), make_engine(folder, 3, max_num_seqs=128)
    prompt = distribution_prompt(plain)
    n = 1200
    a, b = joint_counts(plain, prompt, n), joint_counts(spec, prompt, n)
    st = spec.stats()
    assert st.spec_num_drafts > n // 2 and 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens
    assert two_sample_p(a, b) > ALPHA
    assert_no_kv_held(spec)


@pytest.mark.slow
def test_smollm2_greedy_parity_on_an_editing_workload(smollm2_dir: Path) -> None:
    """The real model copying a given text: long accepted runs, output identical to plain greedy."""
    text = (
        "The old lighthouse stood on the northern cliff for more than a century. Every night its keeper "
        "climbed the spiral stairs, trimmed the wick and polished the great lens until it shone."
    )
    plain = LLMEngine(EngineConfig(model=ModelConfig(model=str(smollm2_dir), dtype="float32")))
    spec = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(smollm2_dir), dtype="float32"),
            speculative=SpeculativeConfig("ngram", 5, prompt_lookup_min=1, prompt_lookup_max=3),
        )
    )
    tok = plain.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}]),
        tok.encode(
            "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
        ),
    ]
    params = SamplingParams(max_tokens=40, temperature=0.0)
    assert run_staggered(spec, prompts, params) == run_staggered(plain, prompts, params)
    st = spec.stats()
    assert st.spec_num_accepted_tokens / st.spec_num_draft_tokens > 0.25  # measured 0.38
    assert_no_kv_held(spec)
