"""The batched int8 path (server/quant/csrc/qgemv_q8.cpp) with and without packed weights; prints JSON.

    python benchmarks/int8_packed.py                 # M = 8, 16, 32, 64, 128, 256
    python benchmarks/int8_packed.py --smoke         # checks the script, timings mean little

One pass is what a decode step asks of the path: the embedded SmolLM2-135M's four projections per layer
(fused q/k/v 960x576, o 576x576, fused gate/up 3072x576 as Q4_1, down 576x1536) for `--layers`
distinct layers, then its tied LM head (49152x576 Q8_0), M rows of x each, so each call streams its
weight from memory as in a step. The same weights run unpacked (the GGUF layout, transposed per call)
and packed (Q8GemvKernel.pack, made once), the two alternating pass by pass; both give the same bits
(checked first). Per M: median ms per pass of each and the median of the per-pair ratios
(unpacked / packed: above 1, packed is faster). Runs only where the batched path does (AVX512-VNNI).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_qlinear import BF16_SHAPES, cpu_model, make, median_ratio

from server.quant import cpu_qgemv_q8 as q8
from server.quant import cpu_qlinear as cq

LM_HEAD = (49152, 576)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="8,16,32,64,128,256", help="rows of x")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=11, help="pairs of passes per M")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.ms, args.layers, args.reps = "8,65", 2, 2
    kernel = q8.load_q8_gemv_kernel(cq.load_qlinear_kernel())
    if kernel.isa != "vnni":
        print(
            json.dumps(
                {"cpu": cpu_model(), "skipped": f"the batched int8 path needs AVX512-VNNI ({kernel.isa})"}
            )
        )
        return
    kernel.set_modes(gemv=False, gemm=True)
    torch.manual_seed(0)
    plain = [make("q4_1", n, k) for _ in range(args.layers) for n, k in BF16_SHAPES.values()]
    plain.append(make("q8_0", *LM_HEAD))
    packed = [kernel.pack(w) for w in plain]
    extra = sum(p.nbytes() - w.nbytes() for w, p in zip(plain, packed, strict=True))
    rows = {}
    for m in [int(v) for v in args.ms.split(",")]:
        xs = {k: torch.randn(m, k) for k in {w.in_features for w in plain}}
        outs = [torch.empty(m, w.out_features) for w in plain]

        def one_pass(
            weights: list[cq.BlockQuantWeight], outs: list[torch.Tensor] = outs, xs: dict = xs
        ) -> float:  # type: ignore[type-arg]
            t0 = time.perf_counter()
            for w, out in zip(weights, outs, strict=True):
                kernel.linear(xs[w.in_features], w, None, out, compute=torch.bfloat16)
            return (time.perf_counter() - t0) * 1e3

        one_pass(plain)
        want = [o.clone() for o in outs]
        one_pass(packed)
        if not all(torch.equal(a, b) for a, b in zip(want, outs, strict=True)):
            raise SystemExit(f"packed weights gave other results at M = {m}")
        a, b = [], []
        for _ in range(args.reps):
            a.append(one_pass(plain))
            b.append(one_pass(packed))
        rows[str(m)] = {
            "unpacked_ms": round(statistics.median(a), 3),
            "packed_ms": round(statistics.median(b), 3),
            "ratio": round(median_ratio(a, b), 3),
        }
    out = {
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "layers": args.layers,
        "packed_extra_mib": round(extra / 2**20, 1),
        "weights_mib": round(sum(w.nbytes() for w in plain) / 2**20, 1),
        "per_m": rows,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
