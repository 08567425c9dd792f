"""One stream's greedy decode and resident memory of a model as several checkouts of this repository load it,
alternated in fresh processes; prints JSON.

    python benchmarks/checkout_ab.py [--model ~/.cache/kubeinfer/real-shapes/llama-3.2-1b/llama-3.2-1b-Q4_K_M.gguf] \
        --checkout old=/tmp/old-tree --checkout new=. --rounds 2 [--env KUBEINFER_CPU_DISABLE=avx512_bf16,amx_bf16]

For a change whose old behaviour no switch of the new code restores (a load-time layout, a dtype rule), the
A/B is between commits: `git worktree add /tmp/old-tree HEAD~1`, then this; two settings of one checkout
are two names for the same path with `--checkout-env NAME:VAR=VALUE` apart. Each round runs every checkout
once, in turn, in its own process (the same environment, `--env` and its own `--checkout-env` added, the
checkout first on sys.path):
`python -m server`'s engine with its defaults over the model, a `--prompt-len`-token prompt, one warm-up
request, then `--new-tokens` greedy tokens ignoring EOS. Per run: decode tokens/s (the tokens after the first
over the time from the first token to the last), TTFT ms, resident memory (VmRSS) after load and after the
run, the engine's `/info` `gemm_dtype` and weight bytes, and the layouts its projections hold. Per checkout:
the median tokens/s and the ratio to the first checkout's median, the same for the engine's load seconds
(`load_s`, and the resident peak `VmHWM` at its end). `--fresh-cache`: each run loads into a new, empty cache
folder: a first start (a GGUF's metadata folder: its tokenizer converted, server/gguf_file.py). The CPU
(model name, flags that decide the kernels' paths) and the load average are recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from peers_side_by_side import cpu_info  # the same CPU record as the served runs

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import server  # noqa: F401  (CPU runtime settings before torch loads)
import torch
from server.config import EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.request import SamplingParams

def rss_mib(field="VmRSS:"):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    return 0.0

model, prompt_len, new_tokens = sys.argv[2] or None, int(sys.argv[3]), int(sys.argv[4])
cache_dir = {"cache_dir": __import__("pathlib").Path(sys.argv[5])} if sys.argv[5] else {}
t_load = time.perf_counter()
engine = LLMEngine(EngineConfig(model=ModelConfig(model=model, **cache_dir)))
load_s = time.perf_counter() - t_load
loaded_rss, load_peak = rss_mib(), rss_mib("VmHWM:")
vocab = engine.loaded.arch.vocab_size
prompt = [(7 + 31 * i) % (vocab - 10) + 5 for i in range(prompt_len)]
params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
engine.generate([prompt[:16]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
engine.add_request("r", prompt, params)
t0 = time.perf_counter()
times = []
while engine.has_unfinished():
    for out in engine.step():
        times.append(time.perf_counter())
        break
from server.quant.block_linear import BlockQuantLinear
layouts = sorted({m.weight_q.fmt for m in engine.loaded.model.modules() if isinstance(m, BlockQuantLinear)})
print(json.dumps({
    "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]),
    "ttft_ms": 1000 * (times[0] - t0),
    "load_s": round(load_s, 2),
    "rss_load_peak_mib": round(load_peak),
    "tokens": len(times),
    "rss_loaded_mib": round(loaded_rss),
    "rss_after_mib": round(rss_mib()),
    "gemm_dtype": engine.info.gemm_dtype,
    "weight_bytes": engine.info.weight_bytes,
    "layouts": layouts,
    "server": server.__file__,
}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="a model path or GGUF file (default: the embedded model)")
    ap.add_argument(
        "--checkout", action="append", required=True, help="NAME=PATH, in order; the first is the baseline"
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--env", action="append", default=[], help="VAR=VALUE for every run")
    ap.add_argument(
        "--fresh-cache",
        action="store_true",
        help="each run loads into a new, empty cache folder: a first start (a GGUF's metadata folder, "
        "conversions), its seconds the load_s figure",
    )
    ap.add_argument(
        "--checkout-env", action="append", default=[], help="NAME:VAR=VALUE for one checkout's runs"
    )
    args = ap.parse_args()
    checkouts = [tuple(c.split("=", 1)) for c in args.checkout]
    if any(len(c) != 2 for c in checkouts):
        raise SystemExit("--checkout takes NAME=PATH")
    env = dict(os.environ)
    for item in args.env:
        var, _, value = item.partition("=")
        env[var] = value
    own: dict[str, dict[str, str]] = {name: {} for name, _ in checkouts}
    for item in args.checkout_env:
        name, _, setting = item.partition(":")
        var, _, value = setting.partition("=")
        if name not in own or not var:
            raise SystemExit(f"--checkout-env {item!r}: expected NAME:VAR=VALUE with NAME a --checkout")
        own[name][var] = value
    runs: dict[str, list[dict[str, object]]] = {name: [] for name, _ in checkouts}
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for _ in range(args.rounds):
        for name, path in checkouts:
            root = str(Path(path).resolve())
            with tempfile.TemporaryDirectory(prefix="checkout-ab-cache-") as fresh:
                out = subprocess.run(
                    [
                        sys.executable,
                        "-c",
                        CHILD,
                        root,
                        args.model,
                        str(args.prompt_len),
                        str(args.new_tokens),
                        fresh if args.fresh_cache else "",
                    ],
                    env={**env, **own[name]},
                    cwd=root,
                    capture_output=True,
                    text=True,
                    check=False,
                )
            if out.returncode != 0:
                raise SystemExit(f"{name}: exit {out.returncode}\n{out.stderr[-3000:]}")
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))

    def median(name: str, key: str) -> float:
        return statistics.median(float(r[key]) for r in runs[name])  # type: ignore[arg-type]

    first = checkouts[0][0]
    summary = {}
    for name, _ in checkouts:
        summary[name] = {
            "decode_tok_s_median": round(median(name, "decode_tok_s"), 2),
            "ratio_to_first": round(median(name, "decode_tok_s") / median(first, "decode_tok_s"), 3),
            "load_s_median": round(median(name, "load_s"), 2),
            "load_s_ratio_to_first": round(median(name, "load_s") / median(first, "load_s"), 3),
            "rss_load_peak_mib_median": round(median(name, "rss_load_peak_mib")),
        }
    print(
        json.dumps(
            {
                "started": started,
                "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "cpu": cpu_info(),
                "loadavg": os.getloadavg(),
                "model": args.model,
                "env": args.env,
                "fresh_cache": args.fresh_cache,
                "checkout_env": own,
                "runs": runs,
                "summary": summary,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
