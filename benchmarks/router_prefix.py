"""Multi-turn conversations through vllm-router over three replicas: round_robin vs cache_aware vs
kv_aware (fed by our KV events). Prints one JSON document.

    python benchmarks/router_prefix.py                       # embedded SmolLM2, 16 users, 3 turns
    python benchmarks/router_prefix.py --model DIR --users 8 --turns 2

Each user has its own long system prompt (~250 tokens) and runs its turns in order, the reply
appended to the history; users run together. Before each policy every replica's prefix cache is
flushed. Per policy: the prefix-cache hit tokens summed over replicas (vllm:prefix_cache_hits_total,
whose ratio to round_robin is the figure that matters on a shared CPU), hit rate over prompt tokens,
TTFT p50/p99 (streamed first chunk) and output tokens/s. The policies run one after another on the
same replicas; on a machine shared with other work, compare ratios, not absolute speed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai

REPO = Path(__file__).resolve().parent.parent
ROUTER_BIN = Path(sys.executable).with_name("vllm-router")
SERVED = "bench-router"
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(url)


def start_replica(model: str | None, log: Path, threads: int) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    events = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}'
    cmd = [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--served-model-name", SERVED, "--num-kv-blocks", "1024", "--max-total-tokens", "2048"]
    cmd += ["--num-threads", str(threads), "--kv-events-config", events]
    if model:
        cmd += ["--model", model]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    return f"http://127.0.0.1:{port}", proc


def start_router(urls: list[str], policy: str, log: Path) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    cmd = [str(ROUTER_BIN), "--host", "127.0.0.1", "--port", str(port), "--policy", policy]
    cmd += [
        "--prometheus-port",
        str(free_port()),
        "--worker-urls",
        *urls,
        "--health-check-endpoint",
        "/ready",
    ]
    cmd += ["--log-level", "warning"]
    if policy == "kv_aware":
        for u in urls:
            kv = httpx.get(f"{u}/get_server_info", timeout=10).json()["kv_events_config"]
            cmd += [
                "--kv-event-source",
                f"{u}={kv['endpoint']}",
                "--kv-event-replay-source",
                f"{u}={kv['replay_endpoint']}",
            ]
        cmd += ["--kv-event-block-size", "16", "--kv-event-model", SERVED]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/readiness", proc, 60)
    return url, proc


def system_prompt(i: int) -> str:
    words = [WORDS[(i * 7 + k * 3) % len(WORDS)] + str(i) for k in range(110)]
    return f"Conversation {i}. You are assistant number {i}. Rules: " + " ".join(words)


def metric_sum(urls: list[str], name: str) -> float:
    total = 0.0
    for u in urls:
        for line in httpx.get(f"{u}/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
    return total


def workload(url: str, users: int, turns: int, max_tokens: int) -> dict[str, Any]:
    ttfts: list[float] = []
    out_tokens = 0
    errors = 0
    lock = threading.Lock()

    def user(i: int) -> None:
        nonlocal out_tokens, errors
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        history = [{"role": "system", "content": system_prompt(i)}]
        for t in range(turns):
            history.append({"role": "user", "content": f"Question {t} from user {i}: what next?"})
            t0 = time.monotonic()
            first: float | None = None
            text, n = "", 0
            try:
                stream = c.chat.completions.create(
                    model=SERVED,
                    messages=history,  # type: ignore[arg-type]
                    max_tokens=max_tokens,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                for ch in stream:
                    if ch.choices and ch.choices[0].delta.content:
                        if first is None:
                            first = time.monotonic() - t0
                        text += ch.choices[0].delta.content
                    if ch.usage is not None:
                        n = ch.usage.completion_tokens
            except openai.OpenAIError:
                with lock:
                    errors += 1
                return
            with lock:
                if first is not None:
                    ttfts.append(first)
                out_tokens += n
            history.append({"role": "assistant", "content": text})

    t0 = time.monotonic()
    with ThreadPoolExecutor(users) as pool:
        for f in [pool.submit(user, i) for i in range(users)]:
            f.result()
    wall = time.monotonic() - t0
    ttfts.sort()
    return {
        "requests": len(ttfts),
        "errors": errors,
        "wall_s": round(wall, 2),
        "output_tokens_per_s": round(out_tokens / wall, 2),
        "ttft_p50_s": round(statistics.median(ttfts), 4) if ttfts else None,
        "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 4) if ttfts else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2)")
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    ap.add_argument("--policies", default="round_robin,cache_aware,kv_aware")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/router_prefix_bench"))
    args = ap.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)

    replicas = [
        start_replica(args.model, args.log_dir / f"replica{i}.log", args.threads)
        for i in range(args.replicas)
    ]
    urls = [u for u, _ in replicas]
    results: dict[str, Any] = {}
    try:
        for u, p in replicas:
            wait_http(f"{u}/ready", p, 600)
        for policy in args.policies.split(","):
            for u in urls:
                httpx.post(f"{u}/flush_cache", timeout=30).raise_for_status()
            router_url, router = start_router(urls, policy, args.log_dir / f"router-{policy}.log")
            try:
                hits0 = metric_sum(urls, "vllm:prefix_cache_hits_total")
                queries0 = metric_sum(urls, "vllm:prefix_cache_queries_total")
                res = workload(router_url, args.users, args.turns, args.max_tokens)
                hits = metric_sum(urls, "vllm:prefix_cache_hits_total") - hits0
                queries = metric_sum(urls, "vllm:prefix_cache_queries_total") - queries0
            finally:
                router.terminate()
                router.wait(10)
            res["prefix_cache_hit_tokens"] = hits
            res["prefix_cache_hit_rate"] = round(hits / queries, 4) if queries else None
            results[policy] = res
    finally:
        for _, p in replicas:
            p.terminate()
        for _, p in replicas:
            p.wait(60)
    base = results.get("round_robin", {}).get("prefix_cache_hit_tokens")
    for res in results.values():
        if base:
            res["hits_vs_round_robin"] = round(res["prefix_cache_hit_tokens"] / base, 2)
    print(
        json.dumps(
            {
                "benchmark": "router_prefix",
                "cpu": platform.processor() or platform.machine(),
                "model": args.model or "embedded SmolLM2-135M-Instruct",
                "users": args.users,
                "turns": args.turns,
                "replicas": args.replicas,
                "max_tokens": args.max_tokens,
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
