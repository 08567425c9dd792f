"""Batched prefill against this CPU's measured GEMM ceiling (issue 49 item 3: "batched prefill >= 60% of the
measured bf16 (or int8) GEMM ceiling"), in one process; prints JSON.

    python benchmarks/prefill_ceiling.py --model ~/.cache/kubeinfer/real-shapes/llama-3.2-1b --rounds 3
    python benchmarks/prefill_ceiling.py --model ~/.cache/kubeinfer/real-shapes/llama-3.2-1b/llama-3.2-1b-Q4_K_M.gguf
    python benchmarks/prefill_ceiling.py --smoke        # the embedded model, 256 tokens, 1 round: checks the script

Per round, alternated so a shared machine's load falls on both alike:
- **the ceiling**: torch's GEMM at the model's widest projection, [T, hidden] x [hidden, 2 x intermediate]
  (the fused gate/up of a T-token prompt), in bf16 (oneDNN; where the CPU computes bf16 natively) and in
  int8 (`torch._int_mm`, int32 sums: the int8-activation kernels' arithmetic), best of 3 calls;
- **the prefill**: one T-token prompt (random ids) through the engine, `--max-num-batched-tokens` T so
  that it is one step, timed from `add_request` to its first token.
The prefill's work (dense models): 2 T FLOPs a projection weight (q/k/v/o and the MLP of every layer; the LM
head once: only the last token's logits are computed) plus causal attention, 2 x 2 x T (T + 1) / 2 x heads x
head_dim a layer (QK^T and PV). Reported: each GFLOP/s, and the prefill's fraction of each ceiling; the one
that applies is the arithmetic the model's projections run here (`gemm_dtype` in the JSON: a bf16 folder's
GEMMs are bf16; a GGUF's 16-row tiles take int8 activations for prefill on AVX512-VNNI and AVX2).
Mixture-of-experts models are refused (their work depends on routing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import server  # noqa: F401  (CPU runtime settings before torch loads)

# isort: split
import torch
from cpu_ceilings import _int8

from server.config import EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.models.arch import ArchConfig
from server.native import usable_cpu_features
from server.request import SamplingParams


def prefill_flop(arch: ArchConfig, tokens: int) -> float:
    """FLOPs of one `tokens`-token prompt's prefill of a dense model (module docstring)."""
    h, i, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    q, kv = arch.num_heads * d, arch.num_kv_heads * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    projections = 2.0 * tokens * per_layer * arch.num_layers + 2.0 * arch.vocab_size * h
    attention = 2 * 2.0 * tokens * (tokens + 1) / 2 * q * arch.num_layers
    return projections + attention


def time_prefill(engine: LLMEngine, tokens: int, seed: int) -> float:
    """Seconds from add_request to the first token of one `tokens`-token prompt; asserts one step."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, min(engine.loaded.arch.vocab_size, 30000), (tokens,), generator=g).tolist()
    rid = f"p{seed}"
    t0 = time.perf_counter()
    engine.add_request(rid, ids, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    steps = 0
    while not any(r.output_token_ids for r in engine.scheduler.running if r.request_id == rid):
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - t0
    engine.abort_request(rid)
    if steps != 1:
        raise SystemExit(f"the prompt took {steps} steps, not one: raise --max-num-batched-tokens")
    return elapsed


def best_of(fn: Callable[[], object], reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a model folder or GGUF file (default: the embedded model)")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="256 tokens, 1 round")
    args = ap.parse_args()
    tokens, rounds = (256, 1) if args.smoke else (args.prompt_tokens, args.rounds)
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=args.model, max_model_len=tokens + 16),
            max_num_batched_tokens=tokens,
            max_num_seqs=4,
        )
    )
    arch = engine.loaded.arch
    if arch.is_moe:
        raise SystemExit("a mixture-of-experts model: its prefill work depends on routing")
    features = usable_cpu_features()
    bf16 = features.avx512_bf16 or features.amx_bf16
    g = torch.Generator().manual_seed(0)
    h, n = arch.hidden_size, 2 * arch.intermediate_size
    a8, b8 = _int8(tokens, h, g), _int8(h, n, g)
    ceilings: dict[str, Callable[[], object]] = {"int8": lambda: torch._int_mm(a8, b8)}
    if bf16:
        a16, b16 = torch.randn(tokens, h, generator=g).bfloat16(), torch.randn(h, n, generator=g).bfloat16()
        ceilings["bf16"] = lambda: a16 @ b16
    gemm_flop = 2.0 * tokens * h * n
    work = prefill_flop(arch, tokens)
    time_prefill(engine, tokens, seed=-1)  # warm-up: kernels built, step threads measured
    seen: dict[str, list[float]] = {name: [] for name in (*ceilings, "prefill")}
    for r in range(rounds):
        order = [*ceilings, "prefill"]
        for name in order if r % 2 == 0 else order[::-1]:
            if name == "prefill":
                seen[name].append(work / time_prefill(engine, tokens, seed=r) / 1e9)
            else:
                seen[name].append(gemm_flop / best_of(ceilings[name]) / 1e9)
    p50 = {name: statistics.median(v) for name, v in seen.items()}
    out = {
        "model": args.model or "embedded",
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "gemm_dtype": str(engine.gemm_dtype).removeprefix("torch."),
        "weight_dtype": str(engine.loaded.dtype).removeprefix("torch."),
        "prompt_tokens": tokens,
        "prefill_tflop": round(work / 1e12, 3),
        "ceiling_shape": [tokens, h, n],
        "gflop_per_s_per_round": {k: [round(x, 1) for x in v] for k, v in seen.items()},
        "gflop_per_s_p50": {k: round(v, 1) for k, v in p50.items()},
        "prefill_fraction_of": {k: round(p50["prefill"] / p50[k], 3) for k in ceilings},
        "load_avg_1min": os.getloadavg()[0],
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
