"""How many intra-op threads each engine step runs with (generation and pooling alike): the count that has
been fastest for steps of that size, measured on this machine while serving.

Why: an encoder step is ~100 small ops and a decode step of the embedded SmolLM2 ~300, each an OpenMP
parallel region ending in a barrier. When the
process gets its cores to itself, `--num-threads` threads are the fastest; when other processes share
the cores (a node's neighbours, the HTTP clients of a benchmark, the server's own event loop), every
barrier waits for whichever thread the kernel has descheduled and a step runs several times slower
than on one thread. Measured on a 2-core AMD EPYC at load average 5 (all-MiniLM-L6-v2, fp32): one
42-token text 92 ms on 2 threads, 20 ms on 1; 64 texts (2140 tokens) 1287 ms on 2, 734 ms on 1. The
16-row decode step of the embedded SmolLM2 at load average 3-5: 316 ms wall (227 ms CPU) on 2 threads,
98 ms on 1. Which
regime holds changes with the load, so it is measured, not configured.

Rule: steps are bucketed by their token count (powers of two); per bucket and thread count the median
of the last `window` (5) samples of wall seconds per token is kept (a median, not a mean: a step that
lost its core to our event loop or a neighbour is an outlier, and a few of them must not hand the place
to the slower count). A step runs with the count of the lowest median. A bucket never seen starts on the best
count of the nearest bucket that has measured every count (its other counts wait for its regular probes:
trying one thread first on a 2048-token prefill cost every waiting request a second), unless that count's
cost there says this step takes `long_step_s` or more: a short step's lead does not carry over to a long,
GEMM-bound one, which starts as in a bucket without a hint, and a long size hinted all the same gets one
sample on `max_threads` as soon as its first step shows it long; while no bucket has,
a count never tried in its bucket is tried first, the largest first (not where the bucket's steps take
`long_step_s`, 0.1 s, or more on their best count: there the others wait for the regular probes). Every
`explore_every`-th step of a bucket tries the next other count in turn for two steps, so a change of load
is noticed. The first step run
on a count other than the previous step's is never recorded: waking sleeping workers and refilling
caches would make every probe of a count look slower than it is (seen: an idle machine kept probing two
threads from one and settling on one, at 0.75-0.87x of fixed two threads at one user), unless it took
`long_step_s` or more: a switch's cost (microseconds to a few ms) is nothing beside it, and a long step
size that always follows steps of another size (a 16-user wave's one prefill between 63 decode steps)
would otherwise never be sampled on its untried count and try it again at every wave (seen: each
wave's 2048-token prefill on one thread, 3.0 s against 1.7-1.9 s). Nor where a count has no fair sample in
its bucket yet: its second switched step there stands in until the first fair one replaces it, since a
size whose steps always follow another size's on another count would otherwise never be sampled on it
and run it every time (seen: a sequential client's shorter texts on one thread, 85 ms against 48 on
two). A long step's time is also its
count's whole sample window (it spans many preemptions already), and a probe's long first step ends
the probe. With `max_explore_every` above
`explore_every`, each exploration that leaves the best count unchanged doubles that bucket's interval
up to the maximum and one that changes it resets the interval (generation: 16 to 256 steps, so that a
slow probe of the wrong count lands in fewer than 1% of a stream's inter-token gaps); a best count that
loses its place through its own samples (a few slow steps) resets the interval, so a passing disturbance
cannot keep the slower count for hundreds of steps. Candidates: 1, the powers of two
below `max_threads`, and `max_threads`; only `max_threads` under `--thread-policy fixed`.

A step's result may depend on its thread count (the attention kernel splits long contexts by it, oneDNN
picks its blocking by it): outputs are the same up to float rounding, so a near-tie of greedy decoding
can go either way under load. `--thread-policy fixed` keeps the count, and the result, fixed.

Plain Python, no torch: the engine sets the count (`torch.set_num_threads`) and reports the time.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


def _candidates(max_threads: int) -> tuple[int, ...]:
    counts = {max_threads}
    k = 1
    while k < max_threads:
        counts.add(k)
        k *= 2
    return tuple(sorted(counts))


@dataclass
class _Bucket:
    cost: dict[int, float] = field(default_factory=dict)  # threads -> median seconds per token
    samples: dict[int, deque[float]] = field(default_factory=dict)  # threads -> the last window samples
    steps: int = 0
    explored: int = 0  # how many exploration steps this bucket has taken (rotates the candidates)
    interval: int = 0  # steps between explorations (0: not set yet)
    next_explore: int = 0  # the step number of the next exploration
    probe: tuple[int, int] | None = None  # (best before, count tried) of the exploration in flight
    probe_left: int = 0  # steps of the probe still to run
    hinted: bool = False  # started on another bucket's best count: untried counts wait for probes
    fair: set[int] = field(default_factory=set)  # counts with a sample not taken right after a switch
    switched_tries: dict[int, int] = field(default_factory=dict)  # counts' unrecorded switched steps


def _leader(b: _Bucket) -> int:
    """The bucket's count of the lowest cost (the larger count on a tie); the bucket has a cost."""
    return min(b.cost, key=lambda t: (b.cost[t], -t))


