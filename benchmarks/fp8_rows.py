"""Where the fp8 CPU kernel stops paying: one `Fp8Linear` projection at M rows, the compiled kernel
(server/quant/cpu_fp8.py) against torch's path (the weight converted to the activations' dtype, then its
GEMM), alternated in one process; prints JSON.

    python benchmarks/fp8_rows.py                       # SmolLM2's and Llama-3.2-1B's shapes, M 1..128
    python benchmarks/fp8_rows.py --rows 16 32 64 --dtype float32

`Fp8Linear` sends batches of up to `cpu_fp8.MAX_ROWS` rows to the kernel: this measures that bound. Per shape
and M: the median microseconds a call of each path over `--rounds` alternated rounds of `--calls` calls, and
their ratio (torch / kernel: above 1, the kernel is faster). Random weights; the CPU and load are recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpu_qlinear import cpu_model  # benchmarks/, the script's folder

from server.quant.layers import Fp8Linear

SHAPES = {  # name: (N, K)
    "smollm2 gate/up [1536, 576]": (1536, 576),
    "llama-3.2-1b down [2048, 8192]": (2048, 8192),
    "llama-3.2-1b gate/up [16384, 2048]": (16384, 2048),
}


def _per_call_us(layer: Fp8Linear, x: torch.Tensor, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        layer(x)
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 24, 32, 48, 64, 128])
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="the activations'")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    from server.quant import cpu_fp8

    saved = cpu_fp8.MAX_ROWS
    cpu_fp8.MAX_ROWS = max(args.rows)  # every M through the kernel here; torch's path is the other layer
    results = []
    try:
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.05
            kernel = Fp8Linear.quantize(w, None)
            torch_path = Fp8Linear(kernel.weight, kernel.scale, None, cpu_kernel=False)
            for m in args.rows:
                x = torch.randn(m, k).to(dtype)
                times: dict[str, list[float]] = {"kernel": [], "torch": []}
                for _ in range(args.rounds):
                    for key, layer in (("kernel", kernel), ("torch", torch_path)):
                        times[key].append(_per_call_us(layer, x, args.calls))
                kern, tor = statistics.median(times["kernel"]), statistics.median(times["torch"])
                row = {"shape": name, "rows": m, "kernel_us": round(kern, 1), "torch_us": round(tor, 1)}
                row["torch_over_kernel"] = round(tor / kern, 3)
                print(json.dumps(row), file=sys.stderr, flush=True)
                results.append(row)
    finally:
        cpu_fp8.MAX_ROWS = saved
    out = {
        "benchmark": "fp8_rows",
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "load_average_at_start": os.getloadavg(),
        "max_rows_in_use": saved,
        "results": results,
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
