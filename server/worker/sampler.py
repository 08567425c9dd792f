"""Logits -> tokens: penalties, temperature, top-k/top-p/min-p, seeded sampling, logprobs.

Every operation is row-wise, so a request's result never depends on its batch neighbours. A seeded
request draws its noise from a generator seeded by (seed, output position): the same seed gives the
same text whatever else runs, and a preempted request continues where it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from server.core.outputs import Logprob, TokenLogprobs
from server.request import Request, SamplingParams
from server.worker.cpu_sampling import CpuSampling, RowFilters

_MASK64 = (1 << 63) - 1
# The smallest top_p the compiled path takes (an fp32 > 0): any top_p up to it keeps the first token alone
_TOP_P_MIN = 1e-37


@dataclass(frozen=True)
class SamplingRow:
    request: Request

    @property
    def params(self) -> SamplingParams:
        return self.request.sampling_params


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def apply_penalties(logits: Tensor, rows: list[SamplingRow]) -> Tensor:  # logits: [S, V] fp32
    for i, row in enumerate(rows):
        p = row.params
        if not p.uses_penalties:
            continue
        req = row.request
        device = logits.device
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.int64, device=device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and req.output_token_ids:
            out = torch.tensor(req.output_token_ids, dtype=torch.int64, device=device)
            counts = torch.zeros(logits.shape[1], dtype=logits.dtype, device=device)
            counts.scatter_add_(0, out, torch.ones_like(out, dtype=logits.dtype))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _filter(logits: Tensor, p: SamplingParams) -> Tensor:  # logits: [V] fp32, already / temperature
    if p.top_k > 0 and p.top_k < logits.shape[0]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token once the mass before it already reaches top_p; the first token always stays.
        drop = probs.cumsum(-1) - probs >= p.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, idx, sorted_logits)
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def uniform_draws(rows: list[SamplingRow]) -> Tensor:  # -> [S] fp64 in [0, 1)
    """Each row's uniform draw for this step: a seeded row's from a generator seeded by (seed, output
    position), the others' from torch's default generator."""
    u = torch.rand(len(rows), dtype=torch.float64)
    for i, row in enumerate(rows):
        seed = row.params.seed
        if seed is not None:
            g = torch.Generator()
            g.manual_seed((seed * 1_000_003 + len(row.request.output_token_ids)) & _MASK64)
            u[i] = torch.rand((), dtype=torch.float64, generator=g)
    return u


def _limits(scaled: Tensor) -> Tensor:  # scaled: [V] fp32 logits / temperature
    """A NaN (extreme penalties' inf - inf) is no candidate; where values are +inf, softmax's limit as they
    grow: they share the mass evenly (server/worker/csrc/sampling.cpp does the same)."""
    if bool(torch.isfinite(scaled).all()):
        return scaled
    inf = float("inf")
    scaled = scaled.nan_to_num(nan=-inf, posinf=inf, neginf=-inf)
    if bool((scaled == inf).any()):
        scaled = torch.where(scaled == inf, 0.0, -inf)
    return scaled


def processed_row(logits: Tensor, row: SamplingRow) -> Tensor:  # logits: [V] fp32, penalties applied
    """The logits a row samples from: greedy rows as given, others / temperature, then filtered."""
    p = row.params
    return logits if p.greedy else _filter(_limits(logits / p.temperature), p)


def sample_row(logits: Tensor, row: SamplingRow) -> int:  # logits: [V] fp32, penalties applied
    processed = processed_row(logits, row)
    if row.params.greedy:
        return int(processed.argmax())
    return draw_index(processed, float(uniform_draws([row])[0]))


def draw_index(processed: Tensor, u: float) -> int:  # processed: [V] fp32, from processed_row
    """Inverse-CDF sampling: the first token whose cumulative probability (fp64) exceeds u, u in [0, 1).
    Raises ValueError where the row has no candidate (every logit -inf or NaN)."""
    probs = processed.softmax(-1).double()
    cdf = probs.cumsum(0)
    total = float(cdf[-1])
    if not total > 0.0 or total != total:
        raise ValueError("no candidate token: every logit is -inf or NaN")
    i = int(torch.searchsorted(cdf, torch.tensor([u * total], dtype=torch.float64), right=True)[0])
    if i >= probs.shape[0] or not probs[i] > 0:  # u x total rounded up to the total: the last kept token
        i = int(probs.nonzero()[-1])
    return i


def _before_min_tokens(row: SamplingRow) -> bool:
    return len(row.request.output_token_ids) < row.params.min_tokens


def _ban_eos_early(logits: Tensor, rows: list[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        p, req = row.params, row.request
        if _before_min_tokens(row):
            banned = [*req.eos_token_ids, *p.stop_token_ids]
            if banned:
                logits[i, banned] = float("-inf")


def compute_logprobs(values: Tensor, token: int, n: int) -> TokenLogprobs:  # values: [V] fp32
    """The chosen token's value and the top n (value, token) pairs of one row. Tokens at -inf (a
    processed mode's masked or filtered tokens) are not alternatives: top lists leave them out, so
    they may hold fewer than n entries; no fill value is ever reported for them."""
    top: list[Logprob] = []
    if n > 0:
        vals, ids = torch.topk(values, min(n, values.shape[0]))
        top = [
            Logprob(int(t), float(v))
            for t, v in zip(ids.tolist(), vals.tolist(), strict=True)
            if v != float("-inf")
        ]
    return TokenLogprobs(Logprob(token, float(values[token])), top)


class Sampler:
    """Samples rows and reports logprobs as vLLM's --logprobs-mode says (config.LOGPROBS_MODES):
    raw_logprobs (default) = log_softmax of the model's own logits, before penalties, a grammar's
    mask, temperature and filtering; raw_logits = those logits; processed_logprobs / processed_logits
    = the distribution actually sampled from (after all of them; greedy rows skip temperature and
    filtering, as they sample with neither)."""

    def __init__(
        self,
        logprobs_mode: str = "raw_logprobs",
        argmax: Callable[[Tensor], Tensor] | None = None,
        cpu_sampling: CpuSampling | None = None,
    ) -> None:
        """`argmax`: [S, V] fp32 contiguous rows -> [S] int64, torch.argmax(-1)'s answer bit for bit (the
        compiled one of server/models/cpu_fused.py, FusedOps.argmax_rows); None: torch's. `cpu_sampling`:
        the compiled sampled rows (server/worker/cpu_sampling.py) for CPU fp32 logits; None: the torch
        path row by row."""
        self.logprobs_mode = logprobs_mode
        self.argmax = argmax
        self.cpu_sampling = cpu_sampling

    def __call__(
        self, logits: Tensor, rows: list[SamplingRow], model_logits: Tensor | None = None
    ) -> SamplerOutput:
        """logits: [S, V] fp32 as masked by a grammar (if any); model_logits: [S, V] the model's logits
        before the mask (None = logits are the model's own). Raises on failure; the caller retries row
        by row to isolate the culprit."""
        want_logprobs = any(r.params.logprobs is not None for r in rows)
        mode = self.logprobs_mode
        report: Tensor | None = None
        if want_logprobs and mode.startswith("raw_"):
            own = logits if model_logits is None else model_logits
            report = own.log_softmax(-1) if mode == "raw_logprobs" else own.clone()
        # A copy only where a row's logits are edited: the caller retries a failed batch row by row on
        # the same tensor (penalties applied twice otherwise), and a [16, 128k] fp32 copy costs 1.7-1.9 ms
        # of a 75 ms bf16 decode step (Llama-3.2-1B shape, Zen 5).
        if any(r.params.uses_penalties or _before_min_tokens(r) for r in rows):
            logits = apply_penalties(logits.clone(), rows)
            _ban_eos_early(logits, rows)
        if want_logprobs and mode.startswith("processed_"):
            procs = [processed_row(logits[i], row) for i, row in enumerate(rows)]
            u = uniform_draws(rows)
            tokens = [
                int(pr.argmax()) if row.params.greedy else draw_index(pr, float(u[i]))
                for i, (pr, row) in enumerate(zip(procs, rows, strict=True))
            ]
            stacked = torch.stack(procs)
            report = stacked.log_softmax(-1) if mode == "processed_logprobs" else stacked
        else:
            tokens = self._tokens(logits, rows)
        lps: list[TokenLogprobs | None] = []
        for i, row in enumerate(rows):
            n = row.params.logprobs
            lps.append(
                compute_logprobs(report[i], tokens[i], n) if report is not None and n is not None else None
            )
        return SamplerOutput(tokens, lps)

    def _tokens(self, logits: Tensor, rows: list[SamplingRow]) -> list[int]:  # logits: [S, V] fp32
        """Greedy rows by argmax, the others by their filters and one uniform draw each."""
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        cpu_fp32 = logits.device.type == "cpu" and logits.dtype == torch.float32
        tokens: list[int] = []
        if len(sampled) < len(rows):
            fast = self.argmax is not None and cpu_fp32
            tokens = (self.argmax(logits.contiguous()) if fast else logits.argmax(-1)).tolist()  # type: ignore[misc]
        if not sampled:
            return tokens
        if not tokens:
            tokens = [0] * len(rows)
        picked = [rows[i] for i in sampled]
        u = uniform_draws(picked)
        if self.cpu_sampling is not None and cpu_fp32:
            p = [r.params for r in picked]
            vocab = logits.shape[1]  # a top_k past the vocabulary keeps it all (and may not fit int32)
            filters = RowFilters.of(
                [x.temperature for x in p],
                [min(x.top_k, vocab) for x in p],
                [max(x.top_p, _TOP_P_MIN) for x in p],
                [x.min_p for x in p],
            )
            ids = None if len(sampled) == len(rows) else torch.tensor(sampled, dtype=torch.int64)
            drawn = self.cpu_sampling.sample_rows(logits.contiguous(), ids, filters, u).tolist()
        else:
            drawn = [
                draw_index(processed_row(logits[i], rows[i]), float(u[j])) for j, i in enumerate(sampled)
            ]
        for i, token in zip(sampled, drawn, strict=True):
            tokens[i] = token
        return tokens
