"""int8 activations for the decode GEMV (server/quant/cpu_qgemv_q8.py) against fp32 ones; prints JSON.

    python benchmarks/int8_gemv.py                      # GEMV per layer shape, then served 1-user tok/s
    python benchmarks/int8_gemv.py --only gemv --smoke  # checks the script, timings mean little

Sections:
- `gemv`: per SmolLM2-135M layer shape (N x K of the fused q/k/v, o, fused gate/up, down and the tied
  LM head) and format (Q4_1, Q8_0, Q4_0), M rows of x: qlinear.cpp's fp32-activation GEMV and
  qgemv_q8.cpp's int8 one on each code path this CPU runs (vnni, avx2), interleaved call by call, the
  weights cycled through enough copies to exceed twice the last-level cache (each call streams its
  weight from memory, as a decode step does). Median us per call and the median per-repetition ratio.
- `step`: one engine on the embedded model (or `--model` FILE, e.g. a real-shape GGUF), 1 and 4 users
  (`--users`; 128-token prompts), pure decode steps
  alternating between the switch off and on (each state's decode graph recorded once, then swapped in):
  step ms p50 and min per state, and the median per-pair ratio.
- `served`: two `python -m server` processes on the embedded model, KUBEINFER_INT8_GEMV=0 and =1,
  both up at once; rounds of one user (chat API, streaming, 128-token prompts, 64 new tokens, greedy,
  ignore_eos: issue 31's load) alternate between them, the order flipped each round, so that the
  machine's load hits both alike. Output tok/s per round, medians, and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_qlinear import Cycle, cpu_model, llc_bytes, make, median_ratio

from server.quant import cpu_qgemv_q8 as q8
from server.quant import cpu_qlinear as cq

SHAPES = {
    "qkv_960x576": (960, 576),
    "o_576x576": (576, 576),
    "gate_up_3072x576": (3072, 576),
    "down_576x1536": (576, 1536),
    "lm_head_49152x576": (49152, 576),
}
# `--shapes llama-3.2-1b`: its projections (q/o, k/v, gate_up, down) and its tied 128,256-row LM head
LLAMA_1B_SHAPES = {
    "qo_2048x2048": (2048, 2048),
    "kv_512x2048": (512, 2048),
    "gate_up_16384x2048": (16384, 2048),
    "down_2048x8192": (2048, 8192),
    "lm_head_128256x2048": (128256, 2048),
}


def timed_cpu(
    fns: dict[str, Callable[[], object]], reps: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Interleaved repetitions: (name -> wall ms, name -> process CPU ms) of each. On a machine shared by
    many, CPU time is the steadier figure of the work done (wall time also counts the time slices other
    processes took); with one thread it is the kernel's own time."""
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(reps):
        for name, f in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            f()
            cpu[name].append((time.process_time() - c0) * 1e3)
            wall[name].append((time.perf_counter() - t0) * 1e3)
    return wall, cpu


