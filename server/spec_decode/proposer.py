"""Which running requests speculate in the next step, and their draft tokens. No torch."""

from __future__ import annotations

from collections.abc import Sequence

from server.request import Request
from server.spec_decode.config import SpeculativeConfig
from server.spec_decode.ngram import NgramProposer


def can_speculate(req: Request) -> bool:
    """Requests whose step output is one token with per-token side data keep plain decoding:
    logprobs are reported one token per step; a grammar's bitmask is applied to one row per step
    (drafts would bypass it)."""
    p = req.sampling_params
    return p.logprobs is None and not p.prompt_logprobs and p.structured is None


class Speculator:
    """Sets `spec_token_ids` on running requests after each step; the scheduler verifies them in the
    next one."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer = NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )

    def propose(self, running: Sequence[Request]) -> None:
        limit = self.config.disable_by_batch_size
        enabled = limit is None or len(running) <= limit
        for req in running:
            req.spec_token_ids = []
            # Only a request in decode (its KV covers all but the last known token) can verify drafts.
            if not enabled or req.num_tokens - req.num_computed_tokens != 1 or not can_speculate(req):
                continue
            room = req.sampling_params.max_tokens - len(req.output_token_ids) - 1
            if room > 0:
                req.spec_token_ids = self.proposer.propose(req.all_token_ids, room)
