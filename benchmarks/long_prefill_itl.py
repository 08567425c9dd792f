"""A running stream's ITL while another request's long prompt prefills, and that prompt's TTFT, under the
fixed prefill cap (`--prefill-itl-factor 0`: 128 prompt tokens per step beside decodes) against the cap
sized from measured step costs (server/core/prefill_cap.py), alternated in one process on one warm
engine (engine only, no server). Prints JSON.

    python benchmarks/long_prefill_itl.py [--long-len 8000 --streams 1 --rounds 2 --threads 1
        --factors 0 2 --floors 16]

Per round and arm: `streams` requests decode (8-token prompts, greedy, ignore_eos); after `--quiet`
decode steps (their median gap is the quiet ITL) a `--long-len` prompt arrives; until its first token
the stream's gaps between tokens (wall: what a client sees) give ITL p50/p99 and their ratio to the quiet
ITL, and the prompt's TTFT (wall from its arrival), the number of steps, and the process CPU ms per prompt
token over those steps (decodes included: `time.process_time`, which a shared machine's load does not
inflate the way it does wall time); the same gaps and TTFT in process CPU seconds (`*_cpu_*`: with one
thread, what each step costs whatever the load; a loaded 2-core machine's wall gaps swing several-fold
between arms). `--floors` (measured arms only) overrides the cap's floor
(config.PREFILL_CAP_MIN_TOKENS) to show the TTFT trade-off. Threads fixed (`--threads`), so the step
thread policy does not move between arms.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time

import torch

import server.config as server_config
from server.config import EngineConfig, ModelConfig
from server.core.prefill_cap import AdaptivePrefillCap
from server.engine import LLMEngine
from server.request import SamplingParams


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def run_arm(engine: LLMEngine, factor: float, floor: int, args: argparse.Namespace, tag: str) -> dict:
    sched = engine.scheduler
    if factor:
        server_config.PREFILL_CAP_MIN_TOKENS = floor
        cfg = EngineConfig(
            model=ModelConfig(model=None),
            max_num_batched_tokens=args.budget,
            prefill_itl_factor=factor,
        ).prefill_cap_for("cpu")
        assert cfg is not None
        sched.prefill_cap = AdaptivePrefillCap(cfg)
    else:
        sched.prefill_cap = None  # the scheduler's fixed long_prefill_token_threshold (128 on CPU)
    engine.reset_prefix_cache()  # each arm's prompt is new to the cache
    gen = torch.Generator().manual_seed(sum(map(ord, tag)))
    streams = [f"{tag}-s{i}" for i in range(args.streams)]
    for rid in streams:
        prompt = torch.randint(100, 49000, (8,), generator=gen).tolist()
        engine.add_request(rid, prompt, SamplingParams(max_tokens=8000, temperature=0.0, ignore_eos=True))
    stamps: list[float] = []
    cpu_stamps: list[float] = []  # process CPU seconds at each of the stream's tokens

    def step() -> set[str]:
        outs = engine.step()
        now, cpu_now = time.perf_counter(), time.process_time()
        got = {o.request_id for o in outs if o.new_token_ids}
        if streams[0] in got:
            stamps.append(now)
            cpu_stamps.append(cpu_now)
        return got

    while len(stamps) < args.quiet + 2:
        step()
    quiet = statistics.median(b - a for a, b in itertools.pairwise(stamps[2:]))
    quiet_cpu = statistics.median(b - a for a, b in itertools.pairwise(cpu_stamps[2:]))
    long_id = f"{tag}-long"
    prompt = torch.randint(100, 49000, (args.long_len,), generator=gen).tolist()
    engine.add_request(long_id, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    t0, c0, n0, steps, caps = time.perf_counter(), time.process_time(), len(stamps), 0, []
    while True:
        got = step()
        steps += 1
        caps.append(sched.last_prefill_cap)
        if long_id in got:
            break
    ttft, cpu = time.perf_counter() - t0, time.process_time() - c0
    gaps = [b - a for a, b in itertools.pairwise(stamps[n0 - 1 :])]
    cpu_gaps = [b - a for a, b in itertools.pairwise(cpu_stamps[n0 - 1 :])]
    for rid in streams:
        engine.abort_request(rid)
    while engine.scheduler.has_unfinished():
        engine.step()
    return {
        "factor": factor,
        "floor": floor if factor else None,
        "quiet_itl_ms": round(quiet * 1000, 2),
        "itl_p50_ms": round(statistics.median(gaps) * 1000, 2),
        "itl_p99_ms": round(_pct(gaps, 0.99) * 1000, 2),
        "itl_p99_over_quiet": round(_pct(gaps, 0.99) / quiet, 2),
        "itl_p50_over_quiet": round(statistics.median(gaps) / quiet, 2),
        "quiet_itl_cpu_ms": round(quiet_cpu * 1000, 2),
        "itl_cpu_p50_over_quiet": round(statistics.median(cpu_gaps) / quiet_cpu, 2),
        "itl_cpu_p99_over_quiet": round(_pct(cpu_gaps, 0.99) / quiet_cpu, 2),
        "ttft_s": round(ttft, 2),
        "ttft_cpu_s": round(cpu, 2),
        "steps": steps,
        "cap_median": statistics.median(caps),
        "cap_min_max": [min(caps), max(caps)],
        "cpu_ms_per_prompt_token": round(cpu * 1000 / args.long_len, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long-len", type=int, default=8000)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--quiet", type=int, default=20, help="decode steps measured before the prompt")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budget", type=int, default=2048, help="--max-num-batched-tokens")
    ap.add_argument("--factors", type=float, nargs="+", default=[0.0, 2.0], help="0: the fixed cap")
    ap.add_argument("--floors", type=int, nargs="+", default=[16])
    args = ap.parse_args()
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=None),  # the embedded SmolLM2-135M GGUF
            num_threads=args.threads,
            thread_policy="fixed",
            max_num_batched_tokens=args.budget,
            prefill_itl_factor=0,
        )
    )
    arms = [(f, fl) for f in args.factors for fl in (args.floors if f else [0])]
    rounds = []
    for r in range(args.rounds):
        rounds.append(
            [run_arm(engine, f, fl, args, f"r{r}-{i}") for i, (f, fl) in enumerate(arms)]
            + [{"load_average": os.getloadavg()}]
        )
    print(
        json.dumps(
            {
                "long_len": args.long_len,
                "streams": args.streams,
                "threads": args.threads,
                "budget": args.budget,
                "cpu": _cpu_name(),
                "rounds": rounds,
            },
            indent=1,
        )
    )


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
