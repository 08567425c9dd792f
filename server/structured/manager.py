"""Per-request grammar state for the worker: one xgrammar matcher per constrained request, advanced
lazily from the request's own output tokens, and the token bitmask applied to constrained logits rows.

The request's output_token_ids are the source of truth: before each mask, a matcher accepts the tokens
it has not seen yet. So the state survives preemption by recompute unchanged (or is rebuilt from the
output tokens if it was dropped), and chunked prefill, which samples only on a prompt's last chunk,
needs nothing special.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from server.request import Request
from server.structured.compiler import GrammarCompiler


@dataclass
class _State:
    matcher: Any  # xgrammar.GrammarMatcher
    num_accepted: int = 0  # output tokens the matcher accepted, counted from `start`
    start: int | None = None  # output position where the grammar starts; None: its marker not seen yet
    scanned: int = 0  # output positions already searched for the marker


def _find_start(state: _State, marker: tuple[int, ...], out: list[int]) -> None:
    """Sets state.start to the position after the first occurrence of `marker` in `out`, if any."""
    n = len(marker)
    for i in range(max(0, state.scanned - n + 1), len(out) - n + 1):
        if tuple(out[i : i + n]) == marker:
            state.start = i + n
            return
    state.scanned = len(out)


@dataclass
class MaskStats:
    """Cumulative: steps that applied a mask, rows masked, and wall seconds spent (fill + apply)."""

    steps: int = 0
    rows: int = 0
    seconds: float = 0.0


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.vocab_size = compiler.vocab_size
        self._states: dict[str, _State] = {}
        self._bitmask: Tensor | None = None  # [rows, ceil(V / 32)] int32, grown on demand
        self.stats = MaskStats()

    @property
    def num_active(self) -> int:
        return len(self._states)

    def drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._states.pop(rid, None)

    def _state(self, req: Request) -> _State | None:
        """The request's matcher, synced with its output; None while the grammar has not started
        (its `start_after` marker is not in the output yet): the row is free."""
        import xgrammar as xgr

        spec = req.sampling_params.structured
        assert spec is not None
        state = self._states.get(req.request_id)
        if state is None:
            state = _State(
                xgr.GrammarMatcher(self.compiler.compile(spec)), start=None if spec.start_after else 0
            )
            self._states[req.request_id] = state
        out = req.output_token_ids
        if state.start is None:
            _find_start(state, spec.start_after, out)
            if state.start is None:
                return None
        while state.start + state.num_accepted < len(out):
            pos = state.start + state.num_accepted
            if not state.matcher.accept_token(out[pos]):
                raise ValueError(f"token {out[pos]} at output position {pos} breaks the grammar")
            state.num_accepted += 1
        if state.matcher.is_terminated():
            raise ValueError("the grammar is complete but the request continues")
        return state

    def apply(self, logits: Tensor, requests: list[Request]) -> dict[str, str]:  # logits: [S, V] fp32
        """Sets the logits of tokens each constrained row's grammar forbids to -inf, in place (row i
        belongs to requests[i]; unconstrained rows are untouched). Returns {request_id: error} for rows
        whose grammar state failed: the caller fails those requests and must not sample their rows."""
        rows = [i for i, r in enumerate(requests) if r.sampling_params.structured is not None]
        errors: dict[str, str] = {}
        if not rows:
            return errors
        t0 = time.perf_counter()
        words = (self.vocab_size + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < logits.shape[0]:
            self._bitmask = torch.full((max(logits.shape[0], 16), words), -1, dtype=torch.int32)
        bitmask = self._bitmask
        masked: list[int] = []
        for i in rows:
            req = requests[i]
            try:
                state = self._state(req)
                if state is None:
                    continue
                state.matcher.fill_next_token_bitmask(bitmask, i)
                masked.append(i)
            except Exception as e:  # one request's grammar must not take the batch down
                self._states.pop(req.request_id, None)
                errors[req.request_id] = f"structured output failed: {type(e).__name__}: {e}"
        if masked:
            import xgrammar as xgr

            xgr.apply_token_bitmask_inplace(
                logits,
                bitmask[: logits.shape[0]].to(logits.device),
                vocab_size=logits.shape[1],
                indices=masked,
            )
        self.stats.steps += 1
        self.stats.rows += len(masked)
        self.stats.seconds += time.perf_counter() - t0
        return errors
