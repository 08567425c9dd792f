"""HTTP load generator: N concurrent users streaming from TGI's /generate_stream. Prints JSON with output
tokens/s, requests/s, time to first token and inter-token latency (p50/p99).

    python benchmarks/serve_load.py --url http://127.0.0.1:8080 [--concurrency 16 --num-requests 48
        --prompt-len 64 --max-new-tokens 32 --shared-prefix-len 0]
    python benchmarks/serve_load.py --compare [--dtype float32 --num-threads 2]

--compare starts our server (`python -m server`) and the naive transformers app
(benchmarks/naive_app.py) one after the other on free local ports, runs the same load against each,
and reports both plus the ratios. Decoding is greedy, so both produce the same tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
_WORDS = [
    "the",
    "time",
    "people",
    "year",
    "way",
    "day",
    "man",
    "thing",
    "woman",
    "life",
    "child",
    "world",
    "school",
    "state",
    "family",
    "student",
    "group",
    "country",
    "problem",
    "hand",
    "part",
    "place",
    "case",
    "week",
    "company",
    "system",
    "program",
    "question",
    "work",
    "government",
    "number",
    "night",
    "point",
    "home",
    "water",
    "room",
    "mother",
    "area",
    "money",
    "story",
    "fact",
    "month",
    "lot",
    "right",
    "study",
    "book",
    "eye",
    "job",
    "word",
    "business",
    "issue",
    "side",
    "kind",
    "head",
    "house",
    "service",
    "friend",
    "father",
    "power",
    "hour",
    "game",
    "line",
    "end",
    "member",
    "law",
    "car",
    "city",
    "community",
    "name",
    "president",
    "team",
]


def make_prompts(n: int, length: int, shared_prefix_len: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    prefix = " ".join(rng.choice(_WORDS) for _ in range(shared_prefix_len))
    prompts = []
    for _ in range(n):
        words = " ".join(rng.choice(_WORDS) for _ in range(max(1, length - shared_prefix_len)))
        prompts.append(f"{prefix} {words}".strip())
    return prompts


@dataclass
class RequestResult:
    ok: bool
    start: float
    end: float
    token_times: list[float] = field(default_factory=list)
    error: str | None = None


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_new_tokens: int) -> RequestResult:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}}
    start = time.perf_counter()
    times: list[float] = []
    try:
        async with client.stream("POST", f"{url}/generate_stream", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return RequestResult(False, start, time.perf_counter(), error=f"HTTP {resp.status_code}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    return RequestResult(False, start, time.perf_counter(), times, error=event["error"])
                if event.get("token") is not None:
                    times.append(time.perf_counter())
    except httpx.HTTPError as e:
        return RequestResult(False, start, time.perf_counter(), times, error=repr(e))
    return RequestResult(True, start, time.perf_counter(), times)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


async def run_load(url: str, prompts: list[str], concurrency: int, max_new_tokens: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        # Warm-up (not measured): first-request costs must not count against either server.
        await asyncio.gather(*(one_request(client, url, p, 4) for p in prompts[:2]))
        queue: asyncio.Queue[str] = asyncio.Queue()
        for p in prompts:
            queue.put_nowait(p)
        results: list[RequestResult] = []

        async def user() -> None:
            while True:
                try:
                    prompt = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results.append(await one_request(client, url, prompt, max_new_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        duration = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    ttft = [r.token_times[0] - r.start for r in ok if r.token_times]
    itl = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    e2e = [r.end - r.start for r in ok]
    out_tokens = sum(len(r.token_times) for r in ok)
    errors = sorted({r.error or "" for r in results if not r.ok})
    return {
        "url": url,
        "concurrency": concurrency,
        "num_requests": len(prompts),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors[:5],
        "duration_s": round(duration, 3),
        "requests_per_s": round(len(ok) / duration, 4),
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / duration, 3),
        "ttft_s": {"p50": _r(_pct(ttft, 50)), "p99": _r(_pct(ttft, 99))},
        "itl_s": {"p50": _r(_pct(itl, 50)), "p99": _r(_pct(itl, 99))},
        "e2e_s": {"p50": _r(_pct(e2e, 50)), "p99": _r(_pct(e2e, 99))},
    }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before becoming ready")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout_s} s")


def _serve_and_load(
    cmd: list[str], port: int, args: argparse.Namespace, prompts: list[str]
) -> dict[str, Any]:
    # Both servers apply server/cpu_env.py's CPU runtime settings unless the caller's environment sets one.
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    log = tempfile.NamedTemporaryFile(prefix="serve_load-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            _wait_ready(url, proc)
        except (RuntimeError, TimeoutError):
            print(Path(log.name).read_text(errors="replace")[-4000:], file=sys.stderr)
            raise
        return asyncio.run(run_load(url, prompts, args.concurrency, args.max_new_tokens))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def compare(args: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:
    threads = ["--num-threads", str(args.num_threads)] if args.num_threads else []
    model = ["--model", args.model] if args.model else []
    port = _free_port()
    ours_cmd = [
        sys.executable,
        "-m",
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--max-concurrent-requests",
        "1024",
        "--log-level",
        "warning",
        *threads,
        *model,
    ]
    ours = _serve_and_load(ours_cmd, port, args, prompts)
    port = _free_port()
    naive_cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "naive_app.py"),
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        *threads,
        *model,
    ]
    naive = _serve_and_load(naive_cmd, port, args, prompts)

    def ratio(key: str) -> float | None:
        return round(ours[key] / naive[key], 2) if naive[key] else None

    return {
        "kubeinfer": ours,
        "naive_transformers": naive,
        "requests_per_s_ratio": ratio("requests_per_s"),
        "output_tokens_per_s_ratio": ratio("output_tokens_per_s"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8080", help="server to load (ignored with --compare)")
    p.add_argument("--compare", action="store_true", help="start our server and the naive app, load both")
    p.add_argument("--concurrency", type=int, default=16, help="concurrent users")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=64, help="prompt length in words (about one token each)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--shared-prefix-len", type=int, default=0, help="words of prefix shared by every prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", help="with --compare: both servers' dtype")
    p.add_argument("--num-threads", type=int, default=None, help="with --compare: torch threads per server")
    p.add_argument("--model", default=None, help="with --compare: HF folder (default: embedded SmolLM2)")
    args = p.parse_args()
    prompts = make_prompts(args.num_requests, args.prompt_len, args.shared_prefix_len, args.seed)
    config = {
        k: getattr(args, k)
        for k in (
            "concurrency",
            "num_requests",
            "prompt_len",
            "max_new_tokens",
            "shared_prefix_len",
            "dtype",
            "num_threads",
        )
    }
    if args.compare:
        result = compare(args, prompts)
    else:
        result = asyncio.run(run_load(args.url, prompts, args.concurrency, args.max_new_tokens))
    print(json.dumps({"config": config, **result}, indent=2))


if __name__ == "__main__":
    main()
