"""The block-quantized CPU kernels (server/quant/csrc/qlinear.cpp) against this machine's limits. Prints JSON.

    python benchmarks/cpu_qlinear.py               # full sizes (~1-2 min on 2 cores)
    python benchmarks/cpu_qlinear.py --smoke       # small sizes: checks the script, timings mean little
    python benchmarks/cpu_qlinear.py --rss         # also: RSS added by loading the embedded model

Figures:
- `machine`: CPU model and flags, threads, the measured memory read bandwidth (GB/s: torch sum over a
  buffer far larger than the last-level cache) and fp32 GEMM GFLOP/s (torch.mm, 1024^3): the limits.
- `kernels`: per format and M, the kernel's time, the GB/s of quantized weight it streams, its GFLOP/s,
  the fraction of the measured bandwidth, and the fp32 torch F.linear on the same (dequantized) weight,
  measured interleaved with it (the machine may be shared: the ratio is what to read). The weight is
  larger than the LLC so every call streams it from memory, as a decode step does.
- `crossover`: tiled kernel vs dequantize + fp32 GEMM at prefill-sized M (block_linear.GEMM_MIN_ROWS).
Times are the median of interleaved repetitions, wall clock; `cpu_ms` is process CPU time per call
divided by the thread count (what the kernel costs when it is not waiting for a shared core).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from server.quant import cpu_qlinear as cq
from server.quant.block_linear import BlockQuantLinear


def cpu_model() -> dict[str, str]:
    info = {"machine": platform.machine(), "model": platform.processor()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key = line.split(":")[0].strip()
            if key == "model name":
                info["model"] = line.split(":", 1)[1].strip()
            elif key == "flags":
                flags = line.split(":", 1)[1].split()
                info["simd"] = " ".join(f for f in flags if f.startswith(("avx", "fma", "f16c", "amx")))
    except OSError:
        pass
    return info


def timed(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, tuple[float, float]]:
    """Interleaved repetitions: name -> (median wall ms, median CPU ms per thread)."""
    walls: dict[str, list[float]] = {k: [] for k in fns}
    cpus: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()
    threads = torch.get_num_threads()
    for _ in range(reps):
        for name, f in fns.items():
            c0, t0 = time.process_time(), time.perf_counter()
            f()
            walls[name].append((time.perf_counter() - t0) * 1e3)
            cpus[name].append((time.process_time() - c0) * 1e3 / threads)
    return {k: (statistics.median(walls[k]), statistics.median(cpus[k])) for k in fns}


def memory_bandwidth(nbytes: int, reps: int) -> float:
    buf = torch.ones(nbytes // 4)
    ((ms, _),) = timed({"sum": lambda: buf.sum()}, reps).values()
    return nbytes / ms / 1e6


def gemm_gflops(n: int, reps: int) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    ((ms, _),) = timed({"mm": lambda: a @ b}, reps).values()
    return 2 * n**3 / ms / 1e6


def make(fmt: str, n: int, k: int) -> cq.BlockQuantWeight:
    w = torch.randn(n, k) * 0.05
    if fmt == "int8":
        s = w.abs().amax(1) / 127
        return cq.from_int8(torch.round(w / s[:, None]).to(torch.int8), s)
    if fmt == "int4":
        g = 64  # K = 576 = 9 x 64
        return cq.from_int4(
            torch.randint(0, 16, (k, n)), torch.randint(0, 16, (k // g, n)), torch.rand(k // g, n).half(), g
        )
    return cq.quantize_block(w, fmt)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rss", action="store_true")
    ap.add_argument("--reps", type=int, default=0)
    args = ap.parse_args()
    reps = args.reps or (3 if args.smoke else 15)
    kernel = cq.load_qlinear_kernel()
    n, k = (4096, 576) if args.smoke else (131072, 576)  # Q4_1: 47 MB, fp32: 302 MB, LLC: 32 MB here
    bw = memory_bandwidth((64 if args.smoke else 1024) << 20, reps)
    peak = gemm_gflops(256 if args.smoke else 1024, reps)
    out: dict[str, object] = {
        "machine": {
            **cpu_model(),
            "threads": torch.get_num_threads(),
            "kernel_isa": kernel.isa,
            "mem_read_GBps": round(bw, 2),
            "fp32_gemm_GFLOPs": round(peak, 1),
        },
        "shape": {"N": n, "K": k},
        "kernels": [],
        "crossover": [],
    }
    results = out["kernels"]
    assert isinstance(results, list)
    for fmt in ("q4_0", "q4_1", "q8_0", "int8", "int4"):
        w = make(fmt, n, k)
        dense = cq.dequantize_reference(w)
        for m in (1, 4, 16):
            x = torch.randn(m, k)
            t = timed(
                {
                    "kernel": lambda x=x, w=w: kernel.linear(x, w),
                    "fp32": lambda x=x, dense=dense: F.linear(x, dense),
                },
                reps,
            )
            ms, cpu_ms = t["kernel"]
            results.append(
                {
                    "format": fmt,
                    "M": m,
                    "ms": round(ms, 3),
                    "cpu_ms": round(cpu_ms, 3),
                    "weight_MB": round(w.nbytes() / 1e6, 1),
                    "GBps": round(w.nbytes() / ms / 1e6, 2),
                    "of_mem_bw": round(w.nbytes() / ms / 1e6 / bw, 2),
                    "GFLOPs": round(2 * m * n * k / ms / 1e6, 1),
                    "fp32_ms": round(t["fp32"][0], 3),
                    "speedup_vs_fp32": round(t["fp32"][0] / ms, 2),
                }
            )
        del dense, w
    cross = out["crossover"]
    assert isinstance(cross, list)
    w = make("q4_1", 3072, 576)  # SmolLM2's fused gate/up projection
    lin = BlockQuantLinear(w, kernel=kernel)
    for m in (16, 64, 256, 512, 1024):
        x = torch.randn(m, 576)
        t = timed(
            {
                "tiled": lambda x=x: kernel.linear(x, w),
                "dequant_gemm": lambda x=x: lin._dequant_gemm(x, w, kernel),
            },
            reps,
        )
        cross.append(
            {"M": m, "tiled_ms": round(t["tiled"][0], 3), "dequant_gemm_ms": round(t["dequant_gemm"][0], 3)}
        )
    if args.rss:
        out["rss"] = rss_of_embedded_model()
    print(json.dumps(out, indent=1))


def rss_of_embedded_model() -> dict[str, object]:
    import subprocess

    script = Path(__file__).resolve().parents[1] / "tests" / "quant" / "test_gguf_serving.py"
    ns: dict[str, object] = {}
    src = script.read_text()
    start = src.index('RSS_SCRIPT = """')
    exec(src[start : src.index('"""', start + 16) + 3], ns)  # the test's own measuring script
    kv = 64 << 20
    done = subprocess.run(
        [sys.executable, "-c", str(ns["RSS_SCRIPT"]), str(kv)], capture_output=True, text=True, check=True
    )
    r = json.loads(done.stdout.strip().splitlines()[-1])
    added = r["after"] - r["before"]
    return {
        "gguf_MiB": round(r["gguf"] / 2**20, 1),
        "kv_budget_MiB": kv >> 20,
        "weight_MiB": round(r["weight_bytes"] / 2**20, 1),
        "rss_added_MiB": round(added / 2**20, 1),
        "limit_MiB": round((1.5 * r["gguf"] + kv) / 2**20, 1),
    }


if __name__ == "__main__":
    main()
