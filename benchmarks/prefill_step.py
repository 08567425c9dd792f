"""The engine's prefill steps, engine only (no server): waves of prompts arriving at once. Prints JSON.

    python benchmarks/prefill_step.py --users 16                      # 16 x 128-token prompts, 64 new
    python benchmarks/prefill_step.py --users 32 --shared-prefix 512  # chunk steps over a cached prefix
    python benchmarks/prefill_step.py --threads 1 --smoke             # 2 users, 8 new: checks the script

Per wave (the first, which warms the engine, is left out): every step of more tokens than users (the
prompt steps) with its token count, wall ms and process CPU ms, their sums, the decode steps' sums, and
output tokens per second over the wave's wall time. CPU ms (`time.process_time`, all threads of the
process) is what to compare on a shared machine: wall time there includes the time the OS gave to
others, and with 2 threads each parallel region waits for the slower one (docs/benchmarks.md, "CPU: the
prefill step"). Compare two trees by running this script from each, interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from server.config import EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.request import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128, help="each user's own tokens")
    ap.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt of a wave starts with")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--waves", type=int, default=2, help="measured waves, after one warm-up wave")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.users, args.max_tokens, args.waves = 2, 8, 1
    config = EngineConfig(model=ModelConfig(model=None), num_threads=args.threads, thread_policy="fixed")
    engine = LLMEngine(config)  # the embedded SmolLM2 GGUF, every step on `--threads` threads
    gen = torch.Generator().manual_seed(0)
    waves = []
    for w in range(args.waves + 1):
        prefix = torch.randint(100, 49000, (args.shared_prefix,), generator=gen).tolist()
        for i in range(args.users):
            own = torch.randint(100, 49000, (args.prompt_tokens,), generator=gen).tolist()
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(f"w{w}-{i}", prefix + own, params)
        steps = []
        start = time.perf_counter()
        while engine.scheduler.has_unfinished():
            wall, cpu = time.perf_counter(), time.process_time()
            engine.step()
            wall, cpu = (time.perf_counter() - wall) * 1000, (time.process_time() - cpu) * 1000
            steps.append((engine.scheduler._last_batched_tokens, wall, cpu))  # the step's token count
        total = time.perf_counter() - start
        if w == 0:
            continue
        prompt = [s for s in steps if s[0] > args.users]
        decode = [s for s in steps if s[0] <= args.users]
        waves.append(
            {
                "prompt_steps": [
                    {"tokens": n, "wall_ms": round(t, 1), "cpu_ms": round(c, 1)} for n, t, c in prompt
                ],
                "prompt_wall_ms": round(sum(s[1] for s in prompt)),
                "prompt_cpu_ms": round(sum(s[2] for s in prompt)),
                "decode_steps": len(decode),
                "decode_wall_ms": round(sum(s[1] for s in decode)),
                "decode_cpu_ms": round(sum(s[2] for s in decode)),
                "output_tok_s": round(args.users * args.max_tokens / total, 1),
            }
        )
    print(
        json.dumps(
            {
                "users": args.users,
                "prompt_tokens": args.prompt_tokens,
                "shared_prefix": args.shared_prefix,
                "max_tokens": args.max_tokens,
                "threads": args.threads,
                "load_average": os.getloadavg(),
                "waves": waves,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
