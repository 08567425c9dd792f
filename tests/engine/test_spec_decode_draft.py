"""Speculative decoding with a draft model (server/spec_decode/draft_model.py) on tiny random models
sharing SmolLM2's vocabulary: a smaller draft (the target truncated to one layer: some drafts accepted,
most rejected) and the target itself as its own draft (greedy acceptance ~1.0).

Greedy outputs equal plain decoding for k in {1, 3, 5}, staggered batches, prefix caching with n > 1,
forced preemption, stop strings, a short draft cache and disable_by_batch_size; KV blocks of both caches
all returned after every test and after aborts mid-speculation; sampled outputs follow the target's
exact distribution (chi-square against transformers' probabilities), and the same engine-level test
fails when the acceptance rule is deliberately biased; bad draft configurations fail at startup."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from engine_driver import TOKENIZER_FILES, run_staggered
from spec_checks import assert_no_kv_held, chi_square_p, collect, spec_engine

import server.spec_decode.rejection_sampler as rs
from server.config import EngineConfig, ParallelConfig
from server.core.block_pool import BlockPool
from server.engine import LLMEngine
from server.models.loader import ModelLoadError
from server.request import SamplingParams
from server.spec_decode.config import SpeculativeConfig, parse_speculative_config
from server.spec_decode.draft_model import DraftModelProposer

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


def variant(target: Path, out: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    """A copy of the target checkpoint changed by edit(model), with the target's tokenizer files."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    edit(model)
    model.save_pretrained(str(out))
    for name in TOKENIZER_FILES:
        if (target / name).exists():
            shutil.copy(target / name, out / name)
    return out


def truncate(model) -> None:  # type: ignore[no-untyped-def]
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1


