"""The named loads of `benchmarks/real_shapes_served.py` (issue 49 item 2) and the client that measures
them: per-request stream timings, the inter-token latency of streams split by whether another request's
prompt was prefilling at the time, prefix-cache hit rates and the server's KV state after a run.

Loads (chat API, streaming, greedy, `ignore_eos`; prompt lengths count the chat template):

| name | users | requests | prompt | what it shows |
|---|---|---|---|---|
| `1_user`, `N_users` | N | max(min, N x per-user) | `--prompt-tokens` | throughput, TTFT, ITL |
| `64_users` | 64 | 64 x per-user | 128 | a full batch (ours' `--max-num-seqs` is 64) |
| `128_users_queued` | 128 | 128 | 128 | half queued behind `--max-num-seqs` / llama's slots: every request must complete, TTFT grows with the queue |
| `8_users_2048_prompt`, `8_users_8192_prompt` | 8 | 8 | 2,048 / 8,192 | TTFT of long prompts; the ITL of streams decoding while another's prompt prefills against their quiet ITL |
| `32_users_shared_prefix_2048` | 32 | 32 x per-user | 2,048 shared + 128 own | prefix caching: hit rate from /metrics (ours, vLLM) or the responses' `timings` (llama-server) |

Pure functions here are unit-tested (tests/models/test_real_shape_loads.py); the client needs a
server.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its neighbours, as when run as a script
from peers_side_by_side import GREEDY, one_stream
from peers_side_by_side import Result as Stream  # one streaming client for every benchmark


@dataclass(frozen=True)
class Load:
    """`users` concurrent users sending `requests` prompts of `prefix_tokens` shared tokens then
    `prompt_tokens` own ones (chat template included). `split_itl`: report the ITL split by other
    requests' prefill windows (the long-prompt loads)."""

    name: str
    users: int
    requests: int
    prompt_tokens: int
    prefix_tokens: int = 0
    split_itl: bool = False

    def __post_init__(self) -> None:
        if self.users < 1 or self.requests < 1 or self.prompt_tokens < 1 or self.prefix_tokens < 0:
            raise ValueError(f"load {self.name!r}: users, requests and prompt_tokens must be >= 1")

    def kv_tokens(self, max_tokens: int) -> int:
        """KV tokens the load holds at once if every user is admitted (the shared prefix once)."""
        return self.prefix_tokens + min(self.users, self.requests) * (self.prompt_tokens + max_tokens)

    @property
    def longest_prompt(self) -> int:
        return self.prefix_tokens + self.prompt_tokens


NAMED = (
    "64_users",
    "128_users_queued",
    "8_users_2048_prompt",
    "8_users_8192_prompt",
    "32_users_shared_prefix_2048",
)


def named_load(name: str, per_user: int, long_users: int = 8, prompt_tokens: int = 128) -> Load:
    """The load called `name` (NAMED). `long_users` replaces the 8 users of the long-prompt loads (the
    name keeps saying how many ran). Raises ValueError for an unknown name."""
    if name == "64_users":
        return Load(name, 64, 64 * per_user, prompt_tokens)
    if name == "128_users_queued":
        return Load(name, 128, 128, prompt_tokens)
    m = re.fullmatch(r"8_users_(\d+)_prompt", name)
    if m:
        n = long_users
        return Load(name if n == 8 else f"{n}_users_{m[1]}_prompt", n, n, int(m[1]), split_itl=True)
    m = re.fullmatch(r"32_users_shared_prefix_(\d+)", name)
    if m:
        return Load(name, 32, 32 * per_user, prompt_tokens, prefix_tokens=int(m[1]))
    raise ValueError(f"unknown load {name!r}; expected one of {NAMED}")


# ------------------------------------------------------------------ client


async def run_streams(
    url: str,
    model: str,
    prompts: Sequence[str],
    users: int,
    max_tokens: int,
    timeout_s: float = 1800.0,
    sampling: Mapping[str, float] = GREEDY,
) -> tuple[list[Stream], float]:
    """`users` concurrent users sending `prompts` in turn (each request with `sampling`'s fields); returns
    the streams in prompt order and the wall seconds."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    out: dict[int, Stream] = {}
    limits = httpx.Limits(max_connections=users, max_keepalive_connections=users)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:

        async def user() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                out[i] = await one_stream(client, url, model, prompts[i], max_tokens, sampling)

        t0 = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(users)))
        return [out[i] for i in range(len(prompts))], time.perf_counter() - t0


# ------------------------------------------------------------------ figures


def pct(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile `q` (0-100) of `values`, rounded to 0.1 ms; None when empty."""
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))], 4)


