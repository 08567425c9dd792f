"""Q8_0, Q5_0, IQ4_NL and Q5_1 held as 16-row tiles (cpu_qlinear.interleave_q8_x16) against the row-major
layout with its int8 packed copy; prints JSON.

    python benchmarks/q8_tiles.py                  # Gemma-3-1B's matrices, M = 1, 4, 16, 64
    python benchmarks/q8_tiles.py --smoke          # checks the script, timings mean little

Per matrix of Gemma-3-1B (hidden 1,152: llama.cpp's Q4_K_M falls back to Q5_0 and Q8_0 there, as K is no
multiple of 256) and format, M rows of x, both as BlockQuantLinear with gemm_dtype bf16 (what serving runs
on a CPU with AVX512-BF16): `rowmajor` is the weight as the loader held it before the tiles (Q8_0's
blocks, Q5_0 / IQ4_NL / Q5_1 repacked to 8 bits) with the int8 packed copy the batched path makes at load,
`tiles` the 16-row tiles (8.5, 5.5, 4.5 and 6.0 bits per weight, no second copy); for IQ4_NL also
`tiles8`, the 8-bit tiles of its codebook values it was held in before (Q8_0's layout, 8.5 bits). The two run interleaved call by call, each on
copies of its weight cycled so that every call streams from memory (twice the last-level cache), as a
decode step does. Median us per call, the median per-repetition ratio (rowmajor / tiles: > 1 means the
tiles are faster) and the bytes each holds.
"""

from __future__ import annotations

import argparse
import dataclasses
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


# bytes per 32-block in the file and the offsets of its fp16 fields (d, and Q5_1's m)
BLOCKS = {"q8_0": (34, (0,)), "q5_0": (22, (0,)), "iq4_nl": (18, (0,)), "q5_1": (24, (0, 2))}


def weight(fmt: str, n: int, k: int, rng: np.random.Generator) -> cq.BlockQuantWeight:
    """Random GGUF blocks of `fmt` read as the loader reads them (speed does not depend on values)."""
    size, fp16_at = BLOCKS[fmt]
    b = rng.integers(0, 256, size=(n * k // 32, size), dtype=np.uint8)
    for at in fp16_at:
        b[:, at : at + 2] = np.full((b.shape[0], 1), 1e-3, np.float16).view(np.uint8)
    if fmt == "q8_0":
        return cq.from_gguf_blocks(b, "q8_0", n, k)
    return from_gguf_repacked(b, fmt.upper(), n, k)


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
                    dataclasses.replace(
                        w,
                        q=w.q.clone(),
                        scales=w.scales.clone(),
                        mins=None if w.mins is None else w.mins.clone(),
                    ),
                    kernel,
                    fast,
                )
                for _ in range(copies - 1)
            ]
            news = [module(tiles, kernel, fast)] + [
                module(cq.interleave_q8_x16(w), kernel, fast) for _ in range(copies - 1)
            ]
            # IQ4_NL's codebook values in Q8_0's 8-bit tiles: how it was held before its 4-bit tiles
            eights = (
                [
                    module(cq.interleave_q8_x16(dataclasses.replace(w, fmt="q8_0")), kernel, fast)
                    for _ in range(copies)
                ]
                if fmt == "iq4_nl"
                else []
            )
            for m in [int(s) for s in args.ms.split(",")]:
                x = torch.randn(m, k)
                here = max(3, reps // 8) if n * k > 64 << 20 else reps
                runs = {
                    "rowmajor": rotating(olds, lambda mod, x=x: mod(x)),
                    "tiles": rotating(news, lambda mod, x=x: mod(x)),
                }
                if eights:
                    runs["tiles8"] = rotating(eights, lambda mod, x=x: mod(x))
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
                if eights:
                    row["tiles8_us"] = round(statistics.median(t["tiles8"]) * 1e3, 1)
                    row["speedup_vs_tiles8"] = round(median_ratio(t["tiles8"], t["tiles"]), 2)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
            del olds, news, eights
    out = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "rows": rows}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