@pytest.fixture(scope="module")
def folder(tiny_model_factory) -> Path:  # type: ignore[no-untyped-def]
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def drafts(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """small: the target's first layer only (same embeddings and head); self: the target itself."""
    return {"small": variant(folder, tmp_path_factory.mktemp("draft-small"), truncate), "self": folder}


def make_engine(
    folder: Path, draft: Path | None = None, k: int = 3, blocks: int = 256, **kw: object
) -> LLMEngine:
    spec = None
    if draft is not None:
        spec = SpeculativeConfig(
            "draft_model", k, model=str(draft), disable_by_batch_size=kw.pop("disable_by_batch_size", None)
        )  # type: ignore[arg-type]
    return spec_engine(folder, spec, blocks, **kw)


@pytest.fixture(scope="module")
def base(folder: Path) -> tuple[LLMEngine, list[list[int]], list[list[int]]]:
    engine = make_engine(folder)
    prompts = [engine.tokenizer.encode(t) for t in TEXTS]
    return engine, prompts, run_staggered(engine, prompts, GREEDY)


def proposer(engine: LLMEngine) -> DraftModelProposer:
    assert engine.speculator is not None
    p = engine.speculator.proposer
    assert isinstance(p, DraftModelProposer)
    return p


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("which", ["small", "self"])
def test_greedy_parity_staggered(folder: Path, drafts, base, which: str, k: int) -> None:  # type: ignore[no-untyped-def]
    _, prompts, ref = base
    engine = make_engine(folder, drafts[which], k)
    assert run_staggered(engine, prompts, GREEDY) == ref
    st = engine.stats()
    assert st.spec_num_drafts > 10 and len(st.spec_accepted_per_pos) == k
    rate = st.spec_num_accepted_tokens / st.spec_num_draft_tokens
    if which == "self":
        assert rate > 0.95  # the target proposing its own argmax: every draft accepted (up to fp noise)
    else:
        assert 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens
    # k draft forward passes per speculating step, the first one also catching up on new tokens
    assert proposer(engine).num_forward_passes > 0
    assert_no_kv_held(engine)


def test_greedy_parity_prefix_caching_and_n_copies(folder: Path, drafts, base) -> None:  # type: ignore[no-untyped-def]
    _, prompts, ref = base
    engine = make_engine(folder, drafts["small"], 3)
    # n > 1: three copies of each prompt in one batch share their prompt's cached target blocks; the
    # draft has its own block tables (one per copy)
    outs = engine.generate([p for p in prompts[:3] for _ in range(3)], GREEDY)
    assert outs == [r for r in ref[:3] for _ in range(3)]
    hits = engine.stats().prefix_cache_hits
    assert hits > 0
    assert [engine.generate([p], GREEDY)[0] for p in prompts] == ref
    assert engine.stats().prefix_cache_hits > hits
    assert engine.stats().spec_num_accepted_tokens > 0
    assert_no_kv_held(engine)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_parity_under_forced_preemption(folder: Path, drafts, base, k: int) -> None:  # type: ignore[no-untyped-def]
    _, prompts, ref = base
    # 24 blocks of 4 tokens cannot hold 6 sequences of up to ~60 tokens; an 8-token budget chunks prompts.
    engine = make_engine(folder, drafts["small"], k, blocks=24, caching=False, max_num_batched_tokens=8)
    assert run_staggered(engine, prompts, GREEDY) == ref
    st = engine.stats()
    assert st.num_preemptions > 0 and st.spec_num_accepted_tokens > 0
    assert_no_kv_held(engine)


def test_stop_strings_inside_accepted_runs(folder: Path, drafts, base) -> None:  # type: ignore[no-untyped-def]
    plain, prompts, ref = base
    engine = make_engine(folder, drafts["self"], 5)  # long accepted runs
    cut_inside_run = 0
    original = engine.scheduler.discard_output_tail

    def counting(req, n: int) -> None:  # type: ignore[no-untyped-def]
        nonlocal cut_inside_run
        cut_inside_run += n > 0
        original(req, n)

    engine.scheduler.discard_output_tail = counting  # type: ignore[method-assign]
    cases = 0
    for prompt, out in zip(prompts[:3], ref[:3], strict=True):
        text = plain.tokenizer.decode(out, True)
        for m in range(3, min(len(text), 80), 13):
            params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, stop=(text[:m],))
            assert collect(engine, prompt, params) == collect(plain, prompt, params)
            cases += 1
        tok = out[len(out) // 2]
        params = SamplingParams(max_tokens=32, temperature=0.0, stop_token_ids=(tok,))
        assert collect(engine, prompt, params) == collect(plain, prompt, params)
    assert cases > 8 and cut_inside_run > 0
    assert_no_kv_held(engine)


def test_abort_mid_speculation_frees_both_caches(folder: Path, drafts, base) -> None:  # type: ignore[no-untyped-def]
    _, prompts, _ = base
    engine = make_engine(folder, drafts["small"], 5)
    draft = proposer(engine)
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, GREEDY)
    for _ in range(6):
        engine.step()
    assert any(r.spec_token_ids for r in engine.scheduler.running)
    held = draft.num_held_blocks
    assert held > 0
    # between steps: the aborted request's draft blocks are freed at once
    engine.abort_request("a0")
    assert 0 < draft.num_held_blocks < held
    # after scheduling (aborted while the step runs)
    sched = engine.scheduler.schedule()
    assert any(item.spec_token_ids for item in sched.scheduled)
    for i in range(1, len(prompts)):
        engine.abort_request(f"a{i}")
    engine.scheduler.update_from_output(sched, engine.runner.execute(sched))
    assert_no_kv_held(engine)
    engine.step()  # the worker drops the finished ids
    assert_no_kv_held(engine)


def test_short_draft_cache_drafts_less_and_leaks_nothing(folder: Path, drafts, base) -> None:  # type: ignore[no-untyped-def]
    _, prompts, ref = base
    engine = make_engine(folder, drafts["self"], 3)
    # 10 draft blocks (40 tokens) for 6 sequences of up to ~60 tokens: some requests get no drafts
    pool = proposer(engine).pool = BlockPool(10, enable_caching=False)
    refused = 0
    allocate = pool.allocate

    def counting(n: int) -> list[int] | None:
        nonlocal refused
        got = allocate(n)
        refused += got is None
        return got

    pool.allocate = counting  # type: ignore[method-assign]
    assert run_staggered(engine, prompts, GREEDY) == ref
    st = engine.stats()
    assert refused > 0 and st.spec_num_drafts > 0 and st.spec_num_accepted_tokens > 0
    assert_no_kv_held(engine)


def test_disable_by_batch_size(folder: Path, drafts, base) -> None:  # type: ignore[no-untyped-def]
    _, prompts, ref = base
    engine = make_engine(folder, drafts["self"], 3, disable_by_batch_size=2)
    seen = {"spec": 0, "off": 0}
    original = engine.scheduler.update_from_output

    def watching(sched, out):  # type: ignore[no-untyped-def]
        # rows past their prompt were running when the drafts were proposed (new prefills were not)
        decoding = sum(item.start >= item.request.num_prompt_tokens for item in sched.scheduled)
        speculating = any(item.spec_token_ids for item in sched.scheduled)
        assert decoding <= 2 or not speculating
        seen["spec"] += speculating
        seen["off"] += decoding > 2
        return original(sched, out)

    engine.scheduler.update_from_output = watching  # type: ignore[method-assign]
    assert run_staggered(engine, prompts, GREEDY) == ref
    assert seen["spec"] > 0 and seen["off"] > 0
    assert_no_kv_held(engine)


