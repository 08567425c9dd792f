"""The GGUF k-quants' 16-row tiles on an AVX2-only CPU (qk_native.cpp's avx2 path) against what such a CPU
serves without them; prints JSON (and writes it to --out).

    KUBEINFER_CPU_DISABLE=avx512f,avx512_bf16,avx512_vnni,avx_vnni,amx_tile,amx_bf16 \\
    MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 \\
        python benchmarks/qk_avx2.py --out build/qk_avx2.json      # an AVX2-only CPU simulated
    python benchmarks/qk_avx2.py --smoke                           # checks the script, timings mean little

Per matrix of Llama-3.2-1B ([N, K]: q/o [2048, 2048], k/v [512, 2048], gate or up [8192, 2048], down
[2048, 8192]), format and M rows of x, each a BlockQuantLinear with gemm_dtype int8 (what `--dtype auto`
gives a GGUF on an AVX2-only CPU):
  repacked  the weight repacked at load (cpu_qlinear.from_gguf_k_blocks: Q4_K 6.0, Q6_K 10.0 bits per
            weight; Q8_0's row-major blocks, 8.5; Q5_0, IQ4_NL, Q5_1 as gguf_repack.py holds them, 8.5, 8.5,
            9.0): the int8 GEMV's AVX2 path for 1-4 rows, qlinear's fp32 kernel below
            block_linear.GEMM_MIN_ROWS, dequantize + fp32 GEMM from there;
  tiles     the file's bytes as 16-row tiles (4.625, 6.5625; the 32-value formats' 8.5, 5.5, 4.5, 6.0):
            their int8 kernel below gemm_min_rows, dequantize + fp32 GEMM from there (the same routing);
  kernel    the tiles' int8 kernel at every M through qlinear's entry (where `tiles` leaves it: the
            crossover);
  repacked_kernel   the call `repacked` makes below GEMM_MIN_ROWS (cpu_qgemv_q8.small_m_linear) without the
            module's Python around it: `kernel`'s counterpart (a decode graph calls the C entry points).
Interleaved call by call on copies of each weight cycled so that every call streams from memory (twice
the last-level cache), as a decode step does; median ms per call and the per-repetition ratio
repacked / tiles (> 1: the tiles are faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_qlinear import cpu_model, llc_bytes, median_ratio, rotating, timed
from qk_native import random_blocks, repacked

from server.native import usable_cpu_features
from server.quant import cpu_qk_native as qk
from server.quant import cpu_qlinear as cq
from server.quant.block_linear import GEMM_MIN_ROWS, BlockQuantLinear
from server.quant.cpu_qgemv_q8 import small_m_linear
from server.quant.gguf_repack import from_gguf_repacked

SHAPES = {
    "qo_2048x2048": (2048, 2048),
    "kv_512x2048": (512, 2048),
    "up_8192x2048": (8192, 2048),
    "down_2048x8192": (2048, 8192),
}


def q8_0_blocks(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random block_q8_0 bytes (fp16 d, 32 int8) with a small finite d."""
    b = rng.integers(0, 256, size=(n * k // 32, 34), dtype=np.uint8)
    b[:, 0:2] = np.full((b.shape[0], 1), 1e-3, np.float16).view(np.uint8)
    return b


# the 32-value formats gguf_repack.py holds row-major where no tiles are (fp16 fields: d, and Q5_1's m)
Q32_REPACKED = {"q5_0": ("Q5_0", 22, (0,)), "iq4_nl": ("IQ4_NL", 18, (0,)), "q5_1": ("Q5_1", 24, (0, 2))}


def q32_blocks(fmt: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random GGUF blocks of a Q32_REPACKED format with small finite fp16 fields."""
    _, size, fp16_at = Q32_REPACKED[fmt]
    b = rng.integers(0, 256, size=(n * k // 32, size), dtype=np.uint8)
    for at in fp16_at:
        b[:, at : at + 2] = np.full((b.shape[0], 1), 1e-3, np.float16).view(np.uint8)
    return b


def layouts(raw: np.ndarray, fmt: str, n: int, k: int) -> tuple[cq.BlockQuantWeight, cq.BlockQuantWeight]:
    """(the layout served without tiles, the tiles): Q8_0's row-major blocks and q8_0_x16; Q5_0, IQ4_NL,
    Q5_1 repacked (gguf_repack.py) and their 32-value tiles; a k-quant repacked and its x16 tiles."""
    if fmt == "q8_0":
        rows = cq.from_gguf_blocks(raw, "q8_0", n, k)
        return rows, cq.interleave_q8_x16(rows)
    if fmt in Q32_REPACKED:
        rows = from_gguf_repacked(raw, Q32_REPACKED[fmt][0], n, k)
        return rows, cq.interleave_q8_x16(rows)
    return repacked(raw, fmt, n, k), cq.interleave_x16(cq.from_gguf_k_super_blocks(raw, fmt, n, k))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--seconds", type=float, default=1.5, help="about this long per variant and case")
    ap.add_argument("--ms", default="1,4,16,128,512")
    ap.add_argument("--formats", default="q4_k,q6_k")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--threads", type=int, default=0, help="torch and kernel threads (default: torch's)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
    ms = [int(s) for s in args.ms.split(",")]
    if args.smoke:
        shapes, ms, args.seconds = {"small_512x1024": (512, 1024)}, [1, 16], 0.05
    kernel = cq.load_qlinear_kernel()
    native = qk.load_qk_native_kernel()
    cold = 2 * llc_bytes()
    rng = np.random.default_rng(0)
    rows = []
    for fmt in args.formats.split(","):
        for name, (n, k) in shapes.items():
            if fmt in Q32_REPACKED:
                raw = q32_blocks(fmt, n, k, rng)
            else:
                raw = q8_0_blocks(n, k, rng) if fmt == "q8_0" else random_blocks(fmt, n, k, rng)
            copies = max(1, min(16, -(-cold // layouts(raw, fmt, n, k)[1].nbytes())))
            olds, news = [], []
            for _ in range(copies):
                old_w, new_w = layouts(raw, fmt, n, k)
                old, new = BlockQuantLinear(old_w, kernel=kernel), BlockQuantLinear(new_w, kernel=kernel)
                old.gemm_dtype = new.gemm_dtype = torch.int8
                olds.append(old)
                news.append(new)
            for m in ms:
                x = torch.randn(m, k)
                runs = {
                    "repacked": rotating(olds, lambda mod, x=x: mod(x)),
                    "tiles": rotating(news, lambda mod, x=x: mod(x)),
                    # the tiles' kernel through qlinear's entry (Q8_0's tiles have no other)
                    "kernel": rotating(
                        news, lambda mod, x=x: kernel.linear(x, mod.weight_q, compute=torch.int8)
                    ),
                }
                if m < GEMM_MIN_ROWS:
                    runs["repacked_kernel"] = rotating(
                        olds, lambda mod, x=x: small_m_linear(kernel, x, mod.weight_q, None, torch.int8)
                    )
                t0 = time.perf_counter()
                timed(runs, 1)
                once = (time.perf_counter() - t0) / len(runs)
                reps = max(3, min(200, int(args.seconds / max(once, 1e-6))))
                t = timed(runs, reps)
                row = {
                    "format": fmt,
                    "shape": name,
                    "M": m,
                    "reps": reps,
                    "repacked_ms": round(statistics.median(t["repacked"]), 3),
                    "tiles_ms": round(statistics.median(t["tiles"]), 3),
                    "kernel_ms": round(statistics.median(t["kernel"]), 3),
                    "speedup_tiles": round(median_ratio(t["repacked"], t["tiles"]), 2),
                    "speedup_kernel": round(median_ratio(t["repacked"], t["kernel"]), 2),
                    "repacked_kernel_ms": round(statistics.median(t["repacked_kernel"]), 3)
                    if m < GEMM_MIN_ROWS
                    else None,
                    "speedup_kernels": round(median_ratio(t["repacked_kernel"], t["kernel"]), 2)
                    if m < GEMM_MIN_ROWS
                    else None,
                    "tiles_leave_kernel": m >= news[0].gemm_min_rows,
                    "repacked_MiB": round(olds[0].weight_q.nbytes() / 2**20, 2),
                    "tiles_MiB": round(news[0].weight_q.nbytes() / 2**20, 2),
                }
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
            del olds, news
    out = {
        "cpu": cpu_model(),
        "usable_features": usable_cpu_features().key(),
        "KUBEINFER_CPU_DISABLE": os.environ.get("KUBEINFER_CPU_DISABLE", ""),
        "threads": torch.get_num_threads(),
        "qk_native_isa": native.isa,
        "rows": rows,
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
