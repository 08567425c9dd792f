"""The prefill share cap sized from measured step costs: while streams decode, how many prompt tokens one
engine step may take so that the step costs at most `itl_factor` times a decode-only step of as many
streams (issue 49's target: a running stream's ITL during another's 8k prefill <= 2x its quiet ITL).

Plain Python, no torch. The engine reports every step's shape and wall seconds (`observe`); the scheduler
asks `cap(decodes)` once per step. Per decode-count bucket (powers of two) the median of the last
`window` decode-only steps is the quiet step `d`; over the last `window` steps that carried prompt tokens
beside decodes, `t - d = o + c * P` (prompt tokens P) is fitted by least squares when P varied enough,
else `o = 0` and `c` is the median of `(t - d) / P`. The cap is `((f - 1) d - o) / c` within
[`min_tokens`, `max_tokens`] and at most twice the largest chunk in the window (a line fitted over
short chunks says little about long ones: the cap grows step by step). A fixed per-step overhead o
comes off what the chunk may cost, and a step's cost per prompt token grows with the prompt's context
(attention is O(chunk x context)), which the window follows as the prefill goes on. Until both are
measured the cap is `initial`.

Long prefills only (`PrefillCapConfig.min_prompt_tokens`; on CPU by default: factor 2 for prompts of more
uncached tokens than the step's token budget, EngineConfig.prefill_itl_factor_for and
prefill_itl_min_tokens_for): the scheduler gives the measured cap to the chunks of a prompt admitted with
more uncached tokens than that, every chunk until its prefill ends, and keeps the fixed
`long_prefill_token_threshold` for shorter prompts (never more than it for long ones). A prompt longer than
the budget holds the streams for its whole prefill, tens of seconds at 8k, which is what a stream's ITL p99
sees. Llama-3.2-1B Q4_K_M on a 2-core Zen 5, quiet (docs/benchmarks-log.md, "The measured cap for long
prefills only"): four 8,192-token prompts at once, a stream's ITL p99 during another's prefill 10.1x its
quiet p99 under the fixed 128-token share, 1.79x under the measured cap, TTFT p50 0.99x. Shorter prompts
pay more for it than they gain: eight 2,048-token prompts at once under the cap (then from 1,024 tokens)
had 5x lower ITL p99 during prefill but 1.25x the TTFT p50 and 0.82x the output rate; 64 users' 128-token
prompts (under the every-prompt cap) 2.3x the TTFT p50. With `min_prompt_tokens` 0 it governs every
prompt, instead of the fixed threshold (`--prefill-itl-min-tokens 0`). On the 2-core Zen 4 a step that
carries prompt tokens cost, before any of them, about one quiet one-stream decode step more (the decode
graph serves pure decode steps only; the mixed step runs the layer loop from Python), so 2x was out of
reach there and the cap sat at its floor, halving a long prompt's prefill rate beside a stream.

Why measured rather than a constant: the cost of a prompt token against a decode step differs by model,
context length, CPU, thread count and load (the embedded 135M on a 2-core Zen 4: 0.65 ms per prompt
token at 2k context, ~1.6 at 8k, against a 9-16 ms one-stream decode step; docs/benchmarks-log.md, "Long
prompts: the prefill cap from measured step costs"). The trade-off is the long prompt's TTFT: fewer
prompt tokens per step means more steps, each also paying the decodes and the step overhead (vLLM
bounds a request's chunk with `--long-prefill-token-threshold`, a constant).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from server.core.outputs import SchedulerOutput


@dataclass(frozen=True)
class PrefillCapConfig:
    itl_factor: float = 2.0  # f: a step with prompt tokens may cost f x a decode-only step
    initial: int = 128  # the cap before both costs are measured
    min_tokens: int = 16  # floor: a long prompt still advances when the target is out of reach
    max_tokens: int = 2048  # ceiling (the step's token budget)
    window: int = 8  # steps per median / fit
    # The cap governs long prefills only: prompts admitted with more than this many uncached tokens (their
    # chunks, however many, until the prefill ends); shorter ones keep the fixed cap. 0: every prefill (the
    # measured cap replaces the fixed one). Why: module docstring, "Long prefills only".
    min_prompt_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.itl_factor > 1.0:
            raise ValueError(f"itl_factor must be > 1, got {self.itl_factor}")
        if self.min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {self.min_tokens}")
        if self.max_tokens < self.min_tokens:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be >= min_tokens ({self.min_tokens})")
        if not self.min_tokens <= self.initial <= self.max_tokens:
            raise ValueError(f"initial must be in [{self.min_tokens}, {self.max_tokens}], got {self.initial}")
        if self.window < 2:
            raise ValueError(f"window must be >= 2, got {self.window}")
        if self.min_prompt_tokens < 0:
            raise ValueError(f"min_prompt_tokens must be >= 0, got {self.min_prompt_tokens}")


@dataclass(frozen=True)
class StepShape:
    """What a step computed: decode rows (one known token, drafts aside) and prompt tokens."""

    decodes: int
    prompt_tokens: int


def step_shape(out: SchedulerOutput) -> StepShape:
    decodes = prompt = 0
    for item in out.scheduled:
        new = item.num_new_tokens - len(item.spec_token_ids)
        if new == 1 and item.sample:
            decodes += 1
        else:
            prompt += new
    return StepShape(decodes, prompt)


def fit_line(points: list[tuple[int, float]], min_points: int) -> tuple[float, float] | None:
    """Least squares over (x, y) points: (intercept, slope), or None with fewer than `min_points`, x
    varying by less than 1.5x (a line over near-equal x says nothing of other x), a slope <= 0 or an
    intercept < 0 (a step's cost grows with its tokens from a non-negative overhead)."""
    xs = [x for x, _ in points]
    if len(points) < min_points or max(xs) < 1.5 * min(xs):
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(y for _, y in points)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in points) / var
    intercept = my - slope * mx
    return (intercept, slope) if slope > 0 and intercept >= 0 else None