# ---- distribution ------------------------------------------------------------------------------

DIST = SamplingParams(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True)
N_DIST = 1000


def filtered_probs(logits: torch.Tensor) -> torch.Tensor:  # [V] -> [V]
    """temperature 1, top-k 4, written out here from transformers' logits (not the sampler's code)."""
    kth = torch.topk(logits, 4).values[-1]
    return logits.masked_fill(logits < kth, float("-inf")).softmax(-1)


def exact_pairs(folder: Path, prompt: list[int]) -> dict[tuple[int, int], float]:
    """P(t1, t2) of the target's first two sampled tokens, from transformers' forward passes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        p1 = filtered_probs(model(torch.tensor([prompt])).logits[0, -1].float())
        out: dict[tuple[int, int], float] = {}
        for t1 in p1.nonzero().flatten().tolist():
            p2 = filtered_probs(model(torch.tensor([[*prompt, t1]])).logits[0, -1].float())
            for t2 in p2.nonzero().flatten().tolist():
                out[(t1, t2)] = float(p1[t1] * p2[t2])
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("which", "rule"), [("self", "exact"), ("small", "exact"), ("self", "biased")])
def test_sampled_pairs_follow_the_target_and_a_biased_rule_is_caught(  # type: ignore[no-untyped-def]
    folder: Path, drafts, which: str, rule: str, monkeypatch
) -> None:
    """The first two tokens of a sampled request over many seeds: the second is always a verified
    draft position (max_tokens 3 leaves room for one draft). One-sample chi-square against the exact
    joint probabilities; with the acceptance rule deliberately biased (on rejection resample from p
    instead of (p - q)+, over-weighting the draft token) the same test must fail."""
    if rule == "biased":
        monkeypatch.setattr(rs, "_residual", lambda probs, x: probs.clone())
    engine = make_engine(folder, drafts[which], 1, max_num_seqs=128)
    prompt = engine.tokenizer.encode("hello")  # the small draft's argmax is often in the top 4 here
    exact = exact_pairs(folder, prompt)
    params = [SamplingParams(**{**DIST.__dict__, "seed": s}) for s in range(N_DIST)]
    outs = engine.generate([prompt] * N_DIST, params)
    st = engine.stats()
    assert st.spec_num_drafts == N_DIST and 0 < st.spec_num_accepted_tokens < N_DIST
    cells = sorted(exact)
    index = {c: i for i, c in enumerate(cells)}
    counts = Counter(index.get((o[0], o[1]), len(cells)) for o in outs)
    probs = torch.tensor([exact[c] for c in cells] + [0.0])
    p = chi_square_p(counts, probs)
    assert p > ALPHA if rule == "exact" else p < ALPHA
    assert_no_kv_held(engine)


# ---- bad configurations -------------------------------------------------------------------------


def test_draft_with_another_vocabulary_is_a_startup_error(folder: Path, tmp_path: Path) -> None:
    bigger = variant(folder, tmp_path / "vocab", lambda m: (truncate(m), m.resize_token_embeddings(49216)))
    with pytest.raises(ModelLoadError, match="vocabulary has 49216 tokens, the target's 49152"):
        make_engine(folder, bigger)
    # same size, another token -> id table
    swapped = variant(folder, tmp_path / "tok", truncate)
    data = json.loads((swapped / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match="maps tokens to other ids"):
        make_engine(folder, swapped)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ('{"model": "some/draft", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
        ('{"method": "eagle", "model": "some/draft", "num_speculative_tokens": 3}', "method must be one of"),
        ('{"method": "draft_model", "num_speculative_tokens": 3}', "needs a 'model'"),
        ('{"model": "some/draft", "num_speculative_tokens": 3, "prompt_lookup_max": 3}', "ngram method"),
    ],
)
def test_bad_draft_configs_are_refused(raw: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_speculative_config(raw)


def test_draft_model_config_and_refusals(folder: Path) -> None:
    c = parse_speculative_config(
        {"model": str(folder), "num_speculative_tokens": 4, "disable_by_batch_size": 8}
    )
    assert c == SpeculativeConfig("draft_model", 4, model=str(folder), disable_by_batch_size=8)
    with pytest.raises(ValueError, match="tensor-parallel-size"):
        EngineConfig(speculative=c, parallel=ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(ModelLoadError, match="no such file or folder"):
        make_engine(folder, folder / "missing")
