"""The embedded GGUF served as it is (quantized, the default) vs dequantized to fp32 (--dtype float32),
same engine, same process, runs interleaved. Prints JSON.

    python benchmarks/gguf_serving.py [--users 1 16 --prompt-len 128 --new-tokens 64 --rounds 2]

Per configuration and user count: output tokens/s (all users' new tokens over the wall time from the
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


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--users", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
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
    summary: dict[str, object] = {
        "cpu": cpu_model(),
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
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
