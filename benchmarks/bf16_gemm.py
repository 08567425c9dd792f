"""bf16 Linear at decode-sized rows: oneDNN's pre-packed GEMM against server/models/cpu_bf16_gemm.py.

    python benchmarks/bf16_gemm.py                       # Llama-3.2-1B's matrices, M = 1..64, JSON
    python benchmarks/bf16_gemm.py --rows 1 16 --shapes 2048x2048 --repeats 20
    python benchmarks/bf16_gemm.py --cold --rows 8 16 32   # weights read from memory, as in a decode step

Random bf16 weights in the model's shapes (N x K); per shape and row count, the two run alternated
`--repeats` times in this process; reported: the median seconds per call, the weight GB/s each reaches
(weight bytes / time: the stream a decode step is bound by) and the ratio oneDNN / ours (> 1: ours faster).
A weight that fits the last-level cache stays there between repeats; `--cold` rotates enough copies of each
(`--cold-mb` in all) that every call reads its weight from memory, as a decode step over a whole model does.
Needs a CPU where oneDNN runs bf16 and the kernel its AVX512-BF16 path.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from server.models.cpu_bf16_gemm import Bf16PanelLinear, load_bf16_gemm_kernel
from server.models.serving_weights import PackedLinear

# Llama-3.2-1B: qkv (3072 = 2048 + 2 x 512), o, gate_up, down, and a slice of the LM head
DEFAULT_SHAPES = ("3072x2048", "2048x2048", "16384x2048", "2048x8192", "32768x2048")


def _time(fn, x: torch.Tensor) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn(x)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="NxK weight shapes")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 32, 64, 256])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cold", action="store_true", help="rotate copies of each weight past the caches")
    ap.add_argument("--cold-mb", type=int, default=512, help="bytes of copies to rotate under --cold")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel = load_bf16_gemm_kernel()
    g = torch.Generator().manual_seed(0)
    results = []
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, k, generator=g) * 0.02)
        copies = max(1, -(-args.cold_mb * 2**20 // (n * k * 2))) if args.cold else 1
        onednns, ourss = [], []
        for _ in range(copies):
            onednns.append(PackedLinear(lin))
            ourss.append(Bf16PanelLinear(lin, kernel))
        for m in args.rows:
            x = torch.randn(m, k, generator=g).bfloat16()
            with torch.inference_mode():
                onednns[0](x), ourss[0](x)  # warm
                a: list[float] = []
                b: list[float] = []
                for i in range(args.repeats):
                    sets = (onednns, ourss) if i % 2 == 0 else (ourss, onednns)
                    for mods in sets:
                        t = sum(_time(mod, x) for mod in mods) / len(mods)
                        (a if mods is onednns else b).append(t)
            ta, tb = statistics.median(a), statistics.median(b)
            gb = n * k * 2 / 1e9
            results.append(
                {
                    "shape": shape,
                    "rows": m,
                    "onednn_s": ta,
                    "ours_s": tb,
                    "onednn_weight_gbps": gb / ta,
                    "ours_weight_gbps": gb / tb,
                    "speedup": ta / tb,
                }
            )
            print(
                f"{shape:>11} M={m:<4} oneDNN {gb / ta:6.1f} GB/s  ours {gb / tb:6.1f} GB/s  x{ta / tb:.2f}"
            )
    print(
        json.dumps(
            {
                "cpu": platform.processor() or platform.machine(),
                "threads": torch.get_num_threads(),
                "isa": kernel.isa,
                "cold": args.cold,
                "results": results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
