"""One user's decode step of a real-shape MoE GGUF in-process: the decode graph (one C++ call for the
decoder layers, MoE blocks included) against the Python fused path (`use_decode_graph = False`: compiled
norms and attention, FusedMoE's router in torch and its experts' native call per layer), alternated in one
process, and where the fused path's step goes (MoE blocks, the LM head + sampling, the rest).

The machine may be shared: compare the ratios; the load average is printed before and after.

    python benchmarks/moe_decode_step.py [--gguf FILE --prompt 128 --rounds 6 --steps 8 --users 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.models.llama import LlamaForCausalLM
from server.models.moe import SparseMoeBlock
from server.request import SamplingParams

DEFAULT_GGUF = Path.home() / ".cache/kubeinfer/real-shapes/qwen3-moe-2b/qwen3-moe-2b-Q4_K_M.gguf"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--users", type=int, default=1, help="requests decoding together (one row each)")
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(args.gguf), max_model_len=1024),
            cache=CacheConfig(block_size=16, num_kv_blocks=64 * args.users, enable_prefix_caching=False),
        )
    )
    model = engine.loaded.model
    timers: dict[str, float] = {"moe": 0.0, "head": 0.0}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timers[name] += time.perf_counter() - t0

        return wrapper

    SparseMoeBlock.forward = timed("moe", SparseMoeBlock.forward)  # type: ignore[method-assign]
    LlamaForCausalLM.compute_logits = timed("head", LlamaForCausalLM.compute_logits)  # type: ignore[method-assign]
    steps_total = 2 + 2 * args.rounds * args.steps
    params = SamplingParams(max_tokens=steps_total + 2 * args.rounds + 8, temperature=0.0, ignore_eos=True)
    started: set[str] = set()
    for u in range(args.users):
        engine.add_request(str(u), list(range(1000 + u, 1000 + u + args.prompt)), params)
    while len(started) < args.users:  # every prompt prefilled: the timed steps are pure decode
        started |= {out.request_id for out in engine.step() if out.new_token_ids}
    per: dict[str, list[float]] = {"graph": [], "fused": []}
    parts: dict[str, list[float]] = {"moe": [], "head": []}
    tokens: dict[str, list[int]] = {"graph": [], "fused": []}
    for r in range(args.rounds):
        for mode in ("graph", "fused") if r % 2 == 0 else ("fused", "graph"):
            model.use_decode_graph = mode == "graph"
            engine.step()  # warm: the graph recorded once, caches in the mode's state
            for _ in range(args.steps):
                timers.update(moe=0.0, head=0.0)
                t0 = time.perf_counter()
                outs = engine.step()
                per[mode].append((time.perf_counter() - t0) * 1e3)
                tokens[mode] += [t for o in outs for t in o.new_token_ids]
                if mode == "fused":
                    parts["moe"].append(timers["moe"] * 1e3)
                    parts["head"].append(timers["head"] * 1e3)
    graph_ms, fused_ms = statistics.median(per["graph"]), statistics.median(per["fused"])
    assert model._decode_graph is not None and model._decode_graph[1] is not None, "graph not recorded"
    print(
        json.dumps(
            {
                "gguf": args.gguf.name,
                "threads": torch.get_num_threads(),
                "users": args.users,
                "load_before_after": [round(load0, 2), round(os.getloadavg()[0], 2)],
                "graph_ms_median": round(graph_ms, 2),
                "fused_ms_median": round(fused_ms, 2),
                "fused_over_graph": round(fused_ms / graph_ms, 3),
                "fused_moe_blocks_ms": round(statistics.median(parts["moe"]), 2),
                "head_ms": round(statistics.median(parts["head"]), 2),
                "graph_ms_all": [round(x, 1) for x in per["graph"]],
                "fused_ms_all": [round(x, 1) for x in per["fused"]],
            }
        )
    )


if __name__ == "__main__":
    main()
