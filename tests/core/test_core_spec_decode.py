"""Speculative decoding, the plain-Python half: config, n-gram proposals, the scheduler's lookahead
slots, acceptance bookkeeping, freed rejected slots and prefix hashes over accepted tokens only."""

from __future__ import annotations

import pytest

from server.core.block_pool import hash_block_tokens
from server.core.kv_cache_manager import KVCacheManager
from server.core.outputs import ModelOutput, SchedulerOutput
from server.core.scheduler import Scheduler, SchedulerConfig
from server.request import FinishReason, Request, SamplingParams
from server.spec_decode.config import SpeculativeConfig, parse_speculative_config
from server.spec_decode.ngram import propose_ngram
from server.spec_decode.proposer import Speculator

# ---- config -------------------------------------------------------------------------------------


def test_config_reads_vllm_keys_and_defaults() -> None:
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert c == SpeculativeConfig("ngram", 3, prompt_lookup_min=4, prompt_lookup_max=4)
    c = parse_speculative_config(
        {"model": "[ngram]", "num_speculative_tokens": 2, "disable_by_batch_size": 8}
    )
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max, c.disable_by_batch_size) == ("ngram", 5, 5, 8)
    c = parse_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    )
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (1, 3)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
        ('{"method": "ngram", "num_speculative_tokens": "3"}', "num_speculative_tokens must be"),
        ('{"method": "medusa", "num_speculative_tokens": 3}', "method must be one of"),
        ('{"method": "ngram"}', "needs num_speculative_tokens"),
        ('{"num_speculative_tokens": 3}', "needs a method"),
        (
            '{"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}',
            "unknown --speculative-config keys",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
            "<=",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0}',
            "disable_by_batch_size",
        ),
        ('{"model": "some/draft", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
        ('{"method": "draft_model", "num_speculative_tokens": 3}', "needs a 'model'"),
        ("[1, 2]", "must be a JSON object"),
        ("{nope", "not valid JSON"),
    ],
)
def test_config_errors_are_clear(raw: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_speculative_config(raw)


# ---- n-gram lookup ------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_earliest_longest_match() -> None:
    seq = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # suffix [1, 2, 3] occurred at 0 -> 4, 5, 9
    assert propose_ngram(seq, 3, 1, 3) == [4, 5, 9]
    # only up to 2-grams: [2, 3] first occurs at 1 -> 4, 5
    assert propose_ngram(seq, 2, 1, 2) == [4, 5]
    # the proposal is cut at the sequence end
    assert propose_ngram([5, 6, 5], 4, 1, 2) == [6, 5]
    # no earlier occurrence of any allowed n-gram
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []
    assert propose_ngram([1, 2, 3, 1], 3, 2, 3) == []
    assert propose_ngram([7], 3, 1, 3) == []


def test_speculator_skips_logprob_requests_and_large_batches() -> None:
    spec = Speculator(SpeculativeConfig("ngram", 3, 1, 2, disable_by_batch_size=2))
    a = Request("a", [1, 2, 3, 1, 2], SamplingParams(max_tokens=8))
    b = Request("b", [1, 2, 3, 1, 2], SamplingParams(max_tokens=8, logprobs=1))
    c = Request("c", [1, 2, 3, 1, 2], SamplingParams(max_tokens=2))
    for r in (a, b, c):
        r.num_computed_tokens = r.num_tokens - 1
    spec.propose([a, b])
    assert a.spec_token_ids == [3, 1, 2] and b.spec_token_ids == []
    spec.propose([a, b, c])  # over disable_by_batch_size: nobody speculates
    assert a.spec_token_ids == [] and c.spec_token_ids == []
    spec.propose([c])  # max_tokens=2: only one token can come from a draft
    assert c.spec_token_ids == [3]


# ---- scheduler ----------------------------------------------------------------------------------


def make_sched(blocks: int = 64, bs: int = 4, budget: int = 64, caching: bool = True) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=256)
    return Scheduler(cfg, KVCacheManager(blocks, bs, caching))


def req(rid: str, n: int, max_tokens: int = 16, **kw: object) -> Request:
    return Request(
        rid,
        list(range(100, 100 + n)),
        SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw),
        frozenset({2}),
    )


def step(s: Scheduler, accepted: dict[str, list[int]] | None = None, token: int = 7) -> SchedulerOutput:
    out = s.schedule()
    mo = ModelOutput()
    for item in out.scheduled:
        rid = item.request.request_id
        if item.spec_token_ids:
            mo.accepted_token_ids[rid] = (accepted or {})[rid]
        elif item.sample:
            mo.sampled_token_ids[rid] = token
    s.update_from_output(out, mo)
    return out


