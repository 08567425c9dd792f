"""This CPU's physical ceilings as torch reaches them: GEMM GFLOP/s per dtype (fp32, bf16; int8 through
`torch._int_mm`, GOP/s, int32 accumulation), on SmolLM2's MLP shape and on a square `--square` GEMM (the
peak, away from small-shape overheads), and, for
our quantized prefill path (server/quant/block_linear.py `_dequant_gemm`), the same projection in fp32
and bf16 compute; plus memory bandwidth (GB/s, a large copy: read + write). Each case is timed
interleaved with the others (`--rounds` passes over all of them, the best pass kept), so a shared
machine's noise falls on all alike. Prints JSON; also the usable CPU features (server/cpu_features.py).
bf16 cases run only where the CPU computes bf16 natively (AVX512-BF16 or AMX-BF16): elsewhere torch
emulates it and one round takes minutes (`--bf16` runs them anyway).

    python benchmarks/cpu_ceilings.py [--rows 128 512 2048 --k 576 --n 1536 --square 2048 --rounds 5
        --threads 2]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from server.native import usable_cpu_features
from server.quant import cpu_qlinear as cq
from server.quant.block_linear import BlockQuantLinear


def copy_gb_per_s(reps: int = 5) -> float:
    """This machine's memory bandwidth, GB/s: the best of `reps` copies of 64 MiB (read + write bytes)."""
    big = torch.empty(64 << 20, dtype=torch.uint8)
    dst = torch.empty_like(big)
    dst.copy_(big)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(big)
        best = min(best, time.perf_counter() - t0)
    return 2 * big.numel() / best / 1e9


def read_gb_per_s(reps: int = 5, gib: int = 1) -> float:
    """This machine's memory read bandwidth, GB/s: the best of `reps` torch `sum()`s over `gib` GiB of fp32 on
    torch's threads (far past any last-level cache, as a decode step's weights are; the 64 MiB copy of
    `copy_gb_per_s` partly fits a 32 MiB L3)."""
    big = torch.ones(gib << 28, dtype=torch.float32)
    big.sum()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - t0)
    return big.numel() * 4 / best / 1e9


def _best(fn: Callable[[], object], reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def _int8(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(-127, 128, (rows, cols), generator=g, dtype=torch.int8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", type=int, default=[128, 512, 2048])
    ap.add_argument("--k", type=int, default=576, help="SmolLM2-135M's hidden size")
    ap.add_argument("--n", type=int, default=1536, help="SmolLM2-135M's MLP size")
    ap.add_argument("--square", type=int, default=2048, help="M = K = N of the peak GEMM; 0: none")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="bf16 cases on a CPU without native bf16 too")
    args = ap.parse_args()
    features = usable_cpu_features()
    bf16 = args.bf16 or features.avx512_bf16 or features.amx_bf16
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    k, n = args.k, args.n
    w32 = torch.randn(n, k, generator=g) * 0.05
    layer = BlockQuantLinear(cq.quantize_block(w32, "q8_0"))
    cases: dict[str, tuple[Callable[[], object], float]] = {}
    for m in args.rows:
        x32 = torch.randn(m, k, generator=g)
        x16, w16 = x32.bfloat16(), w32.bfloat16()
        flop = 2.0 * m * n * k
        cases[f"gemm_fp32_m{m}"] = (lambda x=x32: x @ w32.t(), flop)
        if bf16:
            cases[f"gemm_bf16_m{m}"] = (lambda x=x16, w=w16: x @ w.t(), flop)
        x8, w8 = _int8(m, k, g), _int8(k, n, g)
        cases[f"gemm_int8_m{m}"] = (lambda x=x8, w=w8: torch._int_mm(x, w), flop)
        if m >= 512:  # the dequantize + GEMM path serves these rows
            kernel = layer.kernel
            assert kernel is not None
            for dt in (torch.float32, torch.bfloat16) if bf16 else (torch.float32,):
                name = f"q8_0_dequant_gemm_{'bf16' if dt == torch.bfloat16 else 'fp32'}_m{m}"
                cases[name] = (
                    lambda x=x32, dt=dt, kn=kernel: layer._dequant_gemm(x, layer.weight_q, kn, dt),
                    flop,
                )
    if args.square:
        s = args.square
        a32, b32 = torch.randn(s, s, generator=g), torch.randn(s, s, generator=g)
        a16, b16, a8, b8 = a32.bfloat16(), b32.bfloat16(), _int8(s, s, g), _int8(s, s, g)
        flop = 2.0 * s**3
        cases[f"square_fp32_{s}"] = (lambda: a32 @ b32, flop)
        if bf16:
            cases[f"square_bf16_{s}"] = (lambda: a16 @ b16, flop)
        cases[f"square_int8_{s}"] = (lambda: torch._int_mm(a8, b8), flop)
    big = torch.empty(64 << 20, dtype=torch.uint8)  # 64 MiB: well past the caches
    dst = torch.empty_like(big)
    cases["copy_64MiB"] = (lambda: dst.copy_(big), 0.0)
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, (fn, _flop) in cases.items():
            t = _best(fn, 3)
            best[name] = min(best.get(name, t), t)
    out: dict[str, object] = {"cpu_features": features.names(), "threads": args.threads}
    for name, (_fn, flop) in cases.items():
        out[name] = (
            {"gb_per_s": round(2 * big.numel() / best[name] / 1e9, 2), "ms": round(best[name] * 1e3, 3)}
            if not flop
            else {"gflop_per_s": round(flop / best[name] / 1e9, 1), "ms": round(best[name] * 1e3, 3)}
        )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
