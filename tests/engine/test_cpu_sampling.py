"""The compiled sampled rows (server/worker/cpu_sampling.py) against the Sampler's torch path: the same kept
tokens and probabilities (temperature, top-k, top-p, min-p, masked tokens), the same token for the same
uniform draw, the torch path's distribution by a chi-square test that a wrong temperature fails, seeded rows
independent of their neighbours, and clear errors for bad rows and arguments."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from scipy.stats import chi2

from server.request import Request, SamplingParams
from server.worker.cpu_sampling import CpuSampling, RowFilters, SamplingRowError, load_cpu_sampling
from server.worker.sampler import Sampler, SamplingRow, draw_index, processed_row

ALPHA = 0.001  # significance level of the distribution tests


@pytest.fixture(scope="module")
def cs() -> CpuSampling:
    return load_cpu_sampling()


def _row(**kw: object) -> SamplingRow:
    return SamplingRow(Request("r", [1, 2, 3], SamplingParams(max_tokens=8, **kw)))  # type: ignore[arg-type]


def _reference(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:  # [V] -> [V] fp64 probs
    return processed_row(logits, SamplingRow(Request("r", [1], params))).softmax(-1).double()


def _kernel(cs: CpuSampling, logits: torch.Tensor, params: SamplingParams, u: float = 0.5):  # type: ignore[no-untyped-def]
    """(token, probs [V]) of one row through the kernel."""
    filters = RowFilters.of([params.temperature], [params.top_k], [params.top_p], [params.min_p])
    probs = torch.empty(1, logits.shape[-1])
    token = cs.sample_rows(
        logits.reshape(1, -1), None, filters, torch.tensor([u], dtype=torch.float64), probs
    )
    return int(token[0]), probs[0].double()


# top_k 1 is greedy (SamplingParams.greedy): the Sampler takes the argmax, not these filters
SETTINGS = [
    dict(temperature=t, top_k=k, top_p=p, min_p=m)
    for t, k, p, m in itertools.product([0.6, 1.0, 1.7], [0, 2, 7, 500], [1.0, 0.9, 0.3], [0.0, 0.05])
]


@pytest.mark.parametrize("vocab", [1, 13, 1000, 128_256])
@pytest.mark.parametrize("masked", [False, True], ids=["open", "masked"])
def test_kept_tokens_and_probabilities_match_the_torch_path(
    cs: CpuSampling, vocab: int, masked: bool
) -> None:
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(vocab, generator=g) * 3  # distinct values: no ties at a cut
    if masked and vocab > 1:  # a grammar's mask: -inf everywhere but a few tokens
        keep = torch.randperm(vocab, generator=g)[: max(1, vocab // 10)]
        logits = torch.full_like(logits, float("-inf")).index_copy_(0, keep, logits[keep])
    for kw in SETTINGS:
        params = SamplingParams(max_tokens=1, **kw)  # type: ignore[arg-type]
        ref = _reference(logits, params)
        _, got = _kernel(cs, logits, params)
        if vocab <= 1000:
            assert torch.equal(got > 0, ref > 0), f"{kw}: kept tokens differ"
            torch.testing.assert_close(got, ref, rtol=2e-5, atol=1e-9, msg=lambda m, kw=kw: f"{kw}: {m}")
            continue
        # 128k nearly flat tokens: the torch path's fp32 cumulative sum drifts by a few tokens' mass at
        # top-p's cut (the kernel sums in fp64), so the kept sets may differ there, by almost no mass
        differ = (got > 0) != (ref > 0)
        assert float(ref[differ].sum() + got[differ].sum()) < 1e-4, f"{kw}: kept tokens differ"
        both = (got > 0) & (ref > 0)
        torch.testing.assert_close(
            got[both], ref[both], rtol=1e-4, atol=1e-9, msg=lambda m, kw=kw: f"{kw}: {m}"
        )


@pytest.mark.parametrize("vocab", [13, 1000])
def test_the_token_is_the_torch_paths_for_the_same_draw(cs: CpuSampling, vocab: int) -> None:
    """draw_index (the torch path) and the kernel pick the same token for the same u, wherever u x total is
    not within float rounding of a boundary of the cumulative distribution."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(vocab, generator=g) * 2
    us = [0.0, 1e-9, 0.5, 1 - 1e-12, *torch.rand(40, generator=g, dtype=torch.float64).tolist()]
    checked = 0
    for kw, u in itertools.product(SETTINGS[::5], us):
        params = SamplingParams(max_tokens=1, **kw)  # type: ignore[arg-type]
        cdf = _reference(logits, params).cumsum(0)
        if torch.isclose(cdf, torch.tensor(u * float(cdf[-1]), dtype=torch.float64), rtol=1e-5, atol=0).any():
            continue
        token, probs = _kernel(cs, logits, params, u)
        assert token == draw_index(processed_row(logits, SamplingRow(Request("r", [1], params))), u), (kw, u)
        assert probs[token] > 0
        checked += 1
    assert checked > 0.9 * len(SETTINGS[::5]) * len(us)