def decode_bucket(decodes: int) -> int:
    """The power-of-two bucket (1, 2, 4, 8, ...) quiet decode steps are kept under."""
    return 1 << (decodes - 1).bit_length()


class AdaptivePrefillCap:
    def __init__(self, config: PrefillCapConfig) -> None:
        self.config = config
        self._quiet: dict[int, deque[float]] = {}  # bucket -> decode-only step seconds
        self._mixed: deque[tuple[int, int, float]] = deque(maxlen=config.window)  # (decodes, P, seconds)

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Record one step's shape and wall seconds (steps without decodes say nothing here)."""
        if shape.decodes == 0 or not seconds > 0:
            return
        if shape.prompt_tokens == 0:
            q = self._quiet.setdefault(decode_bucket(shape.decodes), deque(maxlen=self.config.window))
            q.append(seconds)
        else:
            self._mixed.append((shape.decodes, shape.prompt_tokens, seconds))

    def quiet_seconds(self, decodes: int) -> float | None:
        """Median decode-only step seconds for this many decodes (the nearest measured bucket)."""
        if not self._quiet:
            return None
        b = decode_bucket(max(decodes, 1))
        nearest = min(self._quiet, key=lambda k: (abs(k.bit_length() - b.bit_length()), k))
        return statistics.median(self._quiet[nearest])

    def prompt_cost(self) -> tuple[float, float] | None:
        """(o, c): a mixed step's seconds beyond its decodes' quiet step, o + c per prompt token."""
        rows: list[tuple[int, float]] = []
        for decodes, p, t in self._mixed:
            d = self.quiet_seconds(decodes)
            if d is not None:
                rows.append((p, t - d))
        if not rows:
            return None
        fitted = fit_line(rows, min_points=3)
        if fitted is not None:
            return fitted
        c = statistics.median(e / p for p, e in rows)
        return 0.0, max(c, 1e-9)

    def cap(self, decodes: int) -> int:
        """Prompt tokens a step beside `decodes` decode rows may take."""
        cfg = self.config
        d = self.quiet_seconds(decodes)
        cost = self.prompt_cost()
        if d is None or cost is None:
            return cfg.initial
        o, c = cost
        tokens = ((cfg.itl_factor - 1.0) * d - o) / c
        # The fit holds where it was measured: grow at most 2x past the largest chunk in the window.
        tokens = min(tokens, 2 * max(p for _, p, _ in self._mixed))
        return int(min(max(tokens, cfg.min_tokens), cfg.max_tokens))
