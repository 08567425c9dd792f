"""A/B of the burst step's cost bound (server/core/burst_bound.py, issue 49 items 2-3) on the embedded
SmolLM2: 64 users each send one ~164-token chat prompt at once (distinct prompts, 32 new tokens, greedy).
Three servers up together (`s05`: the defaults, `--burst-itl-factor` 16 and `--burst-itl-seconds` 0.5;
`f16`: the factor alone, `--burst-itl-seconds 0`; `off`: `--burst-itl-factor 0`), warmed, then the load
runs on each in the alternated order given as argv[1] (default s05,f16,off,off,f16,s05); prints one JSON
line per run (output tok/s, TTFT and ITL percentiles). Run from the repository root:

    PYTHONPATH=$PWD NEW=32 python benchmarks/burst_bound_ab.py
"""

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx

sys.path.insert(0, "benchmarks")
from real_shape_loads import run_streams, summarize_streams


def start(port: int, extra: list[str]) -> subprocess.Popen[bytes]:
    with open(f"/tmp/burst_bound_ab_{port}.log", "w") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "server", "--port", str(port), "--host", "127.0.0.1", *extra],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=os.environ.copy(),
        )


def wait(port: int) -> None:
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return
        except Exception:
            pass
        time.sleep(1)
    raise SystemExit(f"{port} not ready")


servers = {
    "s05": (18461, []),
    "f16": (18463, ["--burst-itl-seconds", "0"]),
    "off": (18462, ["--burst-itl-factor", "0"]),
}
procs = {k: start(p, e) for k, (p, e) in servers.items()}
try:
    for p, _ in servers.values():
        wait(p)
    model = httpx.get(f"http://127.0.0.1:{servers['s05'][0]}/v1/models").json()["data"][0]["id"]
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "epsilon",
        "zeta",
        "eta",
        "theta",
        "iota",
        "kappa",
        "lambda",
        "mu",
        "nu",
        "xi",
        "omicron",
        "pi",
    ]
    for p, _ in servers.values():  # warm-up: graphs, thread choices, step cost measurements
        asyncio.run(
            run_streams(
                f"http://127.0.0.1:{p}", model, [f"w {u} " + " ".join(words) * 6 for u in range(16)], 16, 4
            )
        )
    order = sys.argv[1].split(",") if len(sys.argv) > 1 else ["s05", "f16", "off", "off", "f16", "s05"]
    for rnd, k in enumerate(order):
        prompts = [f"{rnd} {u} " + " ".join(words[(u + i) % 16] for i in range(100)) for u in range(64)]
        streams, dur = asyncio.run(
            run_streams(
                f"http://127.0.0.1:{servers[k][0]}", model, prompts, 64, int(os.environ.get("NEW", "32"))
            )
        )
        s = summarize_streams(streams, dur, False)
        row = {
            "k": k,
            "tok/s": s["output_tokens_per_s"],
            "ttft": s["ttft_s"],
            "itl": s["itl_s"],
            "failed": s["failed"],
            "prompt_tokens": sorted({x.prompt_tokens for x in streams if x.prompt_tokens})[:3],
            "load": os.getloadavg()[0],
        }
        print(json.dumps(row), flush=True)
finally:
    for pr in procs.values():
        pr.terminate()
    for pr in procs.values():
        pr.wait(30)
