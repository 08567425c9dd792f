"""Verification of draft tokens against the target model's logits: exact acceptance.

Greedy rows accept the longest prefix of the drafts that equals the target's argmax, then add the
target's own token at the first mismatch (or after the last draft: the bonus token), so the output is
token for token what plain greedy decoding gives.

Sampled rows use speculative sampling (Leviathan et al., "Fast Inference from Transformers via
Speculative Decoding", 2023; Chen et al., 2023): draft token x at position j is accepted with
probability min(1, p_j(x) / q_j(x)); on rejection the token is drawn from normalize(max(p_j - q_j, 0));
when all k drafts are accepted a bonus token is drawn from p_k. The emitted tokens are then distributed
exactly as sampling from the target. p_j is the target's distribution after the same processing the
plain sampler applies (penalties over the sequence including drafts 0..j-1, EOS banned before
min_tokens, temperature, top-k, top-p, min-p). The n-gram proposer is deterministic, so q_j is a point
mass on x: acceptance probability p_j(x), residual p_j with x removed.

Per-request seeds: the uniform draw and the residual's noise at output position i come from a
generator seeded by (seed, i), and the bonus token uses the plain sampler's own (seed, i) noise, so a
seeded request gives the same text whatever runs beside it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from server.request import Request
from server.worker.sampler import (
    _MASK64,
    SamplingRow,
    _ban_eos_early,
    apply_penalties,
    processed_row,
    sample_row,
)

_SALT = 0x5EC0DE


def _at_position(req: Request, drafts: Sequence[int]) -> Request:
    """The request as the sampler would see it had the drafts already been generated."""
    if not drafts:
        return req
    return dataclasses.replace(req, output_token_ids=[*req.output_token_ids, *drafts])


def _generator(req: Request, device: torch.device) -> torch.Generator | None:
    seed = req.sampling_params.seed
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(((seed * 1_000_003 + len(req.output_token_ids)) ^ _SALT) & _MASK64)
    return g


def _residual(probs: Tensor, x: int) -> Tensor:  # probs: [V] -> [V], unnormalized
    """max(p - q, 0) for a point-mass draft q on token x."""
    residual = probs.clone()
    residual[x] = 0.0
    return residual


def verify_drafts(logits: Tensor, req: Request, drafts: Sequence[int]) -> list[int]:  # logits: [k+1, V] fp32
    """Tokens to append to the request: the accepted drafts, then one token of the target's own
    (1..k+1 tokens). logits[j] is the target's output after the last known token and drafts[:j]."""
    k = len(drafts)
    assert logits.shape[0] == k + 1
    params = req.sampling_params
    views = [_at_position(req, drafts[:j]) for j in range(k + 1)]
    rows = [SamplingRow(v) for v in views]
    logits = apply_penalties(logits.float().clone(), rows)
    _ban_eos_early(logits, rows)

    if params.greedy:
        target = logits.argmax(-1).tolist()
        out: list[int] = []
        for j in range(k):
            if drafts[j] != target[j]:
                break
            out.append(drafts[j])
        out.append(target[len(out)])
        return out

    out = []
    for j in range(k):
        probs = processed_row(logits[j], rows[j]).softmax(-1)  # [V]
        x = drafts[j]
        g = _generator(views[j], probs.device)
        u = torch.rand((), generator=g, device=probs.device)
        if u < probs[x]:
            out.append(x)
            continue
        residual = _residual(probs, x)
        # Exponential race over the unnormalized residual: argmax(r / E) samples r / sum(r).
        noise = torch.empty_like(residual).exponential_(generator=g)
        out.append(int((residual / noise).argmax()))
        return out
    out.append(sample_row(logits[k], rows[k]))
    return out
