"""Multi-LoRA throughput: 16 concurrent users over 4 distinct rank-16 adapters vs the base model alone,
in the same process, interleaved rounds (the machine may be shared). Prints JSON.

Configurations, each a closed loop of --users requests in flight (a user sends its next request when the
previous one ends):
  base         engine without --enable-lora (the reference)
  lora-base    engine with LoRA enabled, every request on the base model (the wrappers' idle cost)
  lora-4       the same engine, requests spread round-robin over 4 adapters (mixed batches)

    python benchmarks/lora.py [--users 16 --requests 64 --prompt-len 128 --new-tokens 64 --rounds 2]
    python benchmarks/lora.py --decode-steps 12 [--threads 1]   decode steps alternated base / lora-4 /
        lora-4 forced dense / forced grouped (robust on a shared machine; --threads 1 more so)
    python benchmarks/lora.py --micro 100 --threads 1   one layer's delta only, dense vs grouped, by token count
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import server  # noqa: F401  (CPU runtime settings before torch loads)

# isort: split
import torch


def run_closed_loop(engine, prompts, loras, users: int, new_tokens: int) -> dict:  # type: ignore[no-untyped-def]
    from server.request import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    queue = list(range(len(prompts)))
    generated = 0
    t0 = time.perf_counter()
    in_flight = 0
    while queue or engine.has_unfinished():
        while queue and in_flight < users:
            i = queue.pop(0)
            engine.add_request(f"q{i}-{time.monotonic_ns()}", prompts[i], params, loras[i])
            in_flight += 1
        for out in engine.step():
            generated += len(out.new_token_ids)
            if out.finished:
                in_flight -= 1
    dt = time.perf_counter() - t0
    return {
        "output_tokens": generated,
        "seconds": round(dt, 2),
        "output_tokens_per_s": round(generated / dt, 1),
    }


def decode_step_medians(base, with_lora, prompts, mixed, args) -> dict:  # type: ignore[no-untyped-def]
    """Median wall time of a decode step with --users running sequences, base vs 4 adapters, alternated."""
    import statistics

    from server.request import SamplingParams

    params = SamplingParams(max_tokens=3 * args.decode_steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(args.users):
        base.add_request(f"d{i}", prompts[i], params, None)
        with_lora.add_request(f"d{i}", prompts[i], params, mixed[i])
    while base.stats().num_running < args.users or base.scheduler.waiting:
        base.step()
    while with_lora.stats().num_running < args.users or with_lora.scheduler.waiting:
        with_lora.step()
    base.step(), with_lora.step()  # first pure decode steps
    state = with_lora.lora_manager.state
    default_dense = state.dense_max_tokens_per_slot
    # lora-4 = the default plan; the two forced modes show what the dense/grouped choice is worth
    modes = (("base", base, default_dense), ("lora-4", with_lora, default_dense))
    modes += (("lora-4-dense", with_lora, 1 << 30), ("lora-4-grouped", with_lora, 0))
    times: dict[str, list[float]] = {name: [] for name, _, _ in modes}
    for _ in range(args.decode_steps):
        for name, eng, dense_max in modes:
            state.dense_max_tokens_per_slot = dense_max
            t0 = time.perf_counter()
            eng.step()
            times[name].append(time.perf_counter() - t0)
    state.dense_max_tokens_per_slot = default_dense
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    return {
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "dtype": with_lora.info.dtype,
        "running_sequences": args.users,
        "distinct_adapters": len({m.name for m in mixed[: args.users] if m is not None}),
        "rank": args.rank,
        "median_decode_step_ms": {k: round(v, 2) for k, v in med.items()},
        "throughput_ratio_lora4_vs_base": round(med["base"] / med["lora-4"], 3),
        "throughput_ratio_dense_vs_base": round(med["base"] / med["lora-4-dense"], 3),
        "throughput_ratio_grouped_vs_base": round(med["base"] / med["lora-4-grouped"], 3),
        "resident_slot_bytes_per_adapter": with_lora.lora_manager.slot_bytes(),
    }


def micro(args) -> dict:  # type: ignore[no-untyped-def]
    """Delta cost of one decoder layer's wrapped projections (SmolLM2-135M shapes, base excluded), dense
    vs grouped-by-slot, per token count; the two modes alternate call by call. Process CPU time, so run
    it with --threads 1 (robust to a shared machine: time spent descheduled is not counted)."""
    import statistics

    from server.lora.layers import LoRALinear, LoRAStepPlan, LoRAStepState

    class Zero(torch.nn.Module):  # a base projection that costs nothing: only the delta is timed
        def __init__(self, i: int, o: int) -> None:
            super().__init__()
            self.in_features, self.out_features = i, o

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.new_zeros(x.shape[0], self.out_features)

    h, inter, kv, big_r, loras = 576, 1536, 192, args.rank, args.adapters
    dev, dt = torch.device("cpu"), torch.float32
    st = LoRAStepState(max_rank=big_r)
    projs = [
        (
            LoRALinear(
                Zero(h, h + 2 * kv), [("q_proj", h), ("k_proj", kv), ("v_proj", kv)], st, loras, dev, dt
            ),
            h,
        ),
        (LoRALinear(Zero(h, h), [("o_proj", h)], st, loras, dev, dt), h),
        (LoRALinear(Zero(h, 2 * inter), [("gate_proj", inter), ("up_proj", inter)], st, loras, dev, dt), h),
        (LoRALinear(Zero(inter, h), [("down_proj", h)], st, loras, dev, dt), inter),
    ]
    for p, _ in projs:
        for s in range(loras):
            p.set_slot(
                s,
                [
                    (torch.randn(big_r, p.in_features) * 0.02, torch.randn(o, big_r) * 0.02)
                    for _, o in p.sub_modules
                ],
            )
    out: dict[str, dict[str, float]] = {}
    for tokens in (args.users, 4 * args.users, 256, 1024):
        slots = [i % loras for i in range(tokens)]  # round-robin: the worst case for grouping
        xs = {i: torch.randn(tokens, i) for i in (h, inter)}
        times: dict[str, list[float]] = {"dense": [], "segments": []}
        for _ in range(args.micro):
            for mode, dmax in (("dense", 1 << 30), ("segments", 0)):
                t0 = time.process_time()
                st.plan = LoRAStepPlan.build(slots, big_r, dev, dt, dense_max_tokens_per_slot=dmax)
                st.plan._work = st._work
                with torch.inference_mode():
                    for p, i in projs:
                        p(xs[i])
                times[mode].append(time.process_time() - t0)
        out[str(tokens)] = {k: round(statistics.median(v) * 1e6, 1) for k, v in times.items()}
    return {
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "adapters": loras,
        "rank": big_r,
        "us_per_layer_by_tokens": out,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--decode-steps",
        type=int,
        default=0,
        help="instead of closed loops: time N decode steps of --users sequences, alternating base and "
        "lora-4 step by step, and report medians (robust on a shared machine)",
    )
    ap.add_argument("--micro", type=int, default=0, help="only time one layer's deltas, N calls per mode")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: the runtime's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.micro:
        print(json.dumps(micro(args), indent=1))
        return

    from lora_adapters import make_adapter

    from server.config import CacheConfig, EngineConfig, LoRAConfig, LoRAModule, ModelConfig
    from server.engine import LLMEngine
    from server.models.loader import resolve_model

    folder = resolve_model(args.model).folder
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    all7 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    paths = {
        f"a{i}": make_adapter(folder, tmp / f"a{i}", args.rank, all7, seed=i, std=0.02)
        for i in range(args.adapters)
    }

    def engine(lora: bool) -> LLMEngine:
        cfg = (
            LoRAConfig(
                enable_lora=True,
                lora_modules=tuple(LoRAModule(n, str(p)) for n, p in paths.items()),
                max_loras=args.adapters,
                max_lora_rank=args.rank,
            )
            if lora
            else LoRAConfig()
        )
        e = LLMEngine(
            EngineConfig(
                model=ModelConfig(model=str(folder), dtype=args.dtype),
                cache=CacheConfig(enable_prefix_caching=False, kv_cache_memory_bytes=1 << 30),
                max_num_seqs=args.users,
                lora=cfg,
            )
        )
        e.warmup()
        return e

    base, with_lora = engine(False), engine(True)
    assert with_lora.lora is not None and with_lora.lora_manager is not None
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 40000, (args.requests, args.prompt_len), generator=g).tolist()
    names = [with_lora.lora.get(n) for n in paths]
    mixed = [names[i % len(names)] for i in range(args.requests)]
    none = [None] * args.requests
    if args.decode_steps:
        print(json.dumps(decode_step_medians(base, with_lora, prompts, mixed, args), indent=1))
        return
    results: dict[str, list[float]] = {"base": [], "lora-base": [], "lora-4": []}
    for _ in range(args.rounds):
        results["base"].append(
            run_closed_loop(base, prompts, none, args.users, args.new_tokens)["output_tokens_per_s"]
        )
        results["lora-base"].append(
            run_closed_loop(with_lora, prompts, none, args.users, args.new_tokens)["output_tokens_per_s"]
        )
        results["lora-4"].append(
            run_closed_loop(with_lora, prompts, mixed, args.users, args.new_tokens)["output_tokens_per_s"]
        )
    best = {k: max(v) for k, v in results.items()}
    adapter_bytes = [with_lora.lora.weights(n).nbytes for n in names if n is not None]
    print(
        json.dumps(
            {
                "cpu": platform.processor() or platform.machine(),
                "torch_threads": torch.get_num_threads(),
                "model": with_lora.info.model_id,
                "dtype": with_lora.info.dtype,
                "users": args.users,
                "requests_per_round": args.requests,
                "prompt_len": args.prompt_len,
                "new_tokens": args.new_tokens,
                "adapters": args.adapters,
                "rank": args.rank,
                "output_tokens_per_s_by_round": results,
                "best_output_tokens_per_s": best,
                "ratio_lora4_vs_base": round(best["lora-4"] / best["base"], 3),
                "ratio_lora_base_rows_vs_base": round(best["lora-base"] / best["base"], 3),
                "resident_slot_bytes_per_adapter": with_lora.lora_manager.slot_bytes(),
                "adapter_weight_bytes": adapter_bytes,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
