"""GGUF k-quants as their own super-blocks and 16-row tiles (server/quant/cpu_qk_native.py) against the
repacked layouts; prints JSON.

    python benchmarks/qk_native.py                 # Llama-3.2-1B's matrices, M = 1 and 16, Q4_K and Q6_K
    python benchmarks/qk_native.py --formats q5_k,iq4_xs,q3_k,q2_k   # the tile-only k-quants
    python benchmarks/qk_native.py --smoke         # checks the script, timings mean little
    python benchmarks/qk_native.py --amx --ms 16,64,255,512   # bf16 layers' batch paths where AMX-BF16 is usable

Per matrix of Llama-3.2-1B (q/o, k/v, fused gate/up, down, the tied 128,256-row LM head) and format, M
rows of x: `repacked` is what serving runs today on the weight repacked at load (cpu_qlinear's
from_gguf_k_blocks: 6.0 / 10.0 bits per weight), a BlockQuantLinear with gemm_dtype bf16 and its int8
packed copy where the batched path makes one (the server's default on AVX512-VNNI), `native` is the
super-block kernel on the file's bytes (4.5 / 6.56 bits). The two run interleaved call by call, each on
copies of its weight cycled so that every call streams from memory (twice the last-level cache), as a
decode step does. Median us per call, the median per-repetition ratio (repacked / native: > 1 means
native is faster) and the bytes each holds. Q5_K / IQ4_XS / Q3_K / Q2_K run only as tiles (`x16`):
`repacked` is then gguf_repack.py's 8-bit groups (with the int8 packed copy where the batched path makes
one), `file_MiB` the file's bytes.

`--amx` (where the amx path runs: AMX-BF16 usable, KUBEINFER_QK_AMX not 0) times, on the same 16-row tiles,
the three paths a bf16 layer's batch can take: `x16` (int8 activations, AVX512-VNNI), `x16_amx` (the amx
path: bf16 B tiles dequantized per call, tdpbf16ps) and `x16_dequant_bf16` (the whole weight dequantized to
bf16, then torch's bf16 GEMM: oneDNN on AMX tiles, what 256 rows and more took before the amx path);
`amx_vs_x16` and `amx_vs_dequant` are their median per-repetition ratios (> 1: the amx path is faster).

`--against-source FILE` (a kernel change's A/B in one process: e.g. `git show HEAD~1:server/quant/csrc/
qk_native.cpp > /tmp/before.cpp`) also builds the library from FILE (beside this tree's in the kernel cache:
a build is named by its source) and times, on the same 16-row tiles, `x16_before` (that library) beside `x16` (this tree's), alternated call by call, after
checking that both give the same bits; `x16_vs_before` is their median per-repetition ratio (> 1: this
tree's kernel is faster).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_qlinear import cpu_model, llc_bytes, median_ratio, rotating, timed

from server.config import default_cache_dir
from server.native import PREBUILT_ENV
from server.quant import cpu_qgemv_q8 as q8
from server.quant import cpu_qk_native as qk
from server.quant import cpu_qlinear as cq
from server.quant.block_linear import BlockQuantLinear
from server.quant.gguf_repack import from_gguf_repacked

SHAPES = {
    "qo_2048x2048": (2048, 2048),
    "kv_512x2048": (512, 2048),
    "gate_up_16384x2048": (16384, 2048),
    "down_2048x8192": (2048, 8192),
    "lm_head_128256x2048": (128256, 2048),
}


# byte offsets of each block type's fp16 scales (d, and dmin where there is one; ggml-common.h)
FP16_AT = {"q4_k": (0, 2), "q6_k": (208,), "q5_k": (0, 2), "iq4_xs": (0,), "q3_k": (108,), "q2_k": (80, 82)}


def random_blocks(fmt: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random super-block bytes with small finite fp16 scales: the kernels' speed does not depend on values."""
    b = rng.integers(0, 256, size=(n * k // qk.QK_K, qk.SUPER_BLOCK_BYTES[fmt]), dtype=np.uint8)
    d = np.full((b.shape[0], 1), 1e-3, np.float16).view(np.uint8)
    for at in FP16_AT[fmt]:
        b[:, at : at + 2] = d
    return b


def repacked(raw: np.ndarray, fmt: str, n: int, k: int) -> cq.BlockQuantWeight:
    """The layout serving runs where no tiles are held: Q4_K / Q6_K repacked (from_gguf_k_blocks), the
    others into 8-bit groups (gguf_repack.py)."""
    if fmt in qk.ROW_MAJOR_RUNS:
        return cq.from_gguf_k_blocks(raw, fmt, n, k)
    return from_gguf_repacked(raw, qk.GGUF_TYPES[fmt], n, k)


def tiled_module(t: qk.KQuantBlocks, kernel: cq.QLinearKernel) -> BlockQuantLinear:
    """A bf16 layer over 16-row tiles, as the loader builds one (cpu_qlinear.interleave_x16)."""
    n, k = t.out_features, t.in_features
    w = cq.BlockQuantWeight(t.blocks, torch.empty(n, 0), None, t.fmt, cq.KQUANT_BITS, cq.X16_GROUP, 0, k, n)
    mod = BlockQuantLinear(w, kernel=kernel)
    mod.gemm_dtype = torch.bfloat16
    return mod


def dequant_gemm(mod: BlockQuantLinear, x: torch.Tensor, kernel: cq.QLinearKernel) -> torch.Tensor:
    return mod._dequant_gemm(x, mod.weight_q, kernel, torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--formats", default="q4_k,q6_k")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--threads", type=int, default=0, help="torch and kernel threads (default: torch's)")
    ap.add_argument(
        "--amx", action="store_true", help="the amx path against the int8 one and dequantize + GEMM"
    )
    ap.add_argument("--against-source", type=Path, help="qk_native.cpp of another version: x16 against it")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    reps = 2 if args.smoke else args.reps
    shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
    if args.smoke:
        shapes = {"small_512x1024": (512, 1024)}
    kernel = cq.load_qlinear_kernel()
    fast = q8.load_q8_gemv_kernel(kernel)
    native = qk.load_qk_native_kernel()
    before = None
    if args.against_source:
        if os.environ.get(PREBUILT_ENV):
            raise SystemExit(f"--against-source builds from source: unset {PREBUILT_ENV}")
        # a second library: its own file in the cache (the build is named by its source), its own handle
        source = dataclasses.replace(qk.NATIVE, source=args.against_source.resolve())
        before = qk._load_qk_native_kernel(default_cache_dir(), source)
    if args.amx and native.amx_min_rows == 0:
        raise SystemExit("--amx: the amx path does not run here (no usable AMX-BF16, or KUBEINFER_QK_AMX=0)")
    cold = 2 * llc_bytes()
    rng = np.random.default_rng(0)
    rows = []
    for fmt in args.formats.split(","):
        for name, (n, k) in shapes.items():
            raw = random_blocks(fmt, n, k, rng)
            nat = qk.from_gguf(raw, fmt, n, k)
            old = BlockQuantLinear(repacked(raw, fmt, n, k), kernel=kernel)
            old.gemm_dtype = torch.bfloat16
            packed = old.pack_int8(fast)
            copies = max(1, min(16, -(-cold // nat.nbytes())))
            olds = [old] + [
                BlockQuantLinear(repacked(raw, fmt, n, k), kernel=kernel) for _ in range(copies - 1)
            ]
            for o in olds[1:]:
                o.gemm_dtype = torch.bfloat16
                o.pack_int8(fast)
            nats = [nat] + [qk.KQuantBlocks(nat.blocks.clone(), fmt, k, n) for _ in range(copies - 1)]
            # 16-row tiles (q4_k_x16, q6_k_x16): what the loader holds on AVX512-VNNI
            x16s = [native.interleave(b) for b in nats] if n % qk.X16_ROWS == 0 else []
            amx = args.amx and bool(x16s) and x16s[0].fmt in qk.AMX_TILED

            # each timed run its own copies: a run that read the copy the run before it had just streamed
            # would find it in cache (x16_amx after x16 did, before 2026-12-07)
            ab = before is not None and bool(x16s)
            x16s_before = [native.interleave(b) for b in nats] if ab else []
            x16s_amx = [native.interleave(b) for b in nats] if amx else []
            tiled_mods = [tiled_module(native.interleave(b), kernel) for b in nats] if amx else []
            for m in [int(s) for s in args.ms.split(",")]:
                x = torch.randn(m, k)
                here = max(3, reps // 8) if n * k > 64 << 20 else reps
                row_major = fmt in qk.ROW_MAJOR_RUNS  # the others run as tiles only
                runs = (
                    {"repacked": rotating(olds, lambda mod, x=x: mod(x))}
                    | ({"native": rotating(nats, lambda w, x=x: native.linear(x, w))} if row_major else {})
                    | ({"x16": rotating(x16s, lambda w, x=x: native.linear(x, w))} if x16s else {})
                    | (
                        {"x16_before": rotating(x16s_before, lambda w, x=x: before.linear(x, w))}
                        if ab
                        else {}
                    )
                    | (
                        {"x16_amx": rotating(x16s_amx, lambda w, x=x: native.linear_bf16(x, w))}
                        if amx
                        else {}
                    )
                    | (
                        {
                            "x16_dequant_bf16": rotating(
                                tiled_mods, lambda mod, x=x: dequant_gemm(mod, x, kernel)
                            )
                        }
                        if amx
                        else {}
                    )
                )
                if ab and not torch.equal(native.linear(x, x16s[0]), before.linear(x, x16s[0])):
                    raise SystemExit(f"{fmt} {name} M={m}: --against-source gives other bits")
                t = timed(runs, here)
                row = {
                    "format": fmt,
                    "shape": name,
                    "M": m,
                    "repacked_us": round(statistics.median(t["repacked"]) * 1e3, 1),
                    "repacked_MiB": round(old.weight_q.nbytes() / 2**20, 1),
                    "of_which_packed_copy_MiB": round(packed / 2**20, 1),
                    "file_MiB": round(nat.nbytes() / 2**20, 1),
                }
                if row_major:
                    row["native_us"] = round(statistics.median(t["native"]) * 1e3, 1)
                    row["speedup"] = round(median_ratio(t["repacked"], t["native"]), 2)
                if x16s:
                    row["x16_us"] = round(statistics.median(t["x16"]) * 1e3, 1)
                    row["speedup_x16"] = round(median_ratio(t["repacked"], t["x16"]), 2)
                    row["x16_MiB"] = round(x16s[0].nbytes() / 2**20, 1)
                if ab:
                    row["x16_before_us"] = round(statistics.median(t["x16_before"]) * 1e3, 1)
                    row["x16_vs_before"] = round(median_ratio(t["x16_before"], t["x16"]), 2)
                if amx:
                    row["x16_amx_us"] = round(statistics.median(t["x16_amx"]) * 1e3, 1)
                    row["x16_dequant_bf16_us"] = round(statistics.median(t["x16_dequant_bf16"]) * 1e3, 1)
                    row["amx_vs_x16"] = round(median_ratio(t["x16"], t["x16_amx"]), 2)
                    row["amx_vs_dequant"] = round(median_ratio(t["x16_dequant_bf16"], t["x16_amx"]), 2)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
            del olds, nats, x16s, x16s_before, x16s_amx, tiled_mods
    out = {
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "native_isa": native.isa,
        "amx_min_rows": native.amx_min_rows,
        "rows": rows,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
