"""Sampling, stop conditions, logprobs, abort and the async front, on a tiny random model."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from torch import Tensor

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import AsyncEngine, LLMEngine
from server.request import FinishReason, SamplingParams
from server.tokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def engine(tiny_model_factory) -> LLMEngine:  # type: ignore[no-untyped-def]
    folder = tiny_model_factory("llama")
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(folder), dtype="float32"),
            cache=CacheConfig(block_size=8, num_kv_blocks=128),
        )
    )


def collect(engine: LLMEngine) -> dict[str, list]:
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_seeded_sampling_is_independent_of_batch_neighbours(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode("The weather today is")
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = engine.generate([prompt], params)[0]
    neighbours = [engine.tokenizer.encode(t) for t in ("Hello there", "A B C D E F", "x")]
    noisy = SamplingParams(max_tokens=20, temperature=1.3, seed=None, ignore_eos=True)
    mixed = engine.generate([*neighbours, prompt], [noisy, noisy, noisy, params])[3]
    assert mixed == alone
    other_seed = engine.generate([prompt], SamplingParams(**{**params.__dict__, "seed": 99}))[0]
    assert other_seed != alone


def test_stop_strings_are_cut_and_held_back(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode("Count:")
    free = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    engine.add_request("free", prompt, free)
    text = "".join(o.text for o in collect(engine)["free"])
    assert len(text) > 6
    stop = text[3:6]
    engine.add_request(
        "stopped", prompt, SamplingParams(max_tokens=16, temperature=0.0, stop=(stop,), ignore_eos=True)
    )
    outs = collect(engine)["stopped"]
    assert outs[-1].finish_reason == FinishReason.STOP and outs[-1].stop_reason == stop
    assert "".join(o.text for o in outs) == text[: text.index(stop)]


def test_max_tokens_length_and_all_blocks_free(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode("abc")
    engine.add_request("len", prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    outs = collect(engine)["len"]
    assert outs[-1].finish_reason == FinishReason.LENGTH
    assert sum(len(o.new_token_ids) for o in outs) == 5
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_logprobs_match_a_log_softmax(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode("Logprobs please")
    engine.add_request(
        "lp", prompt, SamplingParams(max_tokens=3, temperature=0.0, logprobs=3, ignore_eos=True)
    )
    outs = collect(engine)["lp"]
    lps = [lp for o in outs for lp in o.new_logprobs]
    assert len(lps) == 3
    for lp in lps:
        assert lp.chosen.logprob <= 0.0
        assert len(lp.top) == 3
        assert lp.top[0].token_id == lp.chosen.token_id  # greedy picks the most likely token
        assert lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob
        assert sum(math.exp(t.logprob) for t in lp.top) <= 1.0 + 1e-5


def test_prompt_logprobs(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode("one two three four")
    engine.add_request("plp", prompt, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))
    outs = collect(engine)["plp"]
    plp = next(o.prompt_logprobs for o in outs if o.prompt_logprobs is not None)
    assert len(plp) == len(prompt) and plp[0] is None
    for lp, tok in zip(plp[1:], prompt[1:], strict=True):
        assert lp is not None and lp.chosen.token_id == tok and lp.chosen.logprob <= 0.0
        assert len(lp.top) == 2 and lp.top[0].logprob >= lp.top[1].logprob
        assert lp.chosen.rank is not None and lp.chosen.rank >= 1
        assert (lp.chosen.rank == 1) == (lp.top[0].token_id == tok)


def test_abort_frees_blocks(engine: LLMEngine) -> None:
    engine.add_request(
        "ab", engine.tokenizer.encode("a long story"), SamplingParams(max_tokens=50, ignore_eos=True)
    )
    engine.step()
    assert engine.kv.pool.num_free_blocks < engine.kv.pool.num_blocks
    out = engine.abort_request("ab")
    assert out is not None and out.finished and out.finish_reason == FinishReason.ABORT
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    assert engine.abort_request("ab") is None


def test_penalties_change_the_distribution(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode("repeat repeat repeat")
    base = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    pen = engine.generate(
        [prompt], SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=5.0, ignore_eos=True)
    )[0]
    assert len(set(pen)) >= len(set(base))
    seen = set(prompt)
    # a strong repetition penalty never picks a token from the prompt when alternatives exist
    assert not (set(pen[:1]) & seen) or pen != base


def test_invalid_requests_raise(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request("e", [], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("e", [10**9], SamplingParams())
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    assert not engine.has_unfinished()


def test_sampling_failure_is_isolated(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    real = engine.runner.sampler.__class__.__call__

    def faulty(self, logits: torch.Tensor, rows, *args):  # type: ignore[no-untyped-def]
        if any(r.params.seed == 666 for r in rows):
            raise RuntimeError("injected")
        return real(self, logits, rows, *args)

    monkeypatch.setattr(engine.runner.sampler.__class__, "__call__", faulty)
    p = engine.tokenizer.encode("isolate me")
    engine.add_request("bad", p, SamplingParams(max_tokens=4, seed=666))
    engine.add_request("good", p, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    outs = collect(engine)
    assert outs["bad"][-1].finish_reason == FinishReason.ERROR and "injected" in (outs["bad"][-1].error or "")
    assert outs["good"][-1].finish_reason == FinishReason.LENGTH
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_incremental_detokenizer_matches_full_decode(engine: LLMEngine) -> None:
    tok = engine.tokenizer
    ids = tok.encode(" héllo wörld — naïve café 日本語 🙂 done")
    det = IncrementalDetokenizer(tok, [1], SamplingParams())
    text = "".join(det.push([t]).text for t in ids) + det.flush()
    assert text == tok.decode(ids)


def test_incremental_detokenizer_token_texts_and_stop_rules(engine: LLMEngine) -> None:
    """Each token's own text whatever the stops; stop strings honour min_tokens and report the token
    that completed them; drop_last keeps a stopping token's text out of the output."""
    tok = engine.tokenizer
    ids = tok.encode(" Paris is 🎉 big")
    own = IncrementalDetokenizer(tok, [1], SamplingParams(max_tokens=16))
    plain = [own.push([t]).token_texts[0] for t in ids]
    assert "".join(plain) == tok.decode(ids) and "" in plain  # the emoji's first bytes carry no text
    held = IncrementalDetokenizer(tok, [1], SamplingParams(max_tokens=16, stop=("zzzzzzzz",)))
    assert held.push(ids).token_texts == plain
    # a stop string inside the first min_tokens tokens is not a stop
    first = tok.decode(ids[:1])
    det = IncrementalDetokenizer(tok, [1], SamplingParams(max_tokens=16, min_tokens=1, stop=(first,)))
    upd = det.push(ids[:2])
    assert upd.stop_string is None
    det = IncrementalDetokenizer(tok, [1], SamplingParams(max_tokens=16, stop=(" is",)))
    upd = det.push(ids)
    assert (upd.stop_string, upd.stop_index, upd.text) == (" is", 1, first)
    det = IncrementalDetokenizer(tok, [1], SamplingParams(max_tokens=16))
    assert det.push(ids[:2], drop_last=True).text + det.flush() == first