def itl_split(streams: Sequence[Stream]) -> dict[str, Any]:
    """Inter-token gaps of every completed stream, split by other streams' prefill windows (a stream's
    window: from its request's send to its first content chunk, queueing included). `during_other_prefill`:
    gaps that overlap another stream's window; `quiet`: gaps that overlap none. Seconds; `n` gaps each.
    The target of issue 49: p99 during <= 2x p99 quiet."""
    windows = [(i, s.start, s.chunk_times[0]) for i, s in enumerate(streams) if s.chunk_times]
    during: list[float] = []
    quiet: list[float] = []
    for i, s in enumerate(streams):
        if s.error is not None:
            continue
        for a, b in zip(s.chunk_times, s.chunk_times[1:], strict=False):
            busy = any(j != i and st < b and fi > a for j, st, fi in windows)
            (during if busy else quiet).append(b - a)

    def stats(v: list[float]) -> dict[str, Any]:
        return {"p50": pct(v, 50), "p99": pct(v, 99), "n": len(v)}

    d, q = stats(during), stats(quiet)
    ratio = round(d["p99"] / q["p99"], 3) if d["p99"] and q["p99"] else None
    return {"during_other_prefill": d, "quiet": q, "p99_during_over_quiet": ratio}


def summarize_streams(streams: Sequence[Stream], duration_s: float, split: bool) -> dict[str, Any]:
    """A run's figures: completed/failed requests with their errors, output tokens/s, TTFT p50/p90/p99/max,
    ITL p50/p99, and with `split` the ITL split of `itl_split`."""
    ok = [s for s in streams if s.error is None]
    out_tokens = sum(s.completion_tokens or len(s.chunk_times) for s in ok)
    ttft = [s.chunk_times[0] - s.start for s in ok if s.chunk_times]
    itl = [b - a for s in ok for a, b in zip(s.chunk_times, s.chunk_times[1:], strict=False)]
    errors: dict[str, int] = {}
    for s in streams:
        if s.error is not None:
            errors[s.error] = errors.get(s.error, 0) + 1
    res: dict[str, Any] = {
        "requests": len(streams),
        "completed": len(ok),
        "failed": len(streams) - len(ok),
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5]),
        "retries": sum(s.retries for s in streams),
        "duration_s": round(duration_s, 3),
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / duration_s, 3) if duration_s > 0 else None,
        "ttft_s": {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99), "max": pct(ttft, 100)},
        "itl_s": {"p50": pct(itl, 50), "p99": pct(itl, 99)},
        "completion_tokens_per_request": sorted({s.completion_tokens or len(s.chunk_times) for s in ok}),
    }
    if split:
        res["itl_split_s"] = itl_split(ok)
    cached = [s for s in ok if s.cached_tokens is not None and s.computed_tokens is not None]
    if cached:
        hits = sum(s.cached_tokens or 0 for s in cached)
        total = hits + sum(s.computed_tokens or 0 for s in cached)
        res["prefix_cache_from_responses"] = {
            "hit_tokens": hits,
            "prompt_tokens": total,
            "hit_rate": round(hits / total, 4) if total else None,
        }
    return res


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def prometheus_values(text: str) -> dict[str, float]:
    """Sample name -> value summed over its label sets, from Prometheus text exposition."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or line.startswith("#"):
            continue
        try:
            out[m[1]] = out.get(m[1], 0.0) + float(m[3])
        except ValueError:
            continue
    return out


def _find(values: dict[str, float], stem: str) -> float | None:
    """vLLM's counters are `vllm:<stem>_total`; `_created` samples are timestamps, not counts."""
    for name in (f"vllm:{stem}_total", f"vllm:{stem}"):
        if name in values:
            return values[name]
    return None


def prefix_cache_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, Any] | None:
    """Prefix-cache hits over queries between two /metrics reads (vLLM's `vllm:prefix_cache_queries` and
    `vllm:prefix_cache_hits`, counted in prompt tokens; ours exports the same names); None when the
    server exports neither."""
    q0, q1 = _find(before, "prefix_cache_queries"), _find(after, "prefix_cache_queries")
    h0, h1 = _find(before, "prefix_cache_hits"), _find(after, "prefix_cache_hits")
    if q0 is None or q1 is None or h0 is None or h1 is None:
        return None
    queries, hits = q1 - q0, h1 - h0
    return {
        "hit_tokens": int(hits),
        "query_tokens": int(queries),
        "hit_rate": round(hits / queries, 4) if queries > 0 else None,
    }


def engine_state(values: dict[str, float]) -> dict[str, float | None]:
    """What a server says it holds (vLLM's gauges; ours the same): after a run every request has ended,
    so running, waiting and KV usage must read 0 (a KV block still held is a leak)."""
    return {
        "num_requests_running": values.get("vllm:num_requests_running"),
        "num_requests_waiting": values.get("vllm:num_requests_waiting"),
        "kv_cache_usage_perc": values.get("vllm:kv_cache_usage_perc"),
        "num_preemptions": _find(values, "num_preemptions"),
    }


async def read_metrics(url: str) -> dict[str, float] | None:
    """The server's /metrics as `prometheus_values`, None when it serves none (llama-server without
    `--metrics`)."""
    try:
        async with httpx.AsyncClient(timeout=30.0) as c:
            r = await c.get(f"{url}/metrics")
    except httpx.HTTPError:
        return None
    return prometheus_values(r.text) if r.status_code == 200 else None
