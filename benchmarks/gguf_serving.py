"""The embedded GGUF served as it is (quantized, the default) vs dequantized to fp32 (--dtype float32),
same engine, same process, runs interleaved. Prints JSON.

    python benchmarks/gguf_serving.py [--users 1 16 --prompt-len 128 --new-tokens 64 --rounds 2]

`step_interleaved` (the figure to read on a shared machine): both engines given the same requests, taking
single steps in alternation: prefill step and decode step times, and their pairwise ratios.
Then, per configuration and user count, whole runs: output tokens/s (all users' new tokens over the wall time from the
first request to the last token), TTFT p50 (steps until a request's first token, wall ms), decode ms per
step, and the weight bytes the engine reports. Requests arrive together and ignore EOS. The engine is
driven directly (no HTTP): this isolates the model's speed; benchmarks/serve_load.py covers the server.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import server  # noqa: F401  (CPU runtime settings before torch loads)

# isort: split
import torch

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.request import SamplingParams


def run(engine: LLMEngine, users: int, prompt_len: int, new_tokens: int, seed: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(100, 49000, (users, prompt_len), generator=g).tolist()
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{seed}-{i}", p, params)
    first: dict[str, float] = {}
    produced = 0
    step_times: list[float] = []
    while engine.has_unfinished():
        s0 = time.perf_counter()
        outs = engine.step()
        step_times.append(time.perf_counter() - s0)
        for o in outs:
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = time.perf_counter() - t0
            produced += len(o.new_token_ids)
    wall = time.perf_counter() - t0
    decode_steps = sorted(step_times)[: max(1, len(step_times) - users)]  # drop the prefill-heavy steps
    return {
        "output_tok_s": produced / wall,
        "ttft_p50_ms": statistics.median(first.values()) * 1e3,
        "decode_step_ms_p50": statistics.median(decode_steps) * 1e3,
    }


def step_interleaved(
    engines: dict[str, LLMEngine], users: int, prompt_len: int, steps: int
) -> dict[str, dict[str, float]]:
    """Both engines hold the same `users` requests and take steps in alternation: the first step (the
    whole batch's prefill: users x prompt_len rows) and then `steps` decode steps of `users` rows each.
    Alternating single steps puts both under the same machine load, which whole runs on a shared machine
    do not; per-step ratios are taken pairwise."""
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(100, 49000, (users, prompt_len), generator=g).tolist()
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    prefill: dict[str, float] = {}
    decode: dict[str, list[float]] = {n: [] for n in engines}
    for name, e in engines.items():
        for i, p in enumerate(prompts):
            e.add_request(f"s-{name}-{i}", p, params)
    for step in range(steps + 1):
        for name, e in engines.items():
            t0 = time.perf_counter()
            e.step()
            dt = time.perf_counter() - t0
            if step == 0:
                prefill[name] = dt
            else:
                decode[name].append(dt)
    for e in engines.values():
        while e.has_unfinished():
            e.step()
    q, f = decode["gguf_quantized"], decode["fp32_dequantized"]
    return {
        "prefill_step_ms": {n: round(v * 1e3, 1) for n, v in prefill.items()},
        "decode_step_ms_p50": {n: round(statistics.median(v) * 1e3, 1) for n, v in decode.items()},
        "speedup": {
            "prefill_step": round(prefill["fp32_dequantized"] / prefill["gguf_quantized"], 2),
            "decode_step_p50": round(statistics.median(b / a for a, b in zip(q, f, strict=True)), 2),
        },
    }


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--users", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--interleaved-steps", type=int, default=30, help="decode steps of the per-step comparison"
    )
    args = ap.parse_args()
    engines = {
        "gguf_quantized": LLMEngine(EngineConfig(model=ModelConfig(), cache=CacheConfig())),
        "fp32_dequantized": LLMEngine(EngineConfig(model=ModelConfig(dtype="float32"), cache=CacheConfig())),
    }
    results: dict[str, dict[str, list[dict[str, float]]]] = {name: {} for name in engines}
    for r in range(args.rounds):
        for users in args.users:
            for name, engine in engines.items():  # interleaved: both see the same machine load
                res = run(engine, users, args.prompt_len, args.new_tokens, seed=r * 100 + users)
                results[name].setdefault(str(users), []).append(res)
    per_step = {
        str(u): step_interleaved(engines, u, args.prompt_len, args.interleaved_steps) for u in args.users
    }
    summary: dict[str, object] = {
        "cpu": cpu_model(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "threads": torch.get_num_threads(),
        "weights_MiB": {n: round(e.info.weight_bytes / 2**20, 1) for n, e in engines.items()},
        "runs": {},
    }
    runs = summary["runs"]
    assert isinstance(runs, dict)
    for name, by_users in results.items():
        runs[name] = {
            u: {k: round(statistics.median(x[k] for x in rs), 2) for k in rs[0]} for u, rs in by_users.items()
        }
    summary["speedup_output_tok_s"] = {
        u: round(runs["gguf_quantized"][u]["output_tok_s"] / runs["fp32_dequantized"][u]["output_tok_s"], 2)
        for u in runs["gguf_quantized"]
    }
    summary["step_interleaved"] = per_step
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
