"""Cumulative speculative-decoding counters with vLLM's meaning (`vllm:spec_decode_*`). No torch."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0  # verification rows (one per speculating request per step)
    num_draft_tokens: int = 0  # tokens proposed
    num_accepted_tokens: int = 0  # proposed tokens the target accepted (bonus tokens excluded)
    # accepted_per_pos[i]: drafts whose token at position i was accepted
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        assert 0 <= num_accepted <= num_draft_tokens
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification row (accepted + the target's own token), as vLLM logs it."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
