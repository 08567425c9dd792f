"""Checks shared by the speculative-decoding tests: KV blocks all returned (target and draft caches),
one request's tokens/text/finish collected, and the engine-level two-sample chi-square test."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from scipy.stats import chi2, chi2_contingency

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.request import SamplingParams
from server.spec_decode.config import SpeculativeConfig


def spec_engine(folder: Path, spec: SpeculativeConfig | None, blocks: int = 256, **kw: object) -> LLMEngine:
    """An fp32 engine over `folder` with speculation `spec` (None: plain decoding), 4-token blocks and
    prefix caching (`caching=False` turns it off); other `kw` go to EngineConfig."""
    caching = bool(kw.pop("caching", True))
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(folder), dtype="float32"),
            cache=CacheConfig(block_size=4, num_kv_blocks=blocks, enable_prefix_caching=caching),
            speculative=spec,
            **kw,  # type: ignore[arg-type]
        )
    )


def assert_no_kv_held(engine: LLMEngine) -> None:
    """No request left, every target block free and, with a draft model, every draft block free."""
    assert not engine.has_unfinished()
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    assert not engine.kv.req_to_blocks
    draft = getattr(engine.speculator, "proposer", None)
    pool = getattr(draft, "pool", None)
    if pool is not None:
        assert pool.num_free_blocks == pool.num_blocks
        assert not draft._states  # type: ignore[union-attr]


def collect(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple:
    """(tokens, text, finish_reason, stop_reason) of one request run alone to its end."""
    engine.add_request("x", prompt, params)
    tokens: list[int] = []
    text = ""
    last = None
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.new_token_ids
            text += o.text
            last = o
    assert last is not None and last.finished
    assert last.num_output_tokens == len(tokens)
    return tokens, text, last.finish_reason, last.stop_reason


# A sampled request with temperature, top-k, min-p and a repetition penalty: every step of the
# rejection sampler's processing is exercised.
DIST_PARAMS = dict(
    max_tokens=4, temperature=0.7, top_k=4, min_p=0.05, repetition_penalty=1.1, ignore_eos=True
)


def distribution_prompt(plain: LLMEngine) -> list[int]:
    """The model's own greedy continuation of a short text, so n-gram lookup finds something."""
    seed_text = plain.tokenizer.encode("a b a b")
    return seed_text + plain.generate([seed_text], SamplingParams(max_tokens=8, temperature=0.0))[0]


def joint_counts(engine: LLMEngine, prompt: list[int], n: int) -> Counter[tuple[int, ...]]:
    """The first max_tokens sampled tokens of n requests with seeds 0..n-1, as a histogram."""
    plist = [SamplingParams(**DIST_PARAMS, seed=s) for s in range(n)]  # type: ignore[arg-type]
    return Counter(map(tuple, engine.generate([prompt] * n, plist)))


def two_sample_p(a: Counter[tuple[int, ...]], b: Counter[tuple[int, ...]]) -> float:
    """p-value of a chi-square test that a and b come from one distribution; outcomes seen fewer than
    10 times in both samples together are pooled."""
    na, nb = sum(a.values()), sum(b.values())
    keys = [k for k in a.keys() | b.keys() if a[k] + b[k] >= 10]
    assert len(keys) >= 4, "too few frequent outcomes for the test to mean anything"
    table = [[a[k] for k in keys], [b[k] for k in keys]]
    rest = [na - sum(table[0]), nb - sum(table[1])]
    if sum(rest) >= 10:
        table[0].append(rest[0])
        table[1].append(rest[1])
    return float(chi2_contingency(table)[1])


def chi_square_p(counts: Counter[int], probs: torch.Tensor) -> float:  # probs: [V]
    """Goodness of fit of observed token counts to probs; categories expecting < 5 are pooled."""
    n = sum(counts.values())
    expected = (probs * n).tolist()
    big = [t for t, e in enumerate(expected) if e >= 5]
    obs = [counts.get(t, 0) for t in big]
    exp = [expected[t] for t in big]
    rest_obs, rest_exp = n - sum(obs), n - sum(exp)
    if rest_exp >= 5:
        obs.append(rest_obs)
        exp.append(rest_exp)
    elif rest_obs > 0:
        return 0.0  # tokens the target gives (almost) no mass to
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    return float(chi2.sf(stat, len(obs) - 1))