def test_lookahead_slots_then_rejected_ones_freed() -> None:
    s = make_sched(bs=4)
    r = req("a", 6)
    s.add_request(r)
    step(s)  # prefill: 6 prompt tokens + 1 sampled, 2 blocks
    assert r.num_tokens == 7 and r.num_computed_tokens == 6
    r.spec_token_ids = [11, 12, 13, 14, 15]
    out = s.schedule()
    (item,) = out.scheduled
    # the last known token + 5 drafts: positions 6..11, 3 blocks
    assert (item.start, item.num_new_tokens, item.spec_token_ids) == (6, 6, (11, 12, 13, 14, 15))
    assert out.num_batched_tokens == 6 and len(s.kv.block_ids("a")) == 3
    # two drafts accepted, then the target's own token 99
    s.update_from_output(out, ModelOutput(accepted_token_ids={"a": [11, 12, 99]}))
    assert r.output_token_ids == [7, 11, 12, 99]
    assert r.num_computed_tokens == 9 and r.num_tokens == 10
    # positions 0..8 hold valid KV: 3 blocks kept (9 tokens); nothing past them
    assert len(s.kv.block_ids("a")) == 3
    r.spec_token_ids = [21, 22, 23, 24, 25]
    out = s.schedule()
    assert len(s.kv.block_ids("a")) == 4  # positions 9..14
    s.update_from_output(out, ModelOutput(accepted_token_ids={"a": [98]}))  # all rejected
    assert r.num_computed_tokens == 10 and len(s.kv.block_ids("a")) == 3  # the 4th block given back
    st = s.stats()
    assert (st.spec_num_drafts, st.spec_num_draft_tokens, st.spec_num_accepted_tokens) == (2, 10, 2)
    assert st.spec_accepted_per_pos == (1, 1, 0, 0, 0)
    s.finish_request("a", FinishReason.ABORT)
    assert s.kv.pool.num_free_blocks == 64


def test_drafts_limited_by_budget_and_max_tokens() -> None:
    s = make_sched(budget=3)
    r = req("a", 2, max_tokens=4)
    s.add_request(r)
    step(s)
    r.spec_token_ids = [11, 12, 13, 14]
    out = s.schedule()
    assert out.scheduled[0].spec_token_ids == (11, 12)  # budget 3 = 1 + 2 drafts
    s.update_from_output(out, ModelOutput(accepted_token_ids={"a": [11, 12, 5]}))
    assert len(r.output_token_ids) == 4 and r.is_finished and r.finish_reason == FinishReason.LENGTH


def test_eos_and_max_tokens_inside_an_accepted_run() -> None:
    s = make_sched()
    a, b = req("a", 5, max_tokens=16), req("b", 5, max_tokens=3)
    s.add_request(a)
    s.add_request(b)
    step(s)
    a.spec_token_ids = [5, 2, 6]  # EOS (2) accepted at the second position
    b.spec_token_ids = [5, 6]
    fin = s.update_from_output(
        (out := s.schedule()), ModelOutput(accepted_token_ids={"a": [5, 2, 6, 8], "b": [5, 8]})
    )
    assert out.scheduled[1].spec_token_ids == (5,)  # b has room for one draft (max_tokens 3)
    assert {(f.request.request_id, f.reason) for f in fin} == {
        ("a", FinishReason.STOP),
        ("b", FinishReason.LENGTH),
    }
    assert a.output_token_ids == [7, 5, 2]
    assert b.output_token_ids == [7, 5, 8]
    assert s.stats().num_generation_tokens == 6
    assert s.kv.pool.num_free_blocks == 64


def test_prefix_hashes_cover_accepted_tokens_only() -> None:
    s = make_sched(bs=4)
    r = req("a", 3)
    s.add_request(r)
    step(s)  # 3 prompt tokens + token 7: one full block of known tokens
    r.spec_token_ids = [40, 41, 42, 43, 44]
    out = s.schedule()
    blocks = s.kv.block_ids("a")
    # Block 0 (positions 0..3) is known and hashed; block 1 holds only drafts: no hash.
    assert s.kv.pool.blocks[blocks[0]].block_hash == hash_block_tokens(None, [100, 101, 102, 7])
    assert s.kv.pool.blocks[blocks[1]].block_hash is None
    s.update_from_output(out, ModelOutput(accepted_token_ids={"a": [40, 50]}))
    assert r.all_token_ids == [100, 101, 102, 7, 40, 50]
    r.spec_token_ids = []
    step(s, token=60)
    step(s, token=61)  # now positions 4..7 = 40, 50, 60, 61 are known and computed
    out = s.schedule()
    b1 = s.kv.block_ids("a")[1]
    h0 = hash_block_tokens(None, [100, 101, 102, 7])
    assert s.kv.pool.blocks[b1].block_hash == hash_block_tokens(h0, [40, 50, 60, 61])


def test_drafts_dropped_before_preempting() -> None:
    # 4 blocks of 4: a (6 tokens) and b (6 tokens) hold 2 blocks each; a's drafts need a 3rd block.
    s = make_sched(blocks=4, bs=4, caching=False)
    a, b = req("a", 6, max_tokens=4), req("b", 6, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    step(s)
    a.spec_token_ids = [1, 2, 3]
    out = s.schedule()
    assert [i.spec_token_ids for i in out.scheduled] == [(), ()]
    assert not out.preempted_request_ids
