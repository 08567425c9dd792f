"""The cost bound of a burst step: while queued prompts are admitted beside decoding streams (the
scheduler's burst rule, server/core/scheduler.py), how many prompt tokens one step may take so that it
costs at most `itl_factor` quiet decode steps of as many streams (issue 49 items 2-3).

Plain Python, no torch. The engine reports every step's shape and wall seconds (`observe`); the scheduler
asks `tokens(decodes)` in a burst step. The model is a line in the step's rows, t = a + c x (decodes +
prompt tokens), fitted by least squares over the last `window` steps that carried prompt tokens (a: the
per-step weight read and overhead; c: a row's share of the GEMMs); with one such step, or rows that
varied too little, a = 0 and c is the median seconds per row, which overstates c and so errs towards
smaller steps until the next step measures more. The quiet step d of D decodes is the median of the
last `window` decode-only steps of D's power-of-two bucket where measured, else a + c x D (a burst
never leaves a quiet step to measure: every step of it carries prompts). The bound is
(min(f x d, s) - a) / c - D prompt tokens (s: `itl_seconds`, 0 = f alone); None until a step with
prompt tokens was measured.

Why f quiet steps: a burst step of f quiet steps spends at most 1/f of its time on what a
quiet step costs anyway, so splitting a burst into such steps delivers its prompts' first tokens at no
less than (f - 1)/f of the whole-budget burst's prefill rate (the last prompt's TTFT grows by at most
f/(f - 1), 1.33x at 4), while a running stream waits at most f quiet steps for its next token instead
of a whole-budget step: on the Llama-3.2-1B shape on 2 cores a 2,048-token step took ~16 s beside
streams whose quiet step is a few hundred ms (ITL p99 16 s at 64 users, docs/benchmarks-log.md,
"Real-shape loads: proving runs under load"). vLLM fills its budget (no such bound); the scheduler never
bounds a burst below its ordinary prefill cap.

The default f is 16 (`--burst-itl-factor`, server/config.py), not 4: on the Llama-3.2-1B Q4_K_M shape on
2 cores at f = 4 (64 users x
128-token prompts, 16 new tokens, one round under load) ITL p99 fell 15.8 -> 3.3 s but TTFT p50 rose 33 ->
59 s and throughput fell 18.5 -> 9.8 tok/s: the bound fell to the 128-token cap, and small mixed steps
cost more per row than the line (one a, one c for every size) says, so the 4/3 argument above does not
hold there. At f = 16 (same load, load average 2) ITL p99 8.4 -> 2.2 s, TTFT p50 17.3 -> 15.0 s, throughput
27.5 -> 27.2 tok/s (docs/benchmarks-log.md, "A burst step bounded by its measured cost").

Why seconds too (`--burst-itl-seconds` s, default 0.5): f x d grows with the streams. A burst step holds
the next token of every one of the D running streams, and a burst over many streams lasts many steps
(each admits what the bound allows), so at 64 users nearly every ITL sample past the median is a burst
step: with f = 16 and a ~110 ms quiet 64-stream step on the Llama-3.2-1B Q4_K_M shape a burst step
cost ~1.8 s, and ITL p99 was 1.83 s at 64 users and 2.03 s at 128 queued against llama-server's
0.24-0.26 s (docs/benchmarks.md). Capping the step at s seconds bounds that wait in the unit ITL is
read in, whatever D is; a shrinking f (f / D) would do the same less directly. The TTFT cost is
f's argument again: a step of t seconds spends a + c x D of it on what a quiet step costs anyway, so a
burst's prefill rate is (1 - d / t) / c prompt tokens a second, (1 - d / s) / (1 - 1 / f) of f's
(0.83x at s = 0.5 s, d = 0.11 s); where s falls below a step with the ordinary cap the cap wins (the
scheduler never bounds a burst below it). 0.5 s: measured
in docs/benchmarks-log.md, "A burst step bounded in seconds".
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from server.core.prefill_cap import StepShape, decode_bucket, fit_line


@dataclass(frozen=True)
class BurstBoundConfig:
    itl_factor: float = 16.0  # f: a burst step may cost f quiet decode steps of as many streams
    # s: and at most this many seconds (module docstring, "Why seconds too"); 0 = the factor alone
    itl_seconds: float = 0.5
    window: int = 16  # steps per fit / median

    def __post_init__(self) -> None:
        if not self.itl_factor > 1.0:
            raise ValueError(f"itl_factor must be > 1, got {self.itl_factor}")
        if not (self.itl_seconds == 0 or (math.isfinite(self.itl_seconds) and self.itl_seconds > 0)):
            raise ValueError(f"itl_seconds must be 0 (off) or > 0, got {self.itl_seconds}")
        if self.window < 2:
            raise ValueError(f"window must be >= 2, got {self.window}")


class BurstBound:
    def __init__(self, config: BurstBoundConfig) -> None:
        self.config = config
        self._quiet: dict[int, deque[float]] = {}  # bucket -> decode-only step seconds
        self._prompt_steps: deque[tuple[int, float]] = deque(maxlen=config.window)  # (rows, seconds)

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Record one step's shape and wall seconds."""
        if not seconds > 0:
            return
        if shape.prompt_tokens:
            self._prompt_steps.append((shape.decodes + shape.prompt_tokens, seconds))
        elif shape.decodes:
            self._quiet.setdefault(decode_bucket(shape.decodes), deque(maxlen=self.config.window)).append(
                seconds
            )

    def line(self) -> tuple[float, float] | None:
        """(a, c): a step carrying prompt tokens costs a + c x rows seconds; None if none measured."""
        rows = list(self._prompt_steps)
        if not rows:
            return None
        fitted = fit_line(rows, min_points=2)
        if fitted is not None:
            return fitted
        return 0.0, max(statistics.median(t / n for n, t in rows), 1e-12)

    def tokens(self, decodes: int) -> int | None:
        """Prompt tokens a burst step beside `decodes` decode rows may take (>= 0), or None while
        unmeasured."""
        fit = self.line()
        if fit is None:
            return None
        a, c = fit
        quiet = self._quiet.get(decode_bucket(max(decodes, 1)))
        d = statistics.median(quiet) if quiet else a + c * decodes
        seconds = self.config.itl_factor * d
        if self.config.itl_seconds:
            seconds = min(seconds, self.config.itl_seconds)
        return max(int((seconds - a) / c) - decodes, 0)
