"""Interactive requests' time to first token under a batch flood, --scheduling-policy fcfs against
priority, in one run on the same engine settings (the embedded model by default). Prints JSON.

The flood: `--batch` requests (priority 10, `--batch-tokens` new tokens each, ignore_eos) fill every seat
(`--max-num-seqs`); then `--interactive` requests (priority 0, 8 new tokens) arrive one every
`--gap-ms`. Under fcfs each interactive request waits for a batch request to finish and free a seat;
under priority it preempts the worst running batch request and starts in the next step. Steps are
driven directly (LLMEngine.step), so the timings are the engine's, without HTTP.

    python benchmarks/priority.py [--batch 16 --max-num-seqs 8 --interactive 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import server  # noqa: F401  (CPU runtime settings before torch loads)


def run(policy: str, args: argparse.Namespace) -> dict[str, object]:
    from server.config import CacheConfig, EngineConfig, ModelConfig
    from server.engine import LLMEngine
    from server.request import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=args.model, dtype=args.dtype),
            cache=CacheConfig(enable_prefix_caching=False),
            max_num_seqs=args.max_num_seqs,
            scheduling_policy=policy,
        )
    )
    tok = engine.tokenizer
    batch_params = SamplingParams(max_tokens=args.batch_tokens, temperature=0.0, ignore_eos=True)
    chat_params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    batch_prompt = tok.encode("Summarise the following report in detail: " + "lorem ipsum " * 40)
    chat_prompt = tok.encode("What is the capital of France?")
    low, high = (10, 0) if policy == "priority" else (0, 0)
    for i in range(args.batch):
        engine.add_request(f"batch-{i}", batch_prompt, batch_params, priority=low)
    for _ in range(3):  # the flood is running before the first interactive request arrives
        engine.step()
    arrivals: dict[str, float] = {}
    first_token: dict[str, float] = {}
    next_arrival = time.monotonic()
    sent = 0
    batch_done = 0
    t0 = time.monotonic()
    while engine.has_unfinished() or sent < args.interactive:
        now = time.monotonic()
        if sent < args.interactive and now >= next_arrival:
            rid = f"chat-{sent}"
            engine.add_request(rid, chat_prompt, chat_params, priority=high)
            arrivals[rid] = now
            sent += 1
            next_arrival = now + args.gap_ms / 1000
        for out in engine.step():
            if out.request_id.startswith("chat-") and out.new_token_ids and out.request_id not in first_token:
                first_token[out.request_id] = time.monotonic()
            if out.request_id.startswith("batch-") and out.finished:
                batch_done += 1
        if not engine.has_unfinished() and sent < args.interactive:
            time.sleep(max(0.0, next_arrival - time.monotonic()))
    ttft = sorted(first_token[r] - arrivals[r] for r in arrivals)
    return {
        "policy": policy,
        "interactive_ttft_s": {
            "p50": statistics.median(ttft),
            "max": ttft[-1],
            "all": [round(t, 4) for t in ttft],
        },
        "batch_requests_finished": batch_done,
        "preemptions": engine.stats().num_preemptions,
        "wall_s": time.monotonic() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder or .gguf (default: the embedded SmolLM2)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--batch-tokens", type=int, default=96)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--interactive", type=int, default=8)
    ap.add_argument("--gap-ms", type=float, default=150.0)
    args = ap.parse_args()
    results = [run(policy, args) for policy in ("fcfs", "priority")]
    fcfs, prio = (r["interactive_ttft_s"] for r in results)
    print(
        json.dumps(
            {
                "benchmark": "interactive TTFT under a batch flood: fcfs vs priority",
                "cpu": platform.processor() or platform.machine(),
                "config": vars(args),
                "results": results,
                "ttft_p50_ratio_priority_over_fcfs": prio["p50"] / fcfs["p50"],  # type: ignore[index]
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
