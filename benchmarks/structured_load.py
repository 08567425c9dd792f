"""Structured-output load: 16 concurrent users asking for JSON under a schema vs the same load
unconstrained, against one server in the same run (rounds interleaved). Prints one JSON object:
output tokens/s of each mode and their ratio, schema compile time (first use and cached) and the
engine's per-step mask time (from /metrics).

    PYTHONPATH=$PWD python benchmarks/structured_load.py [--url http://127.0.0.1:8080]
        [--concurrency 16 --num-requests 48 --max-tokens 64 --rounds 2 --num-threads 2]

Without --url it starts `python -m server` on a free port (embedded model, fp32) and stops it after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import REPO, _free_port, _wait_ready

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "role": {"enum": ["admin", "user", "guest"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "role", "skills"],
    "additionalProperties": False,
}
TOPICS = ["a chef", "a pilot", "a painter", "a nurse", "a farmer", "a coder", "a singer", "a judge"]


def _metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("kubeinfer_structured_output_"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def _load(url: str, constrained: bool, args: argparse.Namespace, seed0: int) -> dict[str, Any]:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(args.num_requests):
        queue.put_nowait(i)
    tokens = 0
    latencies: list[float] = []
    finish: dict[str, int] = {}

    async def user(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while not queue.empty():
            i = queue.get_nowait()
            body: dict[str, Any] = {
                "messages": [
                    {"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as a JSON profile."}
                ],
                "max_tokens": args.max_tokens,
                "temperature": 1.0,
                "seed": seed0 + i,
            }
            if constrained:
                body["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": SCHEMA},
                }
            t0 = time.perf_counter()
            r = await client.post(f"{url}/v1/chat/completions", json=body)
            r.raise_for_status()
            data = r.json()
            latencies.append(time.perf_counter() - t0)
            tokens += data["usage"]["completion_tokens"]
            reason = data["choices"][0]["finish_reason"]
            finish[reason] = finish.get(reason, 0) + 1
            if constrained and reason == "stop":
                json.loads(data["choices"][0]["message"]["content"])  # must parse

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(user(client) for _ in range(args.concurrency)))
    wall = time.perf_counter() - t0
    latencies.sort()
    return {
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(tokens / wall, 2),
        "mean_tokens_per_request": round(tokens / args.num_requests, 1),
        "p50_latency_s": round(latencies[len(latencies) // 2], 3),
        "finish_reasons": finish,
    }


def _compile_times() -> dict[str, float]:
    """First-use and cached compile of the benchmark's schema, in this process (same tokenizer)."""
    from transformers import AutoTokenizer

    from server.models.loader import read_hf_config, resolve_model
    from server.request import GrammarSpec
    from server.structured import GrammarCompiler

    folder = resolve_model(None).folder
    tok = AutoTokenizer.from_pretrained(str(folder))
    compiler = GrammarCompiler(tok, int(read_hf_config(folder)["vocab_size"]), [int(tok.eos_token_id)])
    compiler.compile(GrammarSpec("json_object"))  # builds the tokenizer info, as the server's warm-up does
    spec = GrammarSpec("json", json.dumps(SCHEMA))
    t0 = time.perf_counter()
    compiler.compile(spec)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiler.compile(GrammarSpec("json", json.dumps(SCHEMA)))
    cached = time.perf_counter() - t0
    return {"compile_first_ms": round(first * 1e3, 3), "compile_cached_ms": round(cached * 1e3, 4)}


def run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    asyncio.run(_load(url, True, argparse.Namespace(**{**vars(args), "num_requests": 4}), 10_000))  # warm-up
    free: list[dict[str, Any]] = []
    constrained: list[dict[str, Any]] = []
    mask_s = mask_steps = mask_rows = 0.0
    for r in range(args.rounds):
        free.append(asyncio.run(_load(url, False, args, 1000 * r)))
        before = _metrics(url)
        constrained.append(asyncio.run(_load(url, True, args, 1000 * r)))
        after = _metrics(url)
        mask_s += (
            after["kubeinfer_structured_output_mask_seconds_total"]
            - before["kubeinfer_structured_output_mask_seconds_total"]
        )
        mask_steps += (
            after["kubeinfer_structured_output_mask_steps_total"]
            - before["kubeinfer_structured_output_mask_steps_total"]
        )
        mask_rows += (
            after["kubeinfer_structured_output_mask_rows_total"]
            - before["kubeinfer_structured_output_mask_rows_total"]
        )
    tps_free = sum(x["output_tokens"] for x in free) / sum(x["wall_s"] for x in free)
    tps_con = sum(x["output_tokens"] for x in constrained) / sum(x["wall_s"] for x in constrained)
    return {
        "concurrency": args.concurrency,
        "requests_per_round": args.num_requests,
        "max_tokens": args.max_tokens,
        "unconstrained": free,
        "constrained": constrained,
        "unconstrained_output_tokens_per_s": round(tps_free, 2),
        "constrained_output_tokens_per_s": round(tps_con, 2),
        "ratio_constrained_vs_unconstrained": round(tps_con / tps_free, 3),
        "mask_ms_per_step": round(1e3 * mask_s / max(mask_steps, 1), 3),
        "mean_masked_rows_per_step": round(mask_rows / max(mask_steps, 1), 2),
        "mask_share_of_constrained_wall": round(mask_s / sum(x["wall_s"] for x in constrained), 4),
        **_compile_times(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default=None)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-threads", type=int, default=None)
    args = ap.parse_args()
    if args.url:
        print(json.dumps(run(args.url, args), indent=1))
        return
    port = _free_port()
    cmd = [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    if args.num_threads:
        cmd += ["--num-threads", str(args.num_threads)]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    log = tempfile.NamedTemporaryFile(prefix="structured_load-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc)
        print(json.dumps(run(url, args), indent=1))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
