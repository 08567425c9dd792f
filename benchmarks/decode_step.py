"""Decode step time of the embedded GGUF model by how the layer loop runs; prints JSON.

    python benchmarks/decode_step.py [--users 1 16 --prompt-len 128 --steps 40]

Three ways through the same engine, same weights, same batch, taking single steps in rotation so that
the machine's load hits all three alike:
- `graph`: the decode graph, the whole layer loop in one compiled call (server/models/decode_graph.py);
- `fused`: the Python-driven loop over the compiled fused ops (server/models/cpu_fused.py);
- `torch`: the Python loop over plain torch ops between the projection kernels.
Per mode: decode step ms p50 and min, and the speedups of graph and fused over torch (p50 ratio).
The engine is driven directly (no HTTP); benchmarks/peers_side_by_side.py measures the served whole.
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

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.request import SamplingParams

MODES = ("graph", "fused", "torch")


def measure(engine: LLMEngine, users: int, prompt_len: int, steps: int) -> dict[str, object]:
    model = engine.loaded.model
    ops = model.fused_ops
    if ops is None:
        raise SystemExit("the fused CPU ops are unavailable here (no compiler?): nothing to compare")
    g = torch.Generator().manual_seed(users)
    for i in range(users):
        prompt = torch.randint(100, 49000, (prompt_len,), generator=g).tolist()
        engine.add_request(
            f"u{users}-{i}", prompt, SamplingParams(max_tokens=10**4, temperature=0.0, ignore_eos=True)
        )
    while engine.scheduler.waiting or any(not r.output_token_ids for r in engine.scheduler.running):
        engine.step()  # every prompt prefilled: from here on each step is a pure decode step
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(steps):
        for mode in MODES[i % 3 :] + MODES[: i % 3]:
            model.fused_ops = None if mode == "torch" else ops
            model.use_decode_graph = mode == "graph"
            t0 = time.perf_counter()
            engine.step()
            times[mode].append(time.perf_counter() - t0)
    model.fused_ops, model.use_decode_graph = ops, True
    for i in range(users):
        engine.abort_request(f"u{users}-{i}")
    p50 = {m: statistics.median(v) * 1e3 for m, v in times.items()}
    return {
        "users": users,
        "step_ms_p50": {m: round(v, 3) for m, v in p50.items()},
        "step_ms_min": {m: round(min(v) * 1e3, 3) for m, v in times.items()},
        "speedup_vs_torch_p50": {m: round(p50["torch"] / p50[m], 3) for m in ("graph", "fused")},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40, help="steps per mode")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model=ModelConfig(), cache=CacheConfig()))
    result = {
        "benchmark": "decode step of the embedded GGUF, layer loop as graph / fused / torch, steps rotated",
        "cpu": cpu_info(),
        "threads": torch.get_num_threads(),
        "load_average_at_start": list(os.getloadavg()),
        "runs": [measure(engine, u, args.prompt_len, args.steps) for u in args.users],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