def gemv_rows(fmts: list[str], shapes: dict[str, tuple[int, int]], ms: list[int], cold: int, reps: int):  # type: ignore[no-untyped-def]
    kernel = cq.load_qlinear_kernel()
    fast = q8.load_q8_gemv_kernel(kernel)
    best = fast.isa
    paths = [p for p in ("vnni", "avx2") if q8.PATHS.index(p) <= q8.PATHS.index(best)]
    rows = []
    for fmt in fmts:
        for shape_name, (n, k) in shapes.items():
            cyc = Cycle(make(fmt, n, k), cold, max_copies=64)
            cyc.dense = cyc.dense[:1]  # only the quantized copies are used
            for m in ms:
                x = torch.randn(m, k)

                def fp32(x: torch.Tensor = x, cyc: Cycle = cyc) -> None:
                    kernel.linear(x, cyc.next_q())

                fns: dict[str, Callable[[], object]] = {"fp32": fp32}
                for p in paths:

                    def run(x: torch.Tensor = x, cyc: Cycle = cyc, p: str = p) -> None:
                        fast.set_path(p)
                        fast.linear(x, cyc.next_q())

                    fns[f"int8_{p}"] = run
                reps_here = max(3, reps // 8) if n * k > 4 << 20 else reps  # the LM head: 30x the work
                t, c = timed_cpu(fns, reps_here)
                row: dict[str, object] = {"format": fmt, "shape": shape_name, "M": m}
                row["fp32_us"] = round(statistics.median(t["fp32"]) * 1e3, 1)
                row["fp32_cpu_us"] = round(statistics.median(c["fp32"]) * 1e3, 1)
                for p in paths:
                    row[f"int8_{p}_us"] = round(statistics.median(t[f"int8_{p}"]) * 1e3, 1)
                    row[f"int8_{p}_cpu_us"] = round(statistics.median(c[f"int8_{p}"]) * 1e3, 1)
                    row[f"int8_{p}_speedup"] = round(median_ratio(t["fp32"], t[f"int8_{p}"]), 2)
                    row[f"int8_{p}_cpu_speedup"] = round(
                        statistics.median(c["fp32"]) / max(1e-9, statistics.median(c[f"int8_{p}"])), 2
                    )
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    fast.set_path(best)
    return rows


def steps(
    users_list: list[int], prompt_len: int, n_steps: int, model_path: str | None = None
) -> list[dict[str, object]]:
    """Decode step time of one engine with the int8 GEMV on and off, steps alternating (the decode graph
    recorded once per state and swapped in, the LM head following the switch)."""
    import server  # noqa: F401  (CPU runtime settings before the engine loads)
    from server.config import CacheConfig, EngineConfig, ModelConfig
    from server.engine import LLMEngine
    from server.request import SamplingParams

    engine = LLMEngine(
        EngineConfig(model=ModelConfig(model=model_path, max_model_len=1024), cache=CacheConfig())
    )
    model = engine.loaded.model
    rows: list[dict[str, object]] = []
    for users in users_list:
        g = torch.Generator().manual_seed(users)
        for i in range(users):
            prompt = torch.randint(100, 49000, (prompt_len,), generator=g).tolist()
            engine.add_request(
                f"u{users}-{i}", prompt, SamplingParams(max_tokens=10**4, temperature=0.0, ignore_eos=True)
            )
        while engine.scheduler.waiting or any(not r.output_token_ids for r in engine.scheduler.running):
            engine.step()
        graphs: dict[bool, object] = {}
        times: dict[bool, list[float]] = {False: [], True: []}
        cpu: dict[bool, list[float]] = {False: [], True: []}
        for i in range(2 * n_steps + 2):
            on = bool(i % 2) if (i // 2) % 2 == 0 else not (i % 2)  # order flipped every other pair
            with q8.int8_gemv(on):
                model._decode_graph = graphs.get(on)  # type: ignore[assignment]
                t0, c0 = time.perf_counter(), time.process_time()
                engine.step()
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                graphs[on] = model._decode_graph
            if i >= 2:  # the first of each records its graph
                times[on].append(dt * 1e3)
                cpu[on].append(dc * 1e3)
        for i in range(users):
            engine.abort_request(f"u{users}-{i}")
        engine.step()
        row: dict[str, object] = {
            "users": users,
            "graph_recorded": all(entry is not None and entry[1] is not None for entry in graphs.values()),  # type: ignore[index]
            "fp32_step_ms_p50": round(statistics.median(times[False]), 3),
            "int8_step_ms_p50": round(statistics.median(times[True]), 3),
            "fp32_step_ms_min": round(min(times[False]), 3),
            "int8_step_ms_min": round(min(times[True]), 3),
            "int8_speedup_p50_ratio": round(median_ratio(times[False], times[True]), 3),
            "fp32_step_cpu_ms_p50": round(statistics.median(cpu[False]), 3),
            "int8_step_cpu_ms_p50": round(statistics.median(cpu[True]), 3),
            "int8_cpu_speedup": round(statistics.median(cpu[False]) / statistics.median(cpu[True]), 3),
        }
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    model._decode_graph = None
    return rows


def served(rounds: int, requests: int, prompt_tokens: int, max_tokens: int, threads: int | None) -> dict:  # type: ignore[type-arg]
    import peers_side_by_side as peers

    from server.models.loader import resolve_model

    prompts = peers.make_prompts(resolve_model(None, keep_gguf=True).folder, requests, prompt_tokens, seed=31)
    servers = {}
    saved = os.environ.get(q8.ENABLE_ENV)
    try:
        for flag in ("0", "1"):
            os.environ[q8.ENABLE_ENV] = flag
            servers[flag] = peers.start("ours", Path("."), Path("."), threads)
        models = {flag: peers.wait_ready(srv, 900) for flag, srv in servers.items()}
        per_round: dict[str, list[float]] = {"0": [], "1": []}
        errors: list[str] = []
        for r in range(rounds):
            for flag in ("0", "1") if r % 2 == 0 else ("1", "0"):
                res = asyncio.run(peers.run_load(servers[flag].url, models[flag], prompts, 1, max_tokens))
                per_round[flag].append(res["output_tokens_per_s"])
                errors += res["errors"]
                print(json.dumps({"round": r, "int8": flag, **res}), file=sys.stderr, flush=True)
    finally:
        for srv in servers.values():
            peers.stop(srv)
        if saved is None:
            os.environ.pop(q8.ENABLE_ENV, None)
        else:
            os.environ[q8.ENABLE_ENV] = saved
    fp32, int8 = per_round["0"], per_round["1"]
    return {
        "load": {"users": 1, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "requests": requests},
        "fp32_tok_s_per_round": fp32,
        "int8_tok_s_per_round": int8,
        "fp32_tok_s_median": statistics.median(fp32),
        "int8_tok_s_median": statistics.median(int8),
        "int8_over_fp32": round(median_ratio(int8, fp32), 3),
        "errors": sorted(set(errors))[:5],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--only", default="gemv,step,served", help="sections to run")
    ap.add_argument("--steps", type=int, default=60, help="decode steps per state (`step`)")
    ap.add_argument("--reps", type=int, default=0)
    ap.add_argument("--formats", default="q4_1,q8_0,q4_0", help="also q4_k, q6_k (K in 256s)")
    ap.add_argument("--shapes", default="smollm2", choices=["smollm2", "llama-3.2-1b"], help="`gemv` shapes")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=4, help="requests per round (one user: one at a time)")
    ap.add_argument("--threads", type=int, default=0, help="torch and kernel threads (default: torch's)")
    ap.add_argument("--model", default=None, help="`step`: a .gguf or folder instead of the embedded model")
    ap.add_argument("--users", default="1,4", help="`step`: batch sizes")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    reps = args.reps or (3 if args.smoke else 41)
    sections = set(args.only.split(","))
    out: dict[str, object] = {
        "machine": {
            **cpu_model(),
            "threads": torch.get_num_threads(),
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "int8_isa": q8.load_q8_gemv_kernel(cq.load_qlinear_kernel()).isa,
            "llc_MiB": llc_bytes() >> 20,
        }
    }
    if "gemv" in sections:
        shapes = {"small_64x576": (64, 576)} if args.smoke else SHAPES
        if args.shapes == "llama-3.2-1b":
            shapes = {"small_64x2048": (64, 2048)} if args.smoke else LLAMA_1B_SHAPES
        cold = (4 << 20) if args.smoke else 2 * llc_bytes()
        out["gemv"] = gemv_rows(args.formats.split(","), shapes, [1, 4], cold, reps)
    if "step" in sections:
        users = [int(u) for u in args.users.split(",")]
        out["step"] = steps(users, 128, 6 if args.smoke else args.steps, args.model)
    if "served" in sections:
        out["served"] = served(
            2 if args.smoke else args.rounds,
            1 if args.smoke else args.requests,
            128,
            8 if args.smoke else 64,
            args.threads or None,
        )
    out["machine"]["load_avg_1m_end"] = round(os.getloadavg()[0], 2)  # type: ignore[index]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