class StepThreads:
    """Chooses each step's thread count from measured step times (see the module docstring).

    `choose(num_tokens)` -> threads for a step of that many (padded) tokens; `record(num_tokens,
    threads, seconds)` after the step. Raises ValueError for `max_threads` < 1, `explore_every` < 2 or
    `window` < 1. `adaptive=False`: always `max_threads`. `hint_new_buckets=False`: a new step size
    starts on the largest count (untried counts first, the largest first), never on another size's best
    (the pooling engine's choice: its short and long steps differ in cost by ~100x, and a long BERT-large
    step is GEMM-bound, where one thread's lead on short steps does not carry over)."""

    def __init__(
        self,
        max_threads: int,
        explore_every: int = 16,
        window: int = 5,
        adaptive: bool = True,
        max_explore_every: int | None = None,
        long_step_s: float = 0.1,
        hint_new_buckets: bool = True,
    ) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        if explore_every < 2:
            raise ValueError(f"explore_every must be >= 2, got {explore_every}")
        if max_explore_every is not None and max_explore_every < explore_every:
            raise ValueError(f"max_explore_every must be >= explore_every, got {max_explore_every}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if long_step_s <= 0:
            raise ValueError(f"long_step_s must be > 0, got {long_step_s}")
        self.max_threads = max_threads
        self.candidates = _candidates(max_threads) if adaptive else (max_threads,)
        self.explore_every = explore_every
        self.max_explore_every = max_explore_every or explore_every
        self.window = window
        self.long_step_s = long_step_s
        self.hint_new_buckets = hint_new_buckets
        self._buckets: dict[int, _Bucket] = {}
        self.last_threads = max_threads
        self._switched = False  # the step being run changed the count: its time is not a fair sample

    @staticmethod
    def bucket_of(num_tokens: int) -> int:
        return max(1, num_tokens).bit_length()

    def _hint(self, key: int, num_tokens: int) -> int | None:
        """The best count of the nearest bucket (the larger on a tie) that has measured every candidate;
        None where there is none, or where its best cost says a step of `num_tokens` takes `long_step_s`
        or more: a short step's lead does not carry over to a long, GEMM-bound one (seen: a server that
        started beside another's load measured one thread faster for its warm-up's one-row decode, and
        every 2,048-token prefill of its runs then took one thread, TTFT 27 s against 14 s on two)."""
        full = [k for k, b in self._buckets.items() if len(b.cost) == len(self.candidates)]
        if not full:
            return None
        nearest = self._buckets[min(full, key=lambda k: (abs(k - key), -k))]
        return None if self._long(nearest, num_tokens) else _leader(nearest)

    def best(self, num_tokens: int) -> int | None:
        """The count with the lowest measured cost for steps of this size; None before any record."""
        b = self._buckets.get(self.bucket_of(num_tokens))
        if b is None or not b.cost:
            return None
        return _leader(b)

    def choose(self, num_tokens: int) -> int:
        if len(self.candidates) == 1:
            return self.candidates[0]
        key = self.bucket_of(num_tokens)
        b = self._buckets.setdefault(key, _Bucket())
        b.steps += 1
        if not b.interval:
            b.interval = b.next_explore = self.explore_every
        untried = [t for t in reversed(self.candidates) if t not in b.cost]
        hint = self._hint(key, num_tokens) if untried and not b.cost and self.hint_new_buckets else None
        if hint is not None:
            # A new step size starts on the count that leads for the nearest size measured with every
            # count; the others wait for this bucket's regular probes. Trying each count first costs
            # most where steps are longest: one thread on the first 2048-token prefill held every
            # waiting request's first token by a second (TTFT p50 2.5 s against 0.7 s with two).
            b.hinted = True
            threads = hint
        elif untried and not (b.hinted and b.cost) and not self._long(b, num_tokens):
            threads = untried[0]  # the largest first: the right count on an idle machine
        elif self.max_threads in untried and self._long(b, num_tokens):
            # a hint that turned out long: a long step size always gets one sample on the largest count
            # (a switch costs nothing beside it, and it is the count a GEMM-bound step wants)
            threads = self.max_threads
        elif b.probe is not None and b.probe_left > 0:
            threads = b.probe[1]
            b.probe_left -= 1
        else:
            threads = _leader(b)
            if b.steps >= b.next_explore:
                others = [t for t in self.candidates if t != threads]
                best, threads = threads, others[b.explored % len(others)]
                b.explored += 1
                # two steps: the first after a change of count pays for it (workers waking, caches)
                # and is not recorded, the second is the sample
                b.probe, b.probe_left = (best, threads), 1
                b.next_explore = b.steps + b.interval
        self._switched = threads != self.last_threads
        self.last_threads = threads
        return threads

    def _long(self, b: _Bucket, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` takes `long_step_s` or more at bucket b's best cost per token
        so far (b: the step's own bucket, or the nearest one a hint would come from)."""
        return bool(b.cost) and min(b.cost.values()) * max(1, num_tokens) >= self.long_step_s

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        if threads not in self.candidates or seconds < 0:
            return  # a count set outside the policy (warm-up) says nothing about the candidates
        b = self._buckets.setdefault(self.bucket_of(num_tokens), _Bucket())
        fair = not self._switched or seconds >= self.long_step_s
        if not fair:
            # The first step on a new count: its time includes the switch, not a fair sample. But where
            # this size's steps always follow another size's on another count (a sequential client's
            # texts of varying length, each size in its own bucket), a count never gets a fair sample:
            # it stayed untried and ran every step of its size (seen: 1 of 4 one-text steps of a
            # Qwen3-Embedding-0.6B shape on one thread, 85 ms against 48). A count without a fair sample
            # takes its second such step as a stand-in, replaced by the first fair one.
            if threads in b.fair:
                return
            b.switched_tries[threads] = b.switched_tries.get(threads, 0) + 1
            if b.switched_tries[threads] < 2:
                return
        if self._switched and b.probe is not None and b.probe[1] == threads:
            b.probe_left = 0  # a long step is a fair sample by itself: the probe needs no second step
        per_token = seconds / max(1, num_tokens)
        leader = _leader(b) if b.cost else None
        samples = b.samples.setdefault(threads, deque(maxlen=self.window))
        if fair and threads not in b.fair:
            b.fair.add(threads)
            samples.clear()  # the stand-ins give way to the first fair sample
        if seconds >= self.long_step_s:
            samples.clear()  # a long step is its own median: its time already spans many preemptions
        samples.append(per_token)
        b.cost[threads] = statistics.median(samples)
        if threads == leader and _leader(b) != leader and b.probe is None:
            # the best count changed by its own samples (a few slow steps while our event loop or a
            # neighbour took its core): probe the others again soon, not after a backed-off interval
            b.interval = self.explore_every
            b.next_explore = b.steps + b.interval
        if b.probe is not None and b.probe[1] == threads and b.probe_left == 0:
            best_before = b.probe[0]
            b.probe = None
            best = _leader(b)
            # the probe confirmed the best count: probe less often; it found a better one: probe soon
            b.interval = (
                min(2 * b.interval, self.max_explore_every) if best == best_before else self.explore_every
            )
            b.next_explore = b.steps + b.interval
