"""Q8_0 and Q5_0 held as 16-row tiles (cpu_qlinear.interleave_q8_x16) against the row-major layout with its
int8 packed copy; prints JSON.

    python benchmarks/q8_tiles.py                  # Gemma-3-1B's matrices, M = 1, 4, 16, 64
    python benchmarks/q8_tiles.py --smoke          # checks the script, timings mean little

Per matrix of Gemma-3-1B (hidden 1,152: llama.cpp's Q4_K_M falls back to Q5_0 and Q8_0 there, as K is no
multiple of 256) and format, M rows of x, both as BlockQuantLinear with gemm_dtype bf16 (what serving runs
on a CPU with AVX512-BF16): `rowmajor` is the weight as the loader held it before the tiles (Q8_0's
blocks, Q5_0 repacked to 8 bits) with the int8 packed copy the batched path makes at load, `tiles` the
16-row tiles (8.5 and 5.5 bits per weight, no second copy). The two run interleaved call by call, each on
copies of its weight cycled so that every call streams from memory (twice the last-level cache), as a
decode step does. Median us per call, the median per-repetition ratio (rowmajor / tiles: > 1 means the
tiles are faster) and the bytes each holds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_qlinear import cpu_model, llc_bytes, median_ratio, rotating, timed

from server.quant import cpu_qgemv_q8 as q8
from server.quant import cpu_qlinear as cq
from server.quant.block_linear import BlockQuantLinear
from server.quant.gguf_repack import from_gguf_repacked

SHAPES = {
    "q_1024x1152": (1024, 1152),
    "gate_up_13824x1152": (13824, 1152),
    "down_1152x6912": (1152, 6912),
    "lm_head_262144x1152": (262144, 1152),
}


def weight(fmt: str, n: int, k: int, rng: np.random.Generator) -> cq.BlockQuantWeight:
    """Random GGUF blocks of `fmt` read as the loader reads them (speed does not depend on values)."""
    if fmt == "q8_0":
        b = rng.integers(0, 256, size=(n * k // 32, 34), dtype=np.uint8)
        b[:, 0:2] = np.full((b.shape[0], 1), 1e-3, np.float16).view(np.uint8)
        return cq.from_gguf_blocks(b, "q8_0", n, k)
    b = rng.integers(0, 256, size=(n * k // 32, 22), dtype=np.uint8)
    b[:, 0:2] = np.full((b.shape[0], 1), 1e-3, np.float16).view(np.uint8)
    return from_gguf_repacked(b, "Q5_0", n, k)


def module(w: cq.BlockQuantWeight, kernel: cq.QLinearKernel, fast: q8.Q8GemvKernel) -> BlockQuantLinear:
    lin = BlockQuantLinear(w, kernel=kernel)
    lin.gemm_dtype = torch.bfloat16
    lin.pack_int8(fast)  # the row-major layout's packed copy; 0 bytes for tiles
    return lin


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--ms", default="1,4,16,64")
    ap.add_argument("--formats", default="q8_0,q5_0")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--threads", type=int, default=0, help="torch and kernel threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    reps = 2 if args.smoke else args.reps
    shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
    if args.smoke:
        shapes = {"small_512x1024": (512, 1024)}
    kernel = cq.load_qlinear_kernel()
    fast = q8.load_q8_gemv_kernel(kernel)
    cold = 2 * llc_bytes()
    rng = np.random.default_rng(0)
    rows = []
    for fmt in args.formats.split(","):
        for name, (n, k) in shapes.items():
            w = weight(fmt, n, k, rng)
            tiles = cq.interleave_q8_x16(w)
            copies = max(1, min(16, -(-cold // tiles.nbytes())))
            olds = [module(w, kernel, fast)] + [
                module(
                    cq.BlockQuantWeight(w.q.clone(), w.scales.clone(), None, w.fmt, 8, 32, 0, k, n),
                    kernel,
                    fast,
                )
                for _ in range(copies - 1)
            ]
            news = [module(tiles, kernel, fast)] + [
                module(cq.interleave_q8_x16(w), kernel, fast) for _ in range(copies - 1)
            ]
            for m in [int(s) for s in args.ms.split(",")]:
                x = torch.randn(m, k)
                here = max(3, reps // 8) if n * k > 64 << 20 else reps
                runs = {
                    "rowmajor": rotating(olds, lambda mod, x=x: mod(x)),
                    "tiles": rotating(news, lambda mod, x=x: mod(x)),
                }
                t = timed(runs, here)
                row = {
                    "format": fmt,
                    "shape": name,
                    "M": m,
                    "rowmajor_us": round(statistics.median(t["rowmajor"]) * 1e3, 1),
                    "tiles_us": round(statistics.median(t["tiles"]) * 1e3, 1),
                    "speedup": round(median_ratio(t["rowmajor"], t["tiles"]), 2),
                    "rowmajor_MiB": round(olds[0].weight_q.nbytes() / 2**20, 1),
                    "tiles_MiB": round(tiles.nbytes() / 2**20, 1),
                }
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
            del olds, news
    out = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "rows": rows}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
