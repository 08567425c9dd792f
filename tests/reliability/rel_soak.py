"""Soak traffic against a running server: a fixed, seeded plan of requests over both APIs, streaming and
not, with client disconnects, bad input and bursts beyond --max-concurrent-requests. Every response is
checked against what its request deserved; the report counts outcomes and records KV usage, memory and
throughput.

Standalone (against a server you started, e.g. with --max-concurrent-requests 24 --max-input-tokens 64
--max-total-tokens 192):
    python tests/reliability/rel_soak.py --url http://127.0.0.1:8080 --pid <server pid> [--requests 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rel_support import http_status_counts, new_marker, parse_metrics, rss_bytes

WORDS = [
    "river",
    "stone",
    "apple",
    "window",
    "garden",
    "silver",
    "morning",
    "paper",
    "orange",
    "cloud",
    "station",
    "market",
    "yellow",
    "engine",
    "forest",
    "bridge",
    "castle",
    "winter",
    "summer",
    "candle",
]

# Kinds of request in the plan; the weights add up to 100.
WELL_FORMED = ("tgi", "tgi_stream", "cmpl", "cmpl_stream", "chat", "chat_stream")
BAD = ("over_limit", "malformed_json", "wrong_type", "huge_max_new", "too_large")
WEIGHTS = {
    "tgi": 14,
    "tgi_stream": 14,
    "cmpl": 12,
    "cmpl_stream": 12,
    "chat": 12,
    "chat_stream": 12,
    "over_limit": 5,
    "malformed_json": 5,
    "wrong_type": 6,
    "huge_max_new": 6,
    "too_large": 2,
}


@dataclass(frozen=True)
class SoakConfig:
    num_requests: int = 1000
    concurrency: int = 20
    max_input_tokens: int = 64  # the server's limits, to build over-limit and huge requests
    max_total_tokens: int = 192
    max_concurrent_requests: int = 24
    disconnect_rate: float = 0.2  # of well-formed requests
    long_rate: float = 0.01  # well-formed requests asking for (almost) all of max_total_tokens
    burst_size: int = 40
    num_bursts: int = 3  # fired when 1/4, 2/4 and 3/4 of the steady requests have completed
    memory_at: tuple[int, int] = (200, 1000)
    seed: int = 1234
    request_timeout_s: float = 120.0


@dataclass(frozen=True)
class Job:
    index: int
    kind: str
    disconnect: bool
    long: bool
    burst: bool
    marker: str


@dataclass
class Result:
    index: int
    kind: str
    outcome: str  # completed | disconnected | rejected_429 | rejected_4xx | unexpected
    status: int | None
    detail: str = ""
    output_text: str = ""
    generated_tokens: int = 0


@dataclass
class SoakReport:
    requests: int
    outcomes: dict[str, int]
    by_kind: dict[str, dict[str, int]]
    statuses: dict[str, int]
    unexpected: list[str]
    wall_s: float
    requests_per_s: float
    completed_per_s: float
    generated_tokens: int
    generated_tokens_per_s: float
    peak_kv_cache_usage_perc: float
    peak_running: float
    peak_waiting: float
    final_kv_cache_usage_perc: float
    final_running: float
    final_waiting: float
    final_in_flight: float
    preemptions: float
    rss_bytes_at: dict[str, int]
    rss_growth_frac: float
    peak_rss_bytes: int
    server_5xx: float
    marker_prefix: str
    output_samples: list[str] = field(default_factory=list)


def make_plan(cfg: SoakConfig, marker_prefix: str) -> list[Job]:
    rng = random.Random(cfg.seed)
    kinds = list(WEIGHTS)
    weights = [WEIGHTS[k] for k in kinds]
    n_burst = cfg.burst_size * cfg.num_bursts
    jobs = []
    for i in range(cfg.num_requests):
        burst = i >= cfg.num_requests - n_burst
        # Bursts are short, well-formed streams: they test admission, not the engine.
        kind = rng.choice(("tgi_stream", "cmpl_stream", "tgi")) if burst else rng.choices(kinds, weights)[0]
        wf = kind in WELL_FORMED
        jobs.append(
            Job(
                index=i,
                kind=kind,
                disconnect=wf and not burst and rng.random() < cfg.disconnect_rate,
                long=wf and not burst and rng.random() < cfg.long_rate,
                burst=burst,
                marker=f"{marker_prefix}{i:04d}",
            )
        )
    return jobs


class Soak:
    def __init__(self, url: str, pid: int | None, cfg: SoakConfig) -> None:
        self.url = url
        self.pid = pid
        self.cfg = cfg
        self.marker_prefix = new_marker()
        self.rng = random.Random(cfg.seed + 1)
        self.results: list[Result] = []
        self.done = 0
        self.rss_at: dict[str, int] = {}
        self.peak_rss = 0
        self.peak = {"kv": 0.0, "running": 0.0, "waiting": 0.0}
        self._milestones: dict[int, asyncio.Event] = {}
        self._progress: dict[int, str] = {}

    # ---- request builders --------------------------------------------------------------------
    def _prompt(self, job: Job, n_words: int) -> str:
        words = [self.rng.choice(WORDS) for _ in range(n_words)]
        return f"{job.marker} " + " ".join(words)

    def _build(self, job: Job) -> tuple[str, bytes | dict[str, Any], bool, int]:
        """(path, body, streaming, max new tokens) for a job; bytes bodies are sent verbatim."""
        cfg = self.cfg
        r = self.rng
        kind = job.kind
        # Chat templates add a system prompt (~30 tokens for SmolLM2's): keep chat prompts short.
        n_words = r.randint(2, 8) if kind.startswith("chat") else r.randint(2, 24)
        if job.long:
            max_new = cfg.max_total_tokens - cfg.max_input_tokens
        elif job.burst:
            max_new = r.randint(2, 6)
        else:
            max_new = r.randint(1, 8)
        stream = kind.endswith("_stream")
        if kind in ("tgi", "tgi_stream"):
            params: dict[str, Any] = {"max_new_tokens": max_new, "details": r.random() < 0.5}
            if r.random() < 0.4:
                params.update(do_sample=True, temperature=0.8, top_k=40, top_p=0.9, seed=r.randint(0, 10**6))
            if r.random() < 0.2:
                params.update(stop=["river"], repetition_penalty=1.1, top_n_tokens=2)
            path = "/generate_stream" if stream else "/generate"
            return path, {"inputs": self._prompt(job, n_words), "parameters": params}, stream, max_new
        if kind in ("cmpl", "cmpl_stream", "chat", "chat_stream"):
            body: dict[str, Any] = {"max_tokens": max_new, "temperature": r.choice((0.0, 0.7, 1.0))}
            if r.random() < 0.3:
                body.update(top_p=0.9, seed=r.randint(0, 10**6), presence_penalty=0.5)
            if r.random() < 0.2:
                body["n"] = 2
            if stream:
                body["stream"] = True
                if r.random() < 0.5:
                    body["stream_options"] = {"include_usage": True}
            if kind.startswith("cmpl"):
                if r.random() < 0.2:
                    body["logprobs"] = 2
                body["prompt"] = self._prompt(job, n_words)
                return "/v1/completions", body, stream, max_new
            if r.random() < 0.2:
                body.update(logprobs=True, top_logprobs=2)
            body["messages"] = [{"role": "user", "content": self._prompt(job, n_words)}]
            return "/v1/chat/completions", body, stream, max_new
        tgi_side = r.random() < 0.5
        if kind == "over_limit":
            prompt = self._prompt(job, cfg.max_input_tokens * 2)
            if tgi_side:
                return "/generate", {"inputs": prompt, "parameters": {"max_new_tokens": 4}}, False, 4
            return "/v1/completions", {"prompt": prompt, "max_tokens": 4}, False, 4
        if kind == "malformed_json":
            raw = f'{{"inputs": "{job.marker} hello", "parameters": {{"max_new_tokens": 4'.encode()
            return ("/generate" if tgi_side else "/v1/chat/completions"), raw, False, 4
        if kind == "wrong_type":
            choice = r.randrange(4)
            if choice == 0:
                return "/generate", {"inputs": [job.marker], "parameters": {"max_new_tokens": 4}}, False, 4
            if choice == 1:
                return (
                    "/generate_stream",
                    {"inputs": job.marker, "parameters": {"max_new_tokens": "x"}},
                    True,
                    4,
                )
            if choice == 2:
                return "/v1/completions", {"prompt": {"text": job.marker}, "max_tokens": 4}, False, 4
            return "/v1/chat/completions", {"messages": job.marker, "max_tokens": 4}, False, 4
        if kind == "huge_max_new":
            huge = r.choice((10**9, 2**70, cfg.max_total_tokens))
            if tgi_side:
                return (
                    "/generate_stream",
                    {"inputs": self._prompt(job, 4), "parameters": {"max_new_tokens": huge}},
                    True,
                    huge,
                )
            return "/v1/completions", {"prompt": self._prompt(job, 4), "max_tokens": huge}, False, huge
        if kind == "too_large":
            filler = "a" * 2_500_000
            return "/generate", {"inputs": job.marker + filler, "parameters": {"max_new_tokens": 4}}, False, 4
        raise AssertionError(kind)

    # ---- one request -------------------------------------------------------------------------
    async def _one(self, client: httpx.AsyncClient, job: Job) -> Result:
        path, body, stream, max_new = self._build(job)
        kw: dict[str, Any] = (
            {"content": body, "headers": {"content-type": "application/json"}}
            if isinstance(body, bytes)
            else {"json": body}
        )
        if job.disconnect and not stream:
            # Give up after a short while: httpx closes the connection, which the server must notice.
            try:
                r = await asyncio.wait_for(client.post(path, **kw), timeout=self.rng.uniform(0.02, 0.3))
            except TimeoutError:
                return Result(job.index, job.kind, "disconnected", None)
            return self._check_plain(job, r, path, body, max_new)
        if not stream:
            r = await client.post(path, **kw)
            return self._check_plain(job, r, path, body, max_new)
        async with client.stream("POST", path, **kw) as r:
            self._progress[job.index] = "headers received"
            if r.status_code != 200:
                await r.aread()
                return self._check_plain(job, r, path, body, max_new)
            events: list[str] = []
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    events.append(line[5:].strip())
                    self._progress[job.index] = f"{len(events)} events received"
                    if job.disconnect and len(events) >= 1:
                        # Leaving the block closes the unfinished response, i.e. the connection.
                        return Result(job.index, job.kind, "disconnected", 200)
            return self._check_stream(job, path, body, events, max_new)

    def _check_plain(
        self, job: Job, r: httpx.Response, path: str, body: bytes | dict[str, Any], max_new: int
    ) -> Result:
        status = r.status_code
        openai_route = path.startswith("/v1/")
        try:
            data = r.json()
        except ValueError:
            return Result(job.index, job.kind, "unexpected", status, f"non-JSON body: {r.text[:200]!r}")
        if status == 429:
            ok = (
                (data["error"]["type"] == "RateLimitError")
                if openai_route
                else data["error_type"] == "overloaded"
            )
            return Result(
                job.index, job.kind, "rejected_429" if ok else "unexpected", status, str(data)[:200]
            )
        if job.kind in BAD:
            want = 413 if job.kind == "too_large" else (400 if openai_route else 422)
            if job.kind == "huge_max_new" and max_new == self.cfg.max_total_tokens:
                want = 400 if openai_route else 422  # prompt + max_new > max_total by the prompt's length
            good_body = (
                isinstance(data.get("error"), dict) and data["error"].get("code") == want
                if openai_route
                else isinstance(data.get("error"), str) and isinstance(data.get("error_type"), str)
            )
            if status == want and good_body:
                return Result(job.index, job.kind, "rejected_4xx", status)
            return Result(job.index, job.kind, "unexpected", status, f"wanted {want}: {str(data)[:200]}")
        if status != 200:
            return Result(job.index, job.kind, "unexpected", status, str(data)[:300])
        try:
            text, n_tokens = self._validate_body(job, data, max_new)
        except (AssertionError, KeyError, TypeError, IndexError) as e:
            return Result(job.index, job.kind, "unexpected", status, f"bad body ({e!r}): {str(data)[:300]}")
        return Result(job.index, job.kind, "completed", status, output_text=text, generated_tokens=n_tokens)

    def _validate_body(self, job: Job, data: Any, max_new: int) -> tuple[str, int]:
        if job.kind == "tgi":
            text = data["generated_text"]
            assert isinstance(text, str)
            if "details" in data:
                d = data["details"]
                assert 1 <= d["generated_tokens"] <= max_new, d["generated_tokens"]
                assert d["finish_reason"] in ("length", "eos_token", "stop_sequence"), d["finish_reason"]
                return text, d["generated_tokens"]
            return text, 0
        choices = data["choices"]
        assert data["usage"]["completion_tokens"] >= len(choices) >= 1
        assert data["usage"]["completion_tokens"] <= len(choices) * max_new
        for c in choices:
            assert c["finish_reason"] in ("length", "stop"), c["finish_reason"]
        first = choices[0]
        text = first["text"] if job.kind == "cmpl" else first["message"]["content"]
        assert isinstance(text, str)
        return text, int(data["usage"]["completion_tokens"])

    def _check_stream(
        self, job: Job, path: str, body: bytes | dict[str, Any], events: list[str], max_new: int
    ) -> Result:
        def bad(why: str) -> Result:
            return Result(job.index, job.kind, "unexpected", 200, f"{why}: {events[-3:]!r}")

        if job.kind in BAD:
            # A validation error must come before the stream starts, as a 4xx.
            return bad("bad request was streamed")
        if not events:
            return bad("empty stream")
        if job.kind == "tgi_stream":
            parsed = [json.loads(e) for e in events]
            if any("error" in p for p in parsed):
                return bad("error event")
            last = parsed[-1]
            if last.get("generated_text") is None or last.get("details") is None:
                return bad("no final event")
            n = last["details"]["generated_tokens"]
            if not (1 <= n <= max_new) or last["details"]["finish_reason"] not in (
                "length",
                "eos_token",
                "stop_sequence",
            ):
                return bad("bad details")
            return Result(
                job.index, job.kind, "completed", 200, output_text=last["generated_text"], generated_tokens=n
            )
        if events[-1] != "[DONE]":
            return bad("no [DONE]")
        parsed = [json.loads(e) for e in events[:-1]]
        if any("error" in p for p in parsed):
            return bad("error frame")
        n_choices = body.get("n", 1) if isinstance(body, dict) else 1
        finished = {c["index"] for p in parsed for c in p["choices"] if c.get("finish_reason")}
        if finished != set(range(n_choices)):
            return bad(f"finished choices {finished}")
        key = "text" if job.kind == "cmpl_stream" else "content"
        text = "".join(
            (c.get("text") if key == "text" else c.get("delta", {}).get("content")) or ""
            for p in parsed
            for c in p["choices"]
            if c["index"] == 0
        )
        tokens = 0
        usage = [p["usage"] for p in parsed if p.get("usage")]
        if usage:
            tokens = usage[-1]["completion_tokens"]
            if not (n_choices <= tokens <= n_choices * max_new):
                return bad("bad usage")
        return Result(job.index, job.kind, "completed", 200, output_text=text, generated_tokens=tokens)

    # ---- driving -------------------------------------------------------------------------------
    def _record(self, res: Result) -> None:
        self.results.append(res)
        self.done += 1
        if self.pid is not None:
            rss = rss_bytes(self.pid)
            self.peak_rss = max(self.peak_rss, rss)
            if self.done in self.cfg.memory_at:
                self.rss_at[str(self.done)] = rss
        ev = self._milestones.get(self.done)
        if ev is not None:
            ev.set()

    async def _guarded(self, client: httpx.AsyncClient, job: Job) -> None:
        try:
            res = await self._one(client, job)
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            where = self._progress.get(job.index, "before the response")
            res = Result(job.index, job.kind, "unexpected", None, f"{type(e).__name__} ({where}): {e!r}")
        self._record(res)

    async def _poll_metrics(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                m = parse_metrics((await client.get("/metrics")).text)
                self.peak["kv"] = max(self.peak["kv"], m.get("vllm:kv_cache_usage_perc", 0.0))
                self.peak["running"] = max(self.peak["running"], m.get("vllm:num_requests_running", 0.0))
                self.peak["waiting"] = max(self.peak["waiting"], m.get("vllm:num_requests_waiting", 0.0))
            except httpx.HTTPError:
                pass
            with _suppress_timeout():
                await asyncio.wait_for(stop.wait(), 0.25)

    async def run(self) -> SoakReport:
        cfg = self.cfg
        plan = make_plan(cfg, self.marker_prefix)
        steady = [j for j in plan if not j.burst]
        bursts = [j for j in plan if j.burst]
        # httpx's default 5 s keep-alive expiry, as the openai client has: a server that closes idle
        # connections as early (uvicorn's default) makes a request now and then fail with a reset.
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=64, keepalive_expiry=5.0)
        timeout = httpx.Timeout(cfg.request_timeout_s)
        async with httpx.AsyncClient(base_url=self.url, limits=limits, timeout=timeout) as client:
            t0_text = (await client.get("/metrics")).text
            m0 = parse_metrics(t0_text)
            status0 = _status_counts(t0_text)
            burst_at = [len(steady) * (k + 1) // (cfg.num_bursts + 1) for k in range(cfg.num_bursts)]
            for at in (*burst_at, *cfg.memory_at):
                self._milestones.setdefault(at, asyncio.Event())
            queue: asyncio.Queue[Job] = asyncio.Queue()
            for j in steady:
                queue.put_nowait(j)

            async def worker() -> None:
                while True:
                    try:
                        job = queue.get_nowait()
                    except asyncio.QueueEmpty:
                        return
                    await self._guarded(client, job)

            async def burster() -> None:
                for k, at in enumerate(burst_at):
                    await self._milestones[at].wait()
                    group = bursts[k * cfg.burst_size : (k + 1) * cfg.burst_size]
                    await asyncio.gather(*(self._guarded(client, j) for j in group))

            stop = asyncio.Event()
            poller = asyncio.create_task(self._poll_metrics(client, stop))
            t0 = time.monotonic()
            await asyncio.gather(burster(), *(worker() for _ in range(cfg.concurrency)))
            wall = time.monotonic() - t0
            stop.set()
            await poller
            final = await self._settle(client)
        outcomes = Counter(r.outcome for r in self.results)
        by_kind: dict[str, dict[str, int]] = {}
        for r in self.results:
            by_kind.setdefault(r.kind, {}).setdefault(r.outcome, 0)
            by_kind[r.kind][r.outcome] += 1
        statuses = Counter(str(r.status) for r in self.results)
        gen_tokens = int(
            final.get("vllm:generation_tokens_total", 0) - m0.get("vllm:generation_tokens_total", 0)
        )
        lo, hi = (self.rss_at.get(str(k), 0) for k in cfg.memory_at)
        status1 = _labelled(final, "kubeinfer_http_requests_total")
        server_5xx = sum(v - status0.get(k, 0.0) for k, v in status1.items() if k.startswith("5"))
        samples = [r.output_text for r in self.results if len(r.output_text) >= 24][:400]
        return SoakReport(
            requests=len(self.results),
            outcomes=dict(outcomes),
            by_kind=by_kind,
            statuses=dict(statuses),
            unexpected=[
                f"#{r.index} {r.kind} {r.status}: {r.detail}"
                for r in self.results
                if r.outcome == "unexpected"
            ],
            wall_s=round(wall, 2),
            requests_per_s=round(len(self.results) / wall, 2),
            completed_per_s=round(outcomes["completed"] / wall, 2),
            generated_tokens=gen_tokens,
            generated_tokens_per_s=round(gen_tokens / wall, 1),
            peak_kv_cache_usage_perc=self.peak["kv"],
            peak_running=self.peak["running"],
            peak_waiting=self.peak["waiting"],
            final_kv_cache_usage_perc=final.get("vllm:kv_cache_usage_perc", -1.0),
            final_running=final.get("vllm:num_requests_running", -1.0),
            final_waiting=final.get("vllm:num_requests_waiting", -1.0),
            final_in_flight=final.get("kubeinfer_requests_in_flight", -1.0),
            preemptions=final.get("vllm:num_preemptions_total", 0.0)
            - m0.get("vllm:num_preemptions_total", 0.0),
            rss_bytes_at=dict(self.rss_at),
            rss_growth_frac=round((hi - lo) / lo, 4) if lo else -1.0,
            peak_rss_bytes=self.peak_rss,
            server_5xx=server_5xx,
            marker_prefix=self.marker_prefix,
            output_samples=samples,
        )

    async def _settle(self, client: httpx.AsyncClient, timeout_s: float = 120.0) -> dict[str, float]:
        """Metrics once nothing runs any more (aborts land within one engine step; up to 2 min for a loaded
        machine, where 20 s could return them still running; returns as soon as all are idle)."""
        deadline = time.monotonic() + timeout_s
        while True:
            text = (await client.get("/metrics")).text
            m = parse_metrics(text)
            m.update({f"kubeinfer_http_requests_total|{k}": v for k, v in _status_counts(text).items()})
            idle = all(
                m.get(k, 0.0) == 0.0
                for k in (
                    "vllm:num_requests_running",
                    "vllm:num_requests_waiting",
                    "vllm:kv_cache_usage_perc",
                    "kubeinfer_requests_in_flight",
                )
            )
            if idle or time.monotonic() > deadline:
                return m
            await asyncio.sleep(0.2)


def _status_counts(text: str) -> dict[str, float]:
    """kubeinfer_http_requests_total summed by status."""
    out: dict[str, float] = {}
    for (_, status), value in http_status_counts(text).items():
        out[status] = out.get(status, 0.0) + value
    return out


def _labelled(m: dict[str, float], name: str) -> dict[str, float]:
    prefix = f"{name}|"
    return {k[len(prefix) :]: v for k, v in m.items() if k.startswith(prefix)}


class _suppress_timeout:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> bool:
        return exc_type is not None and issubclass(exc_type, TimeoutError)


def run_soak(url: str, pid: int | None, cfg: SoakConfig | None = None) -> SoakReport:
    return asyncio.run(Soak(url, pid, cfg or SoakConfig()).run())


def report_json(report: SoakReport) -> dict[str, Any]:
    d = asdict(report)
    d["output_samples"] = len(report.output_samples)
    d["rss_mib_at"] = {k: round(v / 2**20, 1) for k, v in report.rss_bytes_at.items()}
    d["peak_rss_mib"] = round(report.peak_rss_bytes / 2**20, 1)
    return d


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--pid", type=int)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    cfg = SoakConfig(num_requests=args.requests, concurrency=args.concurrency, memory_at=(200, args.requests))
    report = report_json(run_soak(args.url, args.pid, cfg))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
