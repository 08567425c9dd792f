"""bf16 against fp32 GEMMs for the embedded SmolLM2 GGUF served quantized, interleaved in one run; JSON.

    python benchmarks/bf16_serving.py [--sections offline,served --rounds 2 --threads 2]

- `offline`: one engine (`--dtype auto`), its block-quantized projections switched between fp32 and bf16
  GEMMs (server/quant/gemm_dtype.apply_gemm_dtype) round by round on the same weights: output tokens/s
  for a batch of prompts (all admitted at once: prefill chunks of up to --max-num-batched-tokens rows,
  then batched decode), plus how many greedy tokens the two dtypes agree on.
- `served`: `python -m server` with its defaults (what benchmarks/peers_side_by_side.py runs as `ours`),
  once with KUBEINFER_CPU_DISABLE=avx512_bf16,amx_bf16 (fp32 GEMMs) and once without (bf16 where the CPU
  has it), alternating; each loaded by --users streaming chat users (peers_side_by_side's load: 128-token
  prompts after the chat template, 64 new tokens, greedy, ignore_eos).

This machine is shared: read the interleaved rounds side by side and the load averages printed with them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import server  # noqa: F401  (server/cpu_env.py's runtime settings before torch loads)

# isort: split
import torch

DISABLE_BF16 = "avx512_bf16,amx_bf16"


def offline(args: argparse.Namespace) -> dict[str, Any]:
    from server.config import CacheConfig, EngineConfig, ModelConfig
    from server.engine import LLMEngine
    from server.quant.gemm_dtype import apply_gemm_dtype
    from server.request import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=None),
            cache=CacheConfig(enable_prefix_caching=False, kv_cache_memory_bytes=1 << 30),
            max_num_seqs=args.offline_requests,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    )
    engine.warmup()
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(100, engine.loaded.arch.vocab_size, (args.offline_requests, 128), generator=g)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    runs: dict[str, list[float]] = {"float32": [], "bfloat16": []}
    tokens: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            apply_gemm_dtype(engine.loaded.model, dtype)
            outs: dict[str, list[int]] = {}
            t0 = time.perf_counter()
            for i, p in enumerate(prompts.tolist()):
                engine.add_request(f"{name}-{r}-{i}", p, params)
            while engine.has_unfinished():
                for o in engine.step():
                    outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            dt = time.perf_counter() - t0
            runs[name].append(sum(len(v) for v in outs.values()) / dt)
            tokens[name] = [outs[f"{name}-{r}-{i}"] for i in range(len(prompts))]
            print(
                json.dumps({"round": r, "gemm_dtype": name, "tok_s": round(runs[name][-1], 1)}),
                file=sys.stderr,
            )
    agree = [
        next((j for j, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
        for x, y in zip(tokens["float32"], tokens["bfloat16"], strict=True)
    ]
    return {
        "requests": args.offline_requests,
        "prompt_tokens": 128,
        "new_tokens": args.new_tokens,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "output_tokens_per_s": {k: [round(v, 1) for v in vs] for k, vs in runs.items()},
        "bf16_over_fp32_median": round(
            statistics.median(runs["bfloat16"]) / statistics.median(runs["float32"]), 3
        ),
        "greedy_tokens_identical_prefix_mean": round(statistics.mean(agree), 1),
        "requests_fully_identical": sum(a == args.new_tokens for a in agree),
    }


def served(args: argparse.Namespace) -> dict[str, Any]:
    import peers_side_by_side as peers

    from server.models.loader import resolve_model

    folder = resolve_model(None, keep_gguf=True).folder
    prompts = peers.make_prompts(folder, args.users * args.requests_per_user, 128, args.seed)
    runs: list[dict[str, Any]] = []
    saved = os.environ.get("KUBEINFER_CPU_DISABLE")
    try:
        for r in range(args.rounds):
            for name, disable in (("float32", DISABLE_BF16), ("bfloat16", "")):
                os.environ["KUBEINFER_CPU_DISABLE"] = disable
                srv = peers.start("ours", peers.DEFAULT_PEERS_DIR, peers.DEFAULT_START, args.threads)
                try:
                    model = peers.wait_ready(srv, 600)
                    load = os.getloadavg()[0]
                    res = asyncio.run(peers.run_load(srv.url, model, prompts, args.users, 64))
                finally:
                    peers.stop(srv)
                res.update(round=r, gemm_dtype=name, load_avg_1m_at_start=round(load, 2))
                runs.append(res)
                print(
                    json.dumps({k: res[k] for k in ("round", "gemm_dtype", "output_tokens_per_s", "ttft_s")}),
                    file=sys.stderr,
                )
    finally:
        if saved is None:
            os.environ.pop("KUBEINFER_CPU_DISABLE", None)
        else:
            os.environ["KUBEINFER_CPU_DISABLE"] = saved

    def med(dtype: str, key: str, sub: str | None = None) -> float:
        vals = [r[key][sub] if sub else r[key] for r in runs if r["gemm_dtype"] == dtype]
        return float(statistics.median(vals))

    return {
        "users": args.users,
        "runs": runs,
        "bf16_over_fp32_output_tokens_per_s": round(
            med("bfloat16", "output_tokens_per_s") / med("float32", "output_tokens_per_s"), 3
        ),
        "ttft_p50_s": {d: med(d, "ttft_s", "p50") for d in ("float32", "bfloat16")},
        "itl_p99_s": {d: med(d, "itl_s", "p99") for d in ("float32", "bfloat16")},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="offline,served")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--offline-requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--requests-per-user", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import peers_side_by_side as peers

    from server.native import usable_cpu_features

    out: dict[str, Any] = {
        "cpu": peers.cpu_info(),
        "usable_features": usable_cpu_features().names(),
        "threads": torch.get_num_threads(),
        "load_avg_1m_start": round(os.getloadavg()[0], 2),
    }
    sections = set(args.sections.split(","))
    if "offline" in sections:
        out["offline"] = offline(args)
    if "served" in sections:
        out["served"] = served(args)
    out["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