def test_async_engine_streams_and_aborts(engine: LLMEngine) -> None:
    p = engine.tokenizer.encode("stream me")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = engine.generate([p], params)[0]  # before the engine thread owns the engine

    async def main() -> None:
        aengine = AsyncEngine(engine)
        aengine.start()
        chunks = [o async for o in aengine.generate(p, params)]
        assert chunks[-1].finished and sum(len(c.new_token_ids) for c in chunks) == 6
        assert [t for c in chunks for t in c.new_token_ids] == expected

        async def partial() -> None:
            async for _ in aengine.generate(p, SamplingParams(max_tokens=200, ignore_eos=True)):
                break  # the client goes away after the first token

        await asyncio.gather(*(partial() for _ in range(4)))
        # The engine thread frees the aborted requests when it next runs: up to a minute on a loaded
        # machine (a fixed 2 s left them running there).
        for _ in range(3000):
            stats = aengine.last_stats
            if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0:
                break
            await asyncio.sleep(0.02)
        assert aengine.last_stats.num_running == 0 and aengine.last_stats.num_waiting == 0
        assert aengine.last_stats.kv_cache_usage == 0.0
        with pytest.raises(ValueError):
            async for _ in aengine.generate([], params):
                pass
        await aengine.shutdown()

    asyncio.run(main())


