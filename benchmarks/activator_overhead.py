"""The activator's added latency at steady state (a warm model): the same requests straight to a
stand-in model server and through the activator, interleaved in one run. Prints one JSON document.

    PYTHONPATH=operator python benchmarks/activator_overhead.py               # 400 requests per path
    PYTHONPATH=operator python benchmarks/activator_overhead.py --requests 1000 --concurrency 8

The stand-in server answers an OpenAI completion at once (a small JSON body, or a 16-event SSE
stream), so the figures are the proxy's own cost, not a model's; a real model's milliseconds per
token dilute them further. The stand-in, the activator and the client each run in their own process.
The activator's Kubernetes API is an in-memory stand-in reporting one ready replica: its control loop
is off the request path. Latency p50/p95 per path and mode (plain, streamed: time to the last byte),
and the ratio activator/direct of each. On a shared machine compare the ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import socket
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_standin(port: int) -> None:
    from aiohttp import web

    completion = {
        "id": "c",
        "object": "text_completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "text": "x" * 64, "finish_reason": "length", "logprobs": None}],
    }

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response(completion)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(16):
            await resp.write(f"data: {json.dumps(completion)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


class ReadyApi:
    """The stand-in API: a Deployment with one ready replica (what the activator reads each poll)."""

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any]:
        return {"metadata": {}, "spec": {"replicas": 1}, "status": {"readyReplicas": 1}}

    def set_scale(self, kind: str, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        raise AssertionError("a warm model is never scaled by this benchmark")


def run_activator(port: int, upstream: int) -> None:
    from aiohttp import web
    from kubeinfer_operator.activator.__main__ import build, parser

    args = parser().parse_args(
        [
            "--namespace=b",
            "--name=m",
            f"--upstream=http://127.0.0.1:{upstream}",
            "--scale-down-delay-seconds=3600",
        ]
    )
    activator = build(args, ReadyApi())  # type: ignore[arg-type]
    web.run_app(activator.app(), host="127.0.0.1", port=port, print=None, access_log=None)


def wait_up(url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.post(
                url + "/v1/completions", json={"model": "m", "prompt": "p"}, timeout=2
            ).raise_for_status()
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def one(client: httpx.Client, url: str, stream: bool) -> float:
    t0 = time.perf_counter()
    body = {"model": "m", "prompt": "p", "stream": stream}
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for _ in r.iter_bytes():
            pass
    return time.perf_counter() - t0


def measure(urls: dict[str, str], requests: int, concurrency: int, stream: bool) -> dict[str, list[float]]:
    """Rounds of `concurrency` requests, alternating path per round, so both see the same moments."""
    out: dict[str, list[float]] = {name: [] for name in urls}
    clients = [httpx.Client(timeout=30) for _ in range(concurrency)]
    with ThreadPoolExecutor(concurrency) as pool:
        for i in range(requests // concurrency):
            order = list(urls) if i % 2 == 0 else list(reversed(urls))
            for name in order:
                futures = [pool.submit(one, c, urls[name], stream) for c in clients]
                out[name] += [f.result() for f in futures]
    for c in clients:
        c.close()
    return out


def summary(samples: list[float]) -> dict[str, float]:
    qs = statistics.quantiles(samples, n=20)
    return {"p50_ms": round(statistics.median(samples) * 1e3, 3), "p95_ms": round(qs[18] * 1e3, 3)}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=40)
    args = ap.parse_args()
    standin_port, activator_port = free_port(), free_port()
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=run_standin, args=(standin_port,), daemon=True),
        ctx.Process(target=run_activator, args=(activator_port, standin_port), daemon=True),
    ]
    for p in procs:
        p.start()
    urls = {"direct": f"http://127.0.0.1:{standin_port}", "activator": f"http://127.0.0.1:{activator_port}"}
    try:
        for url in urls.values():
            wait_up(url)
        measure(urls, args.warmup, args.concurrency, False)
        result: dict[str, Any] = {
            "benchmark": "activator_overhead",
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "load_avg_at_start": os.getloadavg()[0],
            "requests_per_path_and_mode": args.requests,
            "concurrency": args.concurrency,
            "note": "stand-in model server answering at once: the figures are the proxy's own cost",
        }
        for mode, stream in (("plain", False), ("stream", True)):
            samples = measure(urls, args.requests, args.concurrency, stream)
            direct, via = summary(samples["direct"]), summary(samples["activator"])
            result[mode] = {
                "direct": direct,
                "activator": via,
                "ratio_p50": round(via["p50_ms"] / direct["p50_ms"], 3),
                "ratio_p95": round(via["p95_ms"] / direct["p95_ms"], 3),
                "added_p50_ms": round(via["p50_ms"] - direct["p50_ms"], 3),
            }
        result["load_avg_at_end"] = os.getloadavg()[0]
        print(json.dumps(result, indent=2))
    finally:
        for p in procs:
            p.terminate()
            p.join(timeout=10)


if __name__ == "__main__":
    main()
