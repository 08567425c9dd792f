"""N-gram prompt lookup (Saxena, "Prompt Lookup Decoding", 2023; vLLM's `ngram` method). No torch.

The last n tokens of a sequence (n from prompt_lookup_max down to prompt_lookup_min) are searched for
earlier in the same sequence (prompt and output); the tokens that followed the earliest match are the
proposal. Text that quotes or edits its prompt (summaries, code edits, extraction) repeats long runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from server.request import Request


def propose_ngram(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the earliest earlier occurrence of the sequence's longest matching
    suffix of length in [min_n, max_n]; [] when no suffix of those lengths occurs earlier."""
    total = len(token_ids)
    tokens = list(token_ids)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        pattern = tokens[total - n :]
        first = pattern[0]
        # Matches must end before the suffix itself so that at least one token follows them.
        last_start = total - n - 1
        i = 0
        while True:
            try:
                i = tokens.index(first, i, last_start + 1)
            except ValueError:
                break
            if tokens[i : i + n] == pattern:
                return tokens[i + n : i + n + k]
            i += 1
    return []


class NgramProposer:
    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, requests: Sequence[Request], max_ks: Sequence[int]) -> list[list[int]]:
        return [
            propose_ngram(req.all_token_ids, min(self.k, max_k), self.min_n, self.max_n)
            for req, max_k in zip(requests, max_ks, strict=True)
        ]

    def retain(self, request_ids: set[str]) -> None:
        """Stateless: nothing to forget."""

    def drop(self, request_ids: Iterable[str]) -> None:
        """Stateless: nothing to forget."""