def _masked_row(mode: str, params: SamplingParams, allowed: list[int]):  # type: ignore[no-untyped-def]
    """Samples one row of random logits whose only allowed tokens are `allowed` (as a grammar's mask
    leaves them: -inf elsewhere) with a Sampler in `mode`; returns (output, model logits, masked)."""
    from server.request import Request
    from server.worker.sampler import Sampler, SamplingRow

    torch.manual_seed(0)
    vocab = 64
    model_logits = torch.randn(1, vocab) * 3
    masked = torch.full_like(model_logits, float("-inf"))
    masked[0, allowed] = model_logits[0, allowed]
    row = SamplingRow(Request("r", [1, 2, 3], params))
    return Sampler(mode)(masked, [row], model_logits), model_logits, masked


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_mode_under_a_mask(mode: str, greedy: bool) -> None:
    allowed = [5, 9, 40]
    params = SamplingParams(max_tokens=1, temperature=0.0 if greedy else 0.7, top_k=0, logprobs=8, seed=3)
    out, model_logits, masked = _masked_row(mode, params, allowed)
    (token,), (lp,) = out.token_ids, out.logprobs
    assert token in allowed and lp is not None and lp.chosen.token_id == token
    if mode.startswith("raw_"):  # the model's own distribution: the mask changes nothing reported
        values = model_logits[0].log_softmax(-1) if mode == "raw_logprobs" else model_logits[0]
        expect = torch.topk(values, 8)
        assert [t.token_id for t in lp.top] == expect.indices.tolist()
        assert [t.logprob for t in lp.top] == pytest.approx(expect.values.tolist(), abs=1e-5)
    else:  # the distribution sampled from: only allowed tokens, never a fill value
        scaled = masked[0] if greedy else masked[0] / 0.7
        values = scaled.log_softmax(-1) if mode == "processed_logprobs" else scaled
        assert sorted(t.token_id for t in lp.top) == sorted(allowed)
        for t in lp.top:
            assert t.logprob == pytest.approx(float(values[t.token_id]), abs=1e-5)
        if mode == "processed_logprobs":
            assert sum(math.exp(t.logprob) for t in lp.top) == pytest.approx(1.0, abs=1e-5)
    assert math.isfinite(lp.chosen.logprob) and all(math.isfinite(t.logprob) for t in lp.top)


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits"])
def test_logprobs_of_some_rows_of_a_batch_match_each_rows_own_reference(mode: str) -> None:
    """Rows asking different top counts (and some none) in one batch: each row reports its own
    log_softmax (or logits) and top list, as if it were alone; the rows without logprobs report none."""
    from server.request import Request
    from server.worker.sampler import Sampler, SamplingRow

    torch.manual_seed(0)
    vocab = 1000
    logits = torch.randn(5, vocab) * 4
    logits[3, :500] = float("-inf")  # a row whose half is masked: log_softmax over the rest
    asks = [5, None, 0, 20, 1]
    rows = [
        SamplingRow(Request(f"r{i}", [1, 2], SamplingParams(max_tokens=4, temperature=0.0, logprobs=n)))
        for i, n in enumerate(asks)
    ]
    out = Sampler(mode)(logits.clone(), rows)
    for i, n in enumerate(asks):
        lp = out.logprobs[i]
        if n is None:
            assert lp is None
            continue
        values = logits[i].log_softmax(-1) if mode == "raw_logprobs" else logits[i]
        token = out.token_ids[i]
        assert lp is not None and token == int(logits[i].argmax()) and lp.chosen.token_id == token
        assert lp.chosen.logprob == pytest.approx(float(values[token]), abs=1e-5)
        expect = torch.topk(values, n)
        assert [t.token_id for t in lp.top] == expect.indices.tolist()
        assert [t.logprob for t in lp.top] == pytest.approx(expect.values.tolist(), abs=1e-5)


@pytest.mark.parametrize(
    "edit",
    [
        {},
        {"repetition_penalty": 1.3},
        {"presence_penalty": 0.5, "frequency_penalty": 0.5},
        {"min_tokens": 4, "stop_token_ids": [7]},
    ],
    ids=["none", "repetition", "presence-frequency", "min-tokens"],
)
def test_the_sampler_leaves_the_callers_logits_as_they_were(edit: dict) -> None:  # type: ignore[type-arg]
    """The model runner retries a failed batch row by row on the same logits, so the batch's sampling must
    not edit them (penalties twice otherwise); rows that edit nothing take no copy. The tokens are the
    edited logits' argmax either way."""
    from server.request import Request
    from server.worker.sampler import Sampler, SamplingRow, _ban_eos_early, apply_penalties

    torch.manual_seed(1)
    logits = torch.randn(3, 64) * 3
    before = logits.clone()
    rows = []
    for i in range(3):
        req = Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0, **edit))
        req.output_token_ids.extend([int(before[i].argmax()), 5])
        rows.append(SamplingRow(req))
    out = Sampler()(logits, rows)
    assert torch.equal(logits, before)
    edited = apply_penalties(before.clone(), rows)
    _ban_eos_early(edited, rows)
    assert out.token_ids == edited.argmax(-1).tolist()
    assert torch.equal(edited, before) == (not edit)
    # the compiled argmax (ModelRunner hands the fused ops' to its Sampler) takes the edited logits too
    from server.models.cpu_fused import load_fused_ops

    seen: list[Tensor] = []

    def argmax(x: Tensor) -> Tensor:
        seen.append(x.clone())
        return load_fused_ops().argmax_rows(x)

    assert Sampler(argmax=argmax)(logits, rows).token_ids == out.token_ids
    assert len(seen) == 1 and torch.equal(seen[0], edited) and torch.equal(logits, before)
