"""Which running requests speculate in the next step, and their draft tokens. No torch.

The `Speculator` decides who speculates and how many tokens it may propose; a `Proposer` (n-gram
lookup here, the draft model in `draft_model.py`) makes the tokens. Proposers that keep per-request
state (the draft model's KV cache) are told which requests are still running (`retain`) and which were
aborted between steps (`drop`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from server.request import Request
from server.spec_decode.config import SpeculativeConfig
from server.spec_decode.ngram import NgramProposer


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], max_ks: Sequence[int]) -> list[list[int]]:
        """Up to max_ks[i] draft tokens for requests[i], each request in decode."""
        ...

    def retain(self, request_ids: set[str]) -> None:
        """Forget (free) the state of every request not in request_ids."""
        ...

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget (free) the state of these requests."""
        ...


def can_speculate(req: Request) -> bool:
    """Requests whose step output is one token with per-token side data keep plain decoding:
    logprobs are reported one token per step; a grammar's bitmask is applied to one row per step
    (drafts would bypass it)."""
    p = req.sampling_params
    return p.logprobs is None and not p.prompt_logprobs and p.structured is None


class Speculator:
    """Sets `spec_token_ids` on running requests after each step; the scheduler verifies them in the
    next one. `proposer` defaults to n-gram lookup (the draft model is built by the engine)."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        if proposer is None:
            if config.method != "ngram":
                raise ValueError(f"the {config.method} method needs its proposer")
            proposer = NgramProposer(
                config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
            )
        self.proposer: Proposer = proposer

    def propose(self, running: Sequence[Request]) -> None:
        self.proposer.retain({r.request_id for r in running})
        limit = self.config.disable_by_batch_size
        enabled = limit is None or len(running) <= limit
        chosen: list[Request] = []
        rooms: list[int] = []
        for req in running:
            req.spec_token_ids = []
            # Only a request in decode (its KV covers all but the last known token) can verify drafts.
            if not enabled or req.num_tokens - req.num_computed_tokens != 1 or not can_speculate(req):
                continue
            room = req.sampling_params.max_tokens - len(req.output_token_ids) - 1
            if room > 0:
                chosen.append(req)
                rooms.append(room)
        if chosen:
            for req, drafts in zip(chosen, self.proposer.propose(chosen, rooms), strict=True):
                req.spec_token_ids = drafts

    def drop(self, request_id: str) -> None:
        """A request aborted between steps: its proposer state (draft KV blocks) is freed now."""
        self.proposer.drop([request_id])
