"""Decode step time of the embedded GGUF model by KV cache dtype (--kv-cache-dtype); prints JSON.

    python benchmarks/kv_cache_dtype.py [--loads 16:200 32:640 --steps 20 --threads 1 2]

One engine per cache dtype (float32, bfloat16, float16), same weights, same prompts; after every prompt
is prefilled, single decode steps are taken in rotation over the three engines so that the machine's
load hits all alike. A load `U:L` is U users with L-token contexts. Per load and thread count: decode
step ms p50 and min per dtype and the speedup over fp32 (p50 ratio). Also the paged decode attention
kernel alone on the same shapes (9 query heads, 3 KV heads of 64: SmolLM2-135M), ms per call x 30
layers, so that the attention's share is visible. The engine is driven directly (no HTTP).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import server  # noqa: F401  (CPU runtime settings before torch loads)

# isort: split
import torch
from peers_side_by_side import cpu_info

from server.attention.cpu_kernel import load_decode_kernel
from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.request import SamplingParams

DTYPES = ("float32", "bfloat16", "float16")
BLOCK_SIZE = 16


def max_new_tokens(users: int, context: int, steps: int, num_threads: int) -> int:
    # Decode rows also run while the other prompts prefill, and the scheduler bounds a step's prefill
    # share while decodes run (issue 31 item 3), so the prefill takes many steps: every request must
    # outlive it and all measured steps.
    return max(context // 2, 64) + users * context // 256 + num_threads * steps


def measure_engines(
    engines: dict[str, LLMEngine], users: int, context: int, steps: int, threads: list[int]
) -> list[dict[str, object]]:
    """Prefills once per engine, then per thread count takes `steps` decode steps per engine in rotation."""
    g = torch.Generator().manual_seed(users)
    prompts = [torch.randint(100, 49000, (context,), generator=g).tolist() for _ in range(users)]
    params = SamplingParams(
        max_tokens=max_new_tokens(users, context, steps, len(threads)), temperature=0.0, ignore_eos=True
    )
    tag = f"u{users}c{context}"
    for engine in engines.values():
        for i, p in enumerate(prompts):
            engine.add_request(f"{tag}-{i}", p, params)
        while engine.scheduler.waiting or any(not r.output_token_ids for r in engine.scheduler.running):
            engine.step()  # every prompt prefilled: from here on each step is a pure decode step
    results = []
    names = list(engines)
    for num_threads in threads:
        torch.set_num_threads(num_threads)
        times: dict[str, list[float]] = {d: [] for d in engines}
        for i in range(steps):
            for name in names[i % 3 :] + names[: i % 3]:
                running = len(engines[name].scheduler.running)
                assert running == users, (name, running, users, len(engines[name].scheduler.waiting))
                t0 = time.perf_counter()
                engines[name].step()
                times[name].append(time.perf_counter() - t0)
        p50 = {d: statistics.median(v) * 1e3 for d, v in times.items()}
        results.append(
            {
                "threads": num_threads,
                "step_ms_p50": {d: round(v, 2) for d, v in p50.items()},
                "step_ms_min": {d: round(min(v) * 1e3, 2) for d, v in times.items()},
                "speedup_vs_fp32_p50": {d: round(p50["float32"] / p50[d], 3) for d in engines},
            }
        )
    for engine in engines.values():
        for i in range(users):
            engine.abort_request(f"{tag}-{i}")
    return results


def measure_kernel(users: int, context: int, reps: int) -> dict[str, object]:
    kernel = load_decode_kernel()
    hq, hkv, d = 9, 3, 64
    blocks = -(-context // BLOCK_SIZE)
    num_blocks = users * blocks + 1
    k32 = torch.randn(num_blocks, BLOCK_SIZE, hkv, d)
    v32 = torch.randn(num_blocks, BLOCK_SIZE, hkv, d)
    tables = (torch.randperm(num_blocks - 1)[: users * blocks] + 1).view(users, blocks).to(torch.int32)
    ctx = torch.full((users,), context, dtype=torch.int32)
    q = torch.randn(users, hq, d)
    out = torch.empty_like(q)
    seqs = torch.arange(users)
    times: dict[str, list[float]] = {name: [] for name in DTYPES}
    caches = {name: (k32.to(getattr(torch, name)), v32.to(getattr(torch, name))) for name in DTYPES}
    for i in range(reps):
        for name in DTYPES[i % 3 :] + DTYPES[: i % 3]:
            kc, vc = caches[name]
            t0 = time.perf_counter()
            kernel(out, q, kc, vc, tables, ctx, seqs, seqs, 0.125, indices_checked=True)
            times[name].append(time.perf_counter() - t0)
    p50 = {name: statistics.median(v) * 1e3 * 30 for name, v in times.items()}
    return {
        "attention_ms_x30_layers_p50": {n: round(v, 2) for n, v in p50.items()},
        "kv_bytes_read_per_step_mb": {
            n: round(30 * 2 * users * context * hkv * d * caches[n][0].element_size() / 1e6, 1)
            for n in DTYPES
        },
        "speedup_vs_fp32_p50": {n: round(p50["float32"] / v, 3) for n, v in p50.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loads", nargs="+", default=["16:200", "32:640"], help="USERS:CONTEXT_TOKENS")
    ap.add_argument("--steps", type=int, default=20, help="decode steps per dtype")
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--kernel-reps", type=int, default=60)
    args = ap.parse_args()
    loads = [tuple(int(x) for x in s.split(":")) for s in args.loads]
    need = max(
        u * (-(-(c + max_new_tokens(u, c, args.steps, len(args.threads))) // BLOCK_SIZE)) for u, c in loads
    )
    engines = {
        d: LLMEngine(
            EngineConfig(
                model=ModelConfig(),
                cache=CacheConfig(cache_dtype=d, num_kv_blocks=need * 5 // 4 + 64),
                max_num_seqs=64,
            )
        )
        for d in DTYPES
    }
    load_at_start = list(os.getloadavg())
    runs = []
    for users, context in loads:
        kernel = {}
        for num_threads in args.threads:
            torch.set_num_threads(num_threads)
            kernel[num_threads] = measure_kernel(users, context, args.kernel_reps)
        for engine_run in measure_engines(engines, users, context, args.steps, args.threads):
            num_threads = engine_run.pop("threads")
            run = {"threads": num_threads, "users": users, "context_tokens": context}
            runs.append({**run, "kernel": kernel[num_threads], "engine": engine_run})
        print(json.dumps(runs[-len(args.threads) :]), file=sys.stderr, flush=True)  # progress
    result = {
        "benchmark": "decode step of the embedded GGUF by KV cache dtype, engines stepped in rotation",
        "cpu": cpu_info(),
        "gemm_dtype": engines["float32"].info.gemm_dtype,
        "load_average_at_start": load_at_start,
        "runs": runs,
        "load_average_at_end": list(os.getloadavg()),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