def test_top_k_keeps_ties_and_top_p_keeps_the_lowest_indices_of_tied_values(cs: CpuSampling) -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0, 2.0])
    _, probs = _kernel(cs, logits, SamplingParams(max_tokens=1, top_k=3))
    assert (probs > 0).nonzero().flatten().tolist() == [1, 2, 3, 4, 5, 7]  # every 2.0 ties the 3rd largest
    # e^3 = 20.1 twice, e^2 = 7.4 four times, Z = 73.4: 0.7 of it (51.4) is reached by the second 2.0
    _, probs = _kernel(cs, logits, SamplingParams(max_tokens=1, top_p=0.7))
    ref = _reference(logits, SamplingParams(max_tokens=1, top_p=0.7))
    assert (probs > 0).nonzero().flatten().tolist() == [1, 2, 3, 4]
    assert int((ref > 0).sum()) == 4  # the torch path keeps as many (which 2.0s: its sort's order)


@pytest.mark.parametrize("use_kernel", [True, False], ids=["compiled", "torch"])
def test_sampled_tokens_follow_the_distribution(cs: CpuSampling, use_kernel: bool) -> None:
    """Chi-square goodness of fit of 12,000 draws (one batch of rows, unseeded) to the reference
    distribution; the same draws scored against the distribution of a 15% lower temperature must fail."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(12, generator=g) * 1.5
    params = SamplingParams(max_tokens=1, temperature=0.9, top_k=10, top_p=0.97, min_p=0.01)
    n = 12_000
    rows = [SamplingRow(Request(f"r{i}", [1], params)) for i in range(n)]
    torch.manual_seed(11)
    sampler = Sampler(cpu_sampling=cs if use_kernel else None)
    counts = Counter(sampler(logits.expand(n, -1).contiguous(), rows).token_ids)
    probs = _reference(logits, params)
    assert _chi_square_p(counts, probs) > ALPHA
    colder = SamplingParams(max_tokens=1, temperature=0.9 * 0.85, top_k=10, top_p=0.97, min_p=0.01)
    assert _chi_square_p(counts, _reference(logits, colder)) < ALPHA


def _chi_square_p(counts: Counter[int], probs: torch.Tensor) -> float:  # probs: [V] fp64
    n = sum(counts.values())
    if any(probs[t] == 0 for t in counts):
        return 0.0  # a token the distribution never gives
    cats = [t for t in range(probs.shape[0]) if probs[t] * n >= 5]
    stat = sum((counts.get(t, 0) - float(probs[t]) * n) ** 2 / (float(probs[t]) * n) for t in cats)
    return float(chi2.sf(stat, len(cats) - 1))


def test_seeded_rows_are_independent_of_their_neighbours_and_of_the_path(cs: CpuSampling) -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 500, generator=g)
    seeded = dict(temperature=0.8, top_p=0.9, seed=1234)
    alone = Sampler(cpu_sampling=cs)(logits[1:2].clone(), [_row(**seeded)]).token_ids[0]
    noisy = [_row(temperature=1.2), _row(**seeded), _row(temperature=0.0)]
    for _ in range(3):
        assert Sampler(cpu_sampling=cs)(logits, noisy).token_ids[1] == alone
    assert Sampler()(logits, noisy).token_ids[1] == alone  # the torch path draws the same u
    # the greedy neighbour is the argmax; the sampled ones drawn from their own rows (row_ids)
    assert Sampler(cpu_sampling=cs)(logits, noisy).token_ids[2] == int(logits[2].argmax())
    other = [_row(temperature=0.8, top_p=0.9, seed=s) for s in range(40)]
    assert len(set(Sampler(cpu_sampling=cs)(logits[1:2].expand(40, -1).contiguous(), other).token_ids)) > 5


def test_rows_without_a_candidate_are_refused_by_row_and_extreme_values_have_limits(cs: CpuSampling) -> None:
    """Every logit -inf or NaN: a clear error naming the row. A NaN logit (extreme penalties' inf - inf) is no
    candidate; +inf logits (a repetition penalty of 1e-193 on a positive logit) share the mass evenly. The
    torch path alike."""
    logits = torch.randn(4, 50)
    filters = RowFilters.of([0.7] * 4, [0] * 4, [0.9] * 4, [0.0] * 4)
    u = torch.full((4,), 0.5, dtype=torch.float64)
    rows = [_row(temperature=0.7, top_p=0.9) for _ in range(4)]
    for fill in (float("-inf"), float("nan")):
        logits[2] = fill
        with pytest.raises(SamplingRowError, match="logits row 2"):
            cs.sample_rows(logits, None, filters, u)
        with pytest.raises(ValueError, match="no candidate"):
            draw_index(processed_row(logits[2], rows[2]), 0.5)
    logits[2] = torch.randn(50)
    logits[2, [3, 11, 40]] = float("nan")
    for use in (cs, None):
        seen = Counter(t for _ in range(60) for t in Sampler(cpu_sampling=use)(logits, rows).token_ids[2:3])
        assert not seen.keys() & {3, 11, 40}
    logits[2, [5, 17]] = float("inf")
    probs = torch.empty(4, 50)
    cs.sample_rows(logits, None, RowFilters.of([0.7] * 4, [0] * 4, [1.0] * 4, [0.0] * 4), u, probs)
    assert probs[2].nonzero().flatten().tolist() == [5, 17] and probs[2, 5] == probs[2, 17] == 0.5
    for use in (cs, None):
        seen = Counter(t for _ in range(60) for t in Sampler(cpu_sampling=use)(logits, rows).token_ids[2:3])
        assert set(seen) == {5, 17} and seen[5] > 10 and seen[17] > 10  # top_p 0.9 of two halves keeps both
    ids = torch.tensor([0, 3], dtype=torch.int64)
    logits[1] = float("-inf")
    two = RowFilters.of([1.0] * 2, [0] * 2, [1.0] * 2, [0.0] * 2)
    assert cs.sample_rows(logits, ids, two, u[:2]).shape == (2,)  # row_ids skip the bad row
    with pytest.raises(SamplingRowError, match="logits row 1"):  # the logits' row, not the position in ids
        cs.sample_rows(logits, torch.tensor([3, 1]), two, u[:2])


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=0.0),
        dict(temperature=float("inf")),
        dict(top_k=-1),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(min_p=-0.1),
        dict(min_p=2.0),
        dict(u=1.0),
        dict(u=-0.5),
    ],
    ids=lambda d: next(iter(d)) + "=" + str(next(iter(d.values()))),
)
def test_out_of_range_settings_are_refused(cs: CpuSampling, bad: dict) -> None:  # type: ignore[type-arg]
    kw = {**dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, u=0.5), **bad}
    u = torch.tensor([kw.pop("u")], dtype=torch.float64)
    filters = RowFilters.of(*([kw[k]] for k in ("temperature", "top_k", "top_p", "min_p")))  # type: ignore[arg-type]
    out = torch.full((1,), -7, dtype=torch.int64)
    with pytest.raises(ValueError, match="out of range"):
        out = cs.sample_rows(torch.randn(1, 10), None, filters, u)
    assert out.tolist() == [-7]


def test_tensors_of_the_wrong_kind_are_refused(cs: CpuSampling) -> None:
    f1 = RowFilters.of([1.0], [0], [1.0], [0.0])
    u1 = torch.tensor([0.5], dtype=torch.float64)
    with pytest.raises(TypeError, match="logits"):
        cs.sample_rows(torch.randn(1, 10).double(), None, f1, u1)
    with pytest.raises(ValueError, match="unit stride"):
        cs.sample_rows(torch.randn(10, 2).t(), None, f1, u1)
    with pytest.raises(ValueError, match="rows apart"):
        cs.sample_rows(torch.randn(20).as_strided((2, 10), (5, 1)), None, f1, u1)
    with pytest.raises(TypeError, match="u"):
        cs.sample_rows(torch.randn(1, 10), None, f1, u1.float())
    with pytest.raises(TypeError, match="temperature"):
        cs.sample_rows(torch.randn(2, 10), None, f1, u1)  # settings for 1 row, logits of 2
    with pytest.raises(ValueError, match="row_ids"):
        cs.sample_rows(torch.randn(2, 10), torch.tensor([2]), f1, u1)
    with pytest.raises(ValueError, match="probs_out"):
        cs.sample_rows(torch.randn(1, 10), None, f1, u1, torch.empty(1, 9))


@pytest.mark.parametrize("zeros", [79_104, 2_000], ids=["padded-vocabulary", "few-ties"])
def test_a_large_tie_group_at_the_top_p_cut_keeps_its_lowest_indices(cs: CpuSampling, zeros: int) -> None:
    """bf16 logits of a model whose padded vocabulary rows are zero (79,104 equal logits in a 128,256-token
    row of our Llama-shaped test model): the cut falls inside one tie group; the kernel keeps every token
    above it and the group's lowest indices, as many as an fp64 walk of the sorted row keeps."""
    g = torch.Generator().manual_seed(zeros)
    vocab = 128_256
    logits = (torch.randn(vocab, generator=g) * 0.6).bfloat16().float()
    logits[torch.randperm(vocab, generator=g)[:zeros]] = 0.0
    for top_p in (0.5, 0.9, 0.99):
        params = SamplingParams(max_tokens=1, temperature=0.7, top_p=top_p)
        _, probs = _kernel(cs, logits, params)
        kept = probs > 0
        # the fp64 walk: sorted by value (largest first, lowest index among equals)
        e = ((logits / 0.7).double() - float((logits / 0.7).max())).exp()
        order = sorted(range(vocab), key=lambda i: (-float(e[i]), i))
        before = torch.cumsum(e[order], 0) - e[order]
        n_keep = int((before < top_p * float(e.sum())).sum())
        cut = float(logits[order[n_keep - 1]])
        above = logits > cut
        ties = (logits == cut).nonzero().flatten()
        assert torch.equal(kept & above, above) and not (kept & (logits < cut)).any(), top_p
        got_ties = int(kept[ties].sum())
        assert abs(got_ties - (n_keep - int(above.sum()))) <= 2, top_p  # fp32 e against fp64 e at the cut
        assert torch.equal(kept[ties], torch.arange(ties.numel()) < got_ties), top_p  # the lowest indices


@pytest.mark.parametrize(
    "case",
    ["top_k-past-2048", "tied-kth-value", "tied-kth-padded"],
)
def test_top_p_after_a_top_k_that_keeps_thousands(cs: CpuSampling, case: str) -> None:
    """Top-k leaving more than the kernel sorts whole (2,048 values): top-p's pool narrows by e's bits from the
    top, as without top-k (it once narrowed by middle bits there and kept an arbitrary set)."""
    g = torch.Generator().manual_seed(9)
    if case == "top_k-past-2048":
        logits, k = torch.randn(5000, generator=g) * 2, 3000
    elif case == "tied-kth-value":
        logits, k = (torch.randn(6000, generator=g) * 0.5).bfloat16().float(), 50
    else:  # one peak, then 2,999 equal logits: top_k 2 keeps every tie of the 2nd largest
        logits, k = torch.zeros(3000), 2
        logits[0] = 5.0
    for top_p in (0.3, 0.5, 0.9, 0.99):
        params = SamplingParams(max_tokens=1, top_k=k, top_p=top_p)
        ref = _reference(logits, params)
        _, got = _kernel(cs, logits, params)
        assert int((got > 0).sum()) == int((ref > 0).sum()), (case, top_p)
        if case == "top_k-past-2048":  # distinct logits: the very same tokens
            assert torch.equal(got > 0, ref > 0), top_p
        else:  # ties at the cut: as many kept, every larger logit and the ties' lowest indices
            cut = float(logits[got > 0].min())
            ties = (logits == cut).nonzero().flatten()
            assert bool((got[logits > cut] > 0).all()), top_p
            assert torch.equal(got[ties] > 0, torch.arange(ties.numel()) < int((got[ties] > 0).sum())), top_p


def test_a_top_k_past_int32_keeps_the_vocabulary(cs: CpuSampling) -> None:
    logits = torch.randn(2, 40)
    rows = [_row(temperature=1.0, top_k=2**40, seed=5), _row(temperature=1.0, seed=5)]
    assert Sampler(cpu_sampling=cs)(logits[[0, 0]].contiguous(), rows).token_ids == (
        Sampler()(logits[[0, 0]].contiguous(), rows).token_ids
    )


def test_equal_fp32_probabilities_keep_the_larger_logit(cs: CpuSampling) -> None:
    """Logits 1e-8 apart have one fp32 probability; top-p keeps by logit as the torch path's sort does."""
    logits = torch.tensor([-2e-8, -1e-8, 0.0])
    for top_p in (1e-6, 0.3):
        params = SamplingParams(max_tokens=1, top_p=top_p)
        token, probs = _kernel(cs, logits, params, u=0.5)
        assert token == 2 and (probs > 0).tolist() == [False, False, True]


def test_probs_out_of_one_row_takes_any_row_stride(cs: CpuSampling) -> None:
    f1 = RowFilters.of([1.0], [0], [1.0], [0.0])
    probs = torch.empty(10, 1).t()  # [1, 10], stride (1, 1)
    cs.sample_rows(torch.randn(1, 10), None, f1, torch.tensor([0.5], dtype=torch.float64), probs)
    assert float(probs.sum()) == pytest.approx(1.0, abs=1e-6)
