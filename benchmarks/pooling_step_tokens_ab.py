"""A/B of the pooling step's token target (`--pooling-step-tokens`, server/core/scheduler.py) in one
process on a real-shape embedder (issue 49 item 5): 64 texts of 8-40 words arrive together and the
pooling engine core steps until all are answered, each target in turn, alternated over `--rounds`; then
one client's sequential texts (one input per step: no target changes them). Prints one JSON line per
run: each text's latency from the burst's start (p50, max), texts/s, and per step its tokens, seconds
and seconds per token (the step cost the target trades against). No HTTP: the forward and the
scheduler only. Take the machine-wide lock for the real-shape model:

    flock /work/locks/realshape.lock python benchmarks/pooling_step_tokens_ab.py \
        [--model ~/.cache/kubeinfer/embedding-shapes/qwen3-embedding-0.6b] [--targets 0 512 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from server.pooling.engine import PoolingEngineCore
from server.pooling.model import PoolingTask, load_pooling_model, pooling_dtypes
from server.request import PoolingParams, SamplingParams

WORDS = [
    "the",
    "a",
    "of",
    "search",
    "vector",
    "model",
    "query",
    "document",
    "answer",
    "retrieval",
    "latency",
    "cluster",
    "node",
    "memory",
]


def texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) for _ in range(n)]


def burst(core: PoolingEngineCore, ids: list[list[int]], tag: str) -> dict[str, object]:
    t0 = time.perf_counter()
    for i, tokens in enumerate(ids):
        core.add_request(f"{tag}-{i}", tokens, SamplingParams(max_tokens=1), pooling=PoolingParams())
    done: list[float] = []
    steps: list[tuple[int, float]] = []
    while core.has_unfinished():
        s0 = time.perf_counter()
        tokens_before = core.pool_stats.num_prompt_tokens
        outs = core.step()
        steps.append((core.pool_stats.num_prompt_tokens - tokens_before, time.perf_counter() - s0))
        done += [time.perf_counter() - t0] * len(outs)
    wall = time.perf_counter() - t0
    return {
        "texts": len(done),
        "latency_p50_s": round(statistics.median(done), 3),
        "latency_max_s": round(max(done), 3),
        "texts_per_s": round(len(done) / wall, 3),
        "steps": [(n, round(t, 3), round(t / n * 1e3, 2)) for n, t in steps],  # tokens, s, ms/token
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    default = Path.home() / ".cache" / "kubeinfer" / "embedding-shapes" / "qwen3-embedding-0.6b"
    ap.add_argument("--model", type=Path, default=default)
    ap.add_argument("--targets", type=int, nargs="+", default=[0, 512, 1024])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    model = load_pooling_model(args.model, PoolingTask("embed"), **pooling_dtypes(args.dtype))
    tok = model.tokenizer
    ids = [tok(t)["input_ids"] for t in texts(args.clients, 0)]
    budget = max(model.max_model_len, 2048)
    cores = {t: PoolingEngineCore(model, args.clients, budget, step_tokens=t) for t in args.targets}
    for core in cores.values():  # warm each (threads measured, kernels built)
        burst(core, ids[:8], "warm")
    print(json.dumps({"model": str(args.model), "tokens": sum(map(len, ids)), "load": os.getloadavg()}))
    for r in range(args.rounds):
        order = args.targets if r % 2 == 0 else args.targets[::-1]
        for t in order:
            res = burst(cores[t], ids, f"r{r}t{t}")
            print(json.dumps({"round": r, "target": t, "load": os.getloadavg()[0], **res}), flush=True)
    one = [burst(cores[args.targets[0]], [x], f"one{i}")["latency_p50_s"] for i, x in enumerate(ids[:10])]
    print(json.dumps({"one_client_p50_s": statistics.median(one)}))  # type: ignore[type-var]


if __name__ == "__main__":
    main()
