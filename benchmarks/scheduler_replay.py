"""The scheduler alone, before vs after a change, under a step-time model: no model runs, so the figures
do not move with a shared machine's load (benchmarks/long_prompt_ttft.py measures the served ones,
which on a loaded 2-core machine swung 2x between rounds). Prints JSON.

`--baseline REF`'s server/core/scheduler.py (git show) and the working tree's each drive the real
KVCacheManager through the same arrivals; each step costs
`step_s + prompt_token_s * prompt tokens + decode_s * decodes + attention_s * sum(query x context)`,
defaults from this CPU's measurements (docs/benchmarks.md: a 2048-token step of the embedded model
1.2-1.5 s, a step of 32 decodes 45-55 ms). Scenarios: `--users` prompts of `--prompt-len` tokens at
once (issue 49: 8 x 3,000), and one stream decoding when a `--long-len` prompt arrives (the stream's
step gaps while it prefills). TTFT p50/p90, ITL p50/p99 in model seconds.

    python benchmarks/scheduler_replay.py --baseline c3b4a1e [--users 8 --prompt-len 3000]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from server.core.kv_cache_manager import KVCacheManager
from server.core.outputs import ModelOutput, SchedulerOutput
from server.core.prefill_cap import AdaptivePrefillCap, PrefillCapConfig, step_shape
from server.request import Request, SamplingParams

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class StepModel:
    step_s: float = 0.015
    prompt_token_s: float = 0.00065
    decode_s: float = 0.001
    attention_s: float = 2e-8  # per query token x context token
    mixed_step_s: float = 0.0  # more per step that carries prompt tokens (its layer loop runs from Python)

    def cost(self, out: SchedulerOutput) -> float:
        decodes = sum(1 for i in out.scheduled if i.num_new_tokens == 1 and i.sample)
        prompt = sum(i.num_new_tokens for i in out.scheduled) - decodes
        attention = sum(i.num_new_tokens * (i.start + i.num_new_tokens) for i in out.scheduled)
        return (
            self.step_s
            + (self.mixed_step_s if prompt else 0.0)
            + self.prompt_token_s * prompt
            + self.decode_s * decodes
            + self.attention_s * attention
        )


def _scheduler_module(ref: str | None) -> ModuleType:
    path = REPO / "server" / "core" / "scheduler.py"
    name = "replay_scheduler_" + (ref or "worktree")
    if ref is not None:
        src = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{ref}:server/core/scheduler.py"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        path = Path(tempfile.mkdtemp()) / "scheduler.py"
        path.write_text(src)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))], 4) if s else float("nan")


def replay(
    mod: ModuleType,
    model: StepModel,
    arrivals: list[tuple[float, int, int]],  # (time s, prompt tokens, max new tokens)
    budget: int,
    cap: int,
    itl_factor: float = 0.0,
) -> dict[str, dict[str, list[float]]]:
    """`itl_factor` > 0: the cap sized from the model's step costs (server/core/prefill_cap.py), fed
    every step's modelled seconds as the engine feeds it the measured ones (working tree only)."""
    cfg = mod.SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=256,
        max_model_len=32768,
        long_prefill_token_threshold=cap,
    )
    adaptive = None
    if itl_factor:
        adaptive = AdaptivePrefillCap(
            PrefillCapConfig(
                itl_factor=itl_factor, initial=min(cap, budget), min_tokens=16, max_tokens=budget
            )
        )
        sched = mod.Scheduler(cfg, KVCacheManager(1 << 16, 16, False), prefill_cap=adaptive)
    else:
        sched = mod.Scheduler(cfg, KVCacheManager(1 << 16, 16, False))
    pending = sorted((t, i, n, m) for i, (t, n, m) in enumerate(arrivals))
    now = 0.0
    start: dict[str, float] = {}
    stamps: dict[str, list[float]] = {}
    while pending or sched.has_unfinished():
        while pending and pending[0][0] <= now:
            t, i, n, m = pending.pop(0)
            params = SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
            sched.add_request(Request(f"r{i}", list(range(1, n + 1)), params, eos_token_ids=frozenset({0})))
            start[f"r{i}"] = t
        if not sched.has_unfinished():
            now = pending[0][0]
            continue
        out = sched.schedule()
        cost = model.cost(out)
        now += cost
        if adaptive is not None:
            adaptive.observe(step_shape(out), cost)
        for s in out.scheduled:
            if s.sample:
                stamps.setdefault(s.request.request_id, []).append(now)
        sampled = {s.request.request_id: 5 for s in out.scheduled if s.sample}
        sched.update_from_output(out, ModelOutput(sampled_token_ids=sampled))
    return {rid: {"start": [start[rid]], "tokens": times} for rid, times in stamps.items()}


def _summary(runs: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    ttft = [r["tokens"][0] - r["start"][0] for r in runs.values()]
    itl = [b - a for r in runs.values() for a, b in zip(r["tokens"], r["tokens"][1:], strict=False)]
    return {
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p90_s": _pct(ttft, 0.9),
        "itl_p50_s": _pct(itl, 0.5),
        "itl_p99_s": _pct(itl, 0.99),
        "last_token_s": round(max(r["tokens"][-1] for r in runs.values()), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=3000)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--long-len", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=2048, help="--max-num-batched-tokens")
    ap.add_argument("--cap", type=int, default=128, help="--long-prefill-token-threshold (CPU default)")
    ap.add_argument(
        "--prefill-itl-factor", type=float, default=0.0, help="the working tree's arm: the measured cap"
    )
    ap.add_argument("--mixed-step-s", type=float, default=0.0, help="model: more per step with prompt tokens")
    args = ap.parse_args()
    model = StepModel(mixed_step_s=args.mixed_step_s)
    result: dict[str, Any] = {"step_model": asdict(model), "args": vars(args)}
    for label, ref in (("before", args.baseline), ("after", None)):
        mod = _scheduler_module(ref)
        f = args.prefill_itl_factor if ref is None else 0.0
        burst = replay(
            mod,
            model,
            [(0.0, args.prompt_len, args.max_new_tokens)] * args.users,
            args.budget,
            args.cap,
            f,
        )
        stream = replay(mod, model, [(0.0, 100, 400), (1.0, args.long_len, 2)], args.budget, args.cap, f)
        long_start, long_first = stream["r1"]["start"][0], stream["r1"]["tokens"][0]
        gaps = [
            b - a
            for a, b in zip(stream["r0"]["tokens"], stream["r0"]["tokens"][1:], strict=False)
            if long_start < b <= long_first
        ]
        quiet = [
            b - a
            for a, b in zip(stream["r0"]["tokens"], stream["r0"]["tokens"][1:], strict=False)
            if b <= long_start
        ]
        result[label] = {
            f"burst_{args.users}x{args.prompt_len}": _summary(burst),
            f"stream_beside_{args.long_len}": {
                "long_ttft_s": round(long_first - long_start, 3),
                "stream_quiet_itl_p50_s": _pct(quiet, 0.5),
                "stream_itl_during_prefill_p99_s": _pct(gaps, 0.99),
                "stream_itl_during_prefill_max_s": round(max(gaps), 4),
            },
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
