"""The block-quantized CPU kernels (server/quant/csrc/qlinear.cpp) against this machine's limits. Prints JSON.

    python benchmarks/cpu_qlinear.py               # SmolLM2 shapes, M in {1, 4, 16, 64, 256} (~3-5 min)
    python benchmarks/cpu_qlinear.py --smoke       # small sizes: checks the script, timings mean little
    python benchmarks/cpu_qlinear.py --rss         # also: RSS added by loading the embedded model

Figures:
- `machine`: CPU model and SIMD flags, threads, load average, the measured memory read bandwidth (GB/s:
  torch sum over a buffer far larger than the last-level cache) and fp32 GEMM GFLOP/s (torch.mm,
  1024^3, oneDNN/MKL): the two limits every kernel is held to.
- `kernels`: per format, SmolLM2-135M shape (576x576 attention, 576x1536 gate/up, 1536x576 down,
  49152x576 the tied LM head; N x K) and M rows of x: our kernel and torch's fp32 F.linear on the same
  (dequantized) weight, interleaved. Both cycle through enough copies of the weight to exceed twice the
  last-level cache, so every call streams its weight from memory, as a decode step does. Per kernel:
  GB/s of weight streamed, GFLOP/s, fraction of the measured bandwidth and of the measured GEMM peak;
  `speedup_vs_fp32` is the median of the per-repetition ratios (robust on a shared machine).
- `small_m`: M = 2..8 through the GEMV path (W re-read from cache per row) and through the
  dequantized-panel GEMM (and its bf16 variant where the CPU has AVX512-BF16): where qlinear.cpp's
  `gemv_max_rows` comes from.
- `crossover`: our batched kernel vs dequantize + torch's fp32 GEMM at prefill-sized M: where
  block_linear.GEMM_MIN_ROWS comes from (and, where the CPU has AVX512-BF16, the kernel's bf16 path vs
  bf16 dequantize + GEMM: BF16_GEMM_MIN_ROWS).
- `bf16`: the kernel's batched path in fp32 against its bf16 path (compute=bfloat16, AVX512-BF16 only) on
  the embedded SmolLM2's fused projection shapes (q/k/v 960x576, o 576x576, gate/up 3072x576, down
  576x1536) at decode batch sizes M in {8, 16, 32, 64, 128}, weights cycled cold, interleaved; per row
  both times, the bf16 path's GFLOP/s and `bf16_speedup` (median of per-repetition ratios).
Times are medians of interleaved repetitions, wall clock.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from server.native import usable_cpu_features
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


def timed(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, list[float]]:
    """Interleaved repetitions: name -> wall ms of each repetition."""
    walls: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(reps):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            walls[name].append((time.perf_counter() - t0) * 1e3)
    return walls


def median_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def memory_bandwidth(nbytes: int, reps: int) -> float:
    buf = torch.ones(nbytes // 4)
    ms = statistics.median(timed({"sum": lambda: buf.sum()}, reps)["sum"])
    return nbytes / ms / 1e6


def gemm_gflops(n: int, reps: int) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    ms = statistics.median(timed({"mm": lambda: a @ b}, reps)["mm"])
    return 2 * n**3 / ms / 1e6


def llc_bytes() -> int:
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        return int(text.rstrip("K")) << 10 if text.endswith("K") else int(text.rstrip("M")) << 20
    except (OSError, ValueError):
        return 32 << 20


def rotating(items: list[Any], call: Callable[[Any], object]) -> Callable[[], object]:
    """A function calling `call` on the next of `items` in turn: copies of a weight cycled call after call,
    so that each call streams it from memory as a decode step does."""
    it = itertools.cycle(items)
    return lambda: call(next(it))


def make(fmt: str, n: int, k: int) -> cq.BlockQuantWeight:
    w = torch.randn(n, k) * 0.05
    if fmt == "int8":
        s = w.abs().amax(1) / 127
        return cq.from_int8(torch.round(w / s[:, None]).to(torch.int8), s)
    if fmt == "int4":
        g = 64  # 576 and 1536 are multiples of 64
        return cq.from_int4(
            torch.randint(0, 16, (k, n)), torch.randint(0, 16, (k // g, n)), torch.rand(k // g, n).half(), g
        )
    if fmt in cq.GGUF_SUPER_BLOCK_BYTES:  # k-quants: ggml's reference quantizer (tests/gguf_quant.py)
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from gguf_quant import K_QUANTIZERS

        return cq.from_gguf_k_blocks(K_QUANTIZERS[fmt.upper()](w.numpy()), fmt, n, k)
    return cq.quantize_block(w, fmt)


class Cycle:
    """Copies of a weight (quantized and fp32) cycled call after call, enough to stream from memory."""

    def __init__(self, w: cq.BlockQuantWeight, cold_bytes: int, max_copies: int = 400) -> None:
        dense = cq.dequantize_reference(w)
        nq = min(max_copies, max(1, -(-cold_bytes // w.nbytes())))
        nd = min(max_copies, max(1, -(-cold_bytes // (dense.numel() * 4))))
        self.q = [w] + [
            cq.BlockQuantWeight(
                w.q.clone(),
                w.scales.clone(),
                None if w.mins is None else w.mins.clone(),
                w.fmt,
                w.bits,
                w.group_size,
                w.zero_point,
                w.in_features,
                w.out_features,
            )
            for _ in range(nq - 1)
        ]
        self.dense = [dense] + [dense.clone() for _ in range(nd - 1)]
        self.iq = self.id = 0

    def next_q(self) -> cq.BlockQuantWeight:
        self.iq = (self.iq + 1) % len(self.q)
        return self.q[self.iq]

    def next_dense(self) -> torch.Tensor:
        self.id = (self.id + 1) % len(self.dense)
        return self.dense[self.id]


SHAPES = {"attn_576x576": (576, 576), "gate_up_1536x576": (1536, 576), "down_576x1536": (576, 1536)}
LM_HEAD = {"lm_head_49152x576": (49152, 576)}


def kernel_rows(
    kernel: cq.QLinearKernel,
    fmts: list[str],
    shapes: dict[str, tuple[int, int]],
    ms: list[int],
    cold: int,
    reps: int,
    bw: float,
    peak: float,
) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for fmt in fmts:
        for shape_name, (n, k) in shapes.items():
            cyc = Cycle(make(fmt, n, k), cold)
            qbytes, dbytes = cyc.q[0].nbytes(), n * k * 4
            for m in ms:
                x = torch.randn(m, k)
                t = timed(
                    {
                        "kernel": lambda x=x, cyc=cyc: kernel.linear(x, cyc.next_q()),
                        "fp32": lambda x=x, cyc=cyc: F.linear(x, cyc.next_dense()),
                    },
                    reps,
                )
                ms_k, ms_d = statistics.median(t["kernel"]), statistics.median(t["fp32"])
                flop = 2 * m * n * k
                rows.append(
                    {
                        "format": fmt,
                        "shape": shape_name,
                        "M": m,
                        "ms": round(ms_k, 3),
                        "GBps": round(qbytes / ms_k / 1e6, 2),
                        "of_mem_bw": round(qbytes / ms_k / 1e6 / bw, 2),
                        "GFLOPs": round(flop / ms_k / 1e6, 1),
                        "of_peak": round(flop / ms_k / 1e6 / peak, 2),
                        "fp32_ms": round(ms_d, 3),
                        "fp32_GBps": round(dbytes / ms_d / 1e6, 2),
                        "fp32_GFLOPs": round(flop / ms_d / 1e6, 1),
                        "speedup_vs_fp32": round(median_ratio(t["fp32"], t["kernel"]), 2),
                    }
                )
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def small_m_rows(kernel: cq.QLinearKernel, cold: int, reps: int) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for fmt in ("q4_1", "q8_0"):
        cyc = Cycle(make(fmt, 1536, 576), cold)
        for m in range(2, 9):
            x = torch.randn(m, 576)

            def gemv(x: torch.Tensor = x, m: int = m, cyc: Cycle = cyc) -> None:
                kernel.set_gemv_max_rows(m)
                kernel.linear(x, cyc.next_q())

            def panel(x: torch.Tensor = x, m: int = m, cyc: Cycle = cyc) -> None:
                kernel.set_gemv_max_rows(m - 1)
                kernel.linear(x, cyc.next_q())

            def panel_bf16(x: torch.Tensor = x, m: int = m, cyc: Cycle = cyc) -> None:
                kernel.set_gemv_max_rows(m - 1, m - 1)
                kernel.linear(x, cyc.next_q(), compute=torch.bfloat16)

            fns: dict[str, Callable[[], object]] = {"gemv": gemv, "panel": panel}
            if kernel.bf16:
                fns["panel_bf16"] = panel_bf16
            t = timed(fns, reps)
            row: dict[str, object] = {
                "format": fmt,
                "M": m,
                "gemv_ms": round(statistics.median(t["gemv"]), 3),
                "panel_ms": round(statistics.median(t["panel"]), 3),
                "panel_over_gemv": round(median_ratio(t["gemv"], t["panel"]), 2),
            }
            if kernel.bf16:  # the bf16 panel path against the (fp32) GEMV: gemv_max_rows under bf16
                row["panel_bf16_ms"] = round(statistics.median(t["panel_bf16"]), 3)
                row["panel_bf16_over_gemv"] = round(median_ratio(t["gemv"], t["panel_bf16"]), 2)
            rows.append(row)
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    kernel.set_gemv_max_rows(cq.GEMV_MAX_ROWS)
    return rows


def crossover_rows(
    kernel: cq.QLinearKernel, ms: list[int], reps: int, fmt: str = "q4_1"
) -> list[dict[str, object]]:
    """Per M: the kernel's fp32 GEMM against dequantize + torch GEMM in fp32 and in bf16 (block_linear's
    GEMM_MIN_ROWS and BF16_GEMM_MIN_ROWS are read off these rows; bf16 only where the CPU has it)."""
    bf16 = usable_cpu_features().avx512_bf16 or usable_cpu_features().amx_bf16
    rows: list[dict[str, object]] = []
    for shape_name, (n, k) in {**SHAPES, "gate_up_fused_3072x576": (3072, 576)}.items():
        w = make(fmt, n, k)
        lin = BlockQuantLinear(w, kernel=kernel)
        for m in ms:
            x = torch.randn(m, k)
            fns: dict[str, Callable[[], object]] = {
                "kernel": lambda x=x, w=w: kernel.linear(x, w),
                "dequant_gemm": lambda x=x, w=w, lin=lin: lin._dequant_gemm(x, w, kernel),
            }
            if bf16:
                fns["dequant_gemm_bf16"] = lambda x=x, w=w, lin=lin: lin._dequant_gemm(
                    x, w, kernel, torch.bfloat16
                )
            if kernel.bf16:
                fns["kernel_bf16"] = lambda x=x, w=w: kernel.linear(x, w, compute=torch.bfloat16)
            t = timed(fns, reps)
            row: dict[str, object] = {
                "shape": shape_name,
                "format": fmt,
                "M": m,
                "kernel_ms": round(statistics.median(t["kernel"]), 3),
                "dequant_gemm_ms": round(statistics.median(t["dequant_gemm"]), 3),
                "kernel_speedup": round(median_ratio(t["dequant_gemm"], t["kernel"]), 2),
            }
            if bf16:
                row["dequant_gemm_bf16_ms"] = round(statistics.median(t["dequant_gemm_bf16"]), 3)
                row["bf16_over_kernel"] = round(median_ratio(t["kernel"], t["dequant_gemm_bf16"]), 2)
            if kernel.bf16:  # the kernel's own bf16 path against bf16 dequantize + GEMM: BF16_GEMM_MIN_ROWS
                row["kernel_bf16_ms"] = round(statistics.median(t["kernel_bf16"]), 3)
                row["kernel_bf16_over_dequant_gemm_bf16"] = round(
                    median_ratio(t["dequant_gemm_bf16"], t["kernel_bf16"]), 2
                )
            rows.append(row)
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def _ab_fields(
    t: dict[str, list[float]], base: str, new: str, flop: int, new_unit: str = "GFLOPs"
) -> dict[str, float]:
    """A row's figures for two interleaved variants (`timed`): each one's median ms and rate (`new` in
    `new_unit`), and `new`'s speedup over `base` (median of the per-repetition ratios)."""
    ms_base, ms_new = statistics.median(t[base]), statistics.median(t[new])
    return {
        f"{base}_ms": round(ms_base, 3),
        f"{new}_ms": round(ms_new, 3),
        f"{base}_GFLOPs": round(flop / ms_base / 1e6, 1),
        f"{new}_{new_unit}": round(flop / ms_new / 1e6, 1),
        f"{new}_speedup": round(median_ratio(t[base], t[new]), 2),
    }


BF16_SHAPES = {
    "qkv_960x576": (960, 576),
    "o_576x576": (576, 576),
    "gate_up_3072x576": (3072, 576),
    "down_576x1536": (576, 1536),
}


def bf16_rows(
    kernel: cq.QLinearKernel, fmts: list[str], ms: list[int], cold: int, reps: int
) -> list[dict[str, object]]:
    """The batched kernel in fp32 against its bf16 path, per format, shape and M (see the docstring)."""
    if not kernel.bf16:
        return [{"skipped": "no usable AVX512-BF16 here (or KUBEINFER_CPU_DISABLE turned it off)"}]
    rows: list[dict[str, object]] = []
    for fmt in fmts:
        for shape_name, (n, k) in BF16_SHAPES.items():
            cyc = Cycle(make(fmt, n, k), cold)
            for m in ms:
                x = torch.randn(m, k)
                t = timed(
                    {
                        "fp32": lambda x=x, cyc=cyc: kernel.linear(x, cyc.next_q()),
                        "bf16": lambda x=x, cyc=cyc: kernel.linear(x, cyc.next_q(), compute=torch.bfloat16),
                    },
                    reps,
                )
                rows.append(
                    {
                        "format": fmt,
                        "shape": shape_name,
                        "M": m,
                        **_ab_fields(t, "fp32", "bf16", 2 * m * n * k),
                    }
                )
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


class _LayerCycle:
    """Calls copies of a layer in turn (weights from memory), with the batched int8 path on or off."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        self.layers, self.i = layers, 0

    def __call__(self, x: torch.Tensor, int8: bool) -> object:
        from server.quant import cpu_qgemv_q8 as q8

        self.i += 1
        with q8.int8_gemm(int8):
            return self.layers[self.i % len(self.layers)](x)


def int8_rows(kernel: cq.QLinearKernel, ms: list[int], cold: int, reps: int) -> list[dict[str, object]]:
    """A bf16 layer's Q4_1 projections as the server runs them (BlockQuantLinear, gemm_dtype bf16) with the
    batched int8 path (cpu_qgemv_q8.py) on and off, per shape and M, the weights streamed from memory
    (`cold`): off is the kernel's bf16 batched path below BF16_GEMM_MIN_ROWS and dequantize + oneDNN's
    bf16 GEMM from there."""
    from server.quant import cpu_qgemv_q8 as q8
    from server.quant.block_linear import BlockQuantLinear

    q8k = q8.try_load_q8_gemv_kernel(kernel)
    if q8k is None or q8k.isa != "vnni" or not kernel.bf16:
        return [{"skipped": "the batched int8 path needs AVX512-VNNI and bf16 GEMMs (AVX512-BF16) here"}]
    rows: list[dict[str, object]] = []
    for shape_name, (n, k) in BF16_SHAPES.items():
        layers: list[torch.nn.Module] = []
        for w in Cycle(make("q4_1", n, k), cold).q:
            layer = BlockQuantLinear(w, kernel=kernel)
            layer.gemm_dtype = torch.bfloat16
            layers.append(layer)
        cycle = _LayerCycle(layers)
        for m in ms:
            x = torch.randn(m, k)
            t = timed(
                {
                    "bf16": lambda x=x, cycle=cycle: cycle(x, int8=False),
                    "int8": lambda x=x, cycle=cycle: cycle(x, int8=True),
                },
                reps,
            )
            rows.append({"shape": shape_name, "M": m, **_ab_fields(t, "bf16", "int8", 2 * m * n * k, "GOPs")})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rss", action="store_true")
    ap.add_argument("--reps", type=int, default=0)
    ap.add_argument("--formats", default="q4_0,q4_1,q8_0,int8,int4")
    ap.add_argument("--only", default="kernels,small_m,crossover,bf16,int8", help="sections to run")
    ap.add_argument("--bf16-formats", default="q4_1,q8_0", help="formats of the `bf16` section")
    ap.add_argument("--threads", type=int, default=0, help="torch and kernel threads (default: torch's)")
    ap.add_argument("--crossover-rows", default="", help="comma-separated M for `crossover`")
    ap.add_argument("--crossover-format", default="q4_1")
    args = ap.parse_args()
    reps = args.reps or (3 if args.smoke else 9)
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel = cq.load_qlinear_kernel()
    bw = memory_bandwidth((64 if args.smoke else 512) << 20, reps)
    peak = gemm_gflops(256 if args.smoke else 1024, reps)
    cold = (4 << 20) if args.smoke else 2 * llc_bytes()
    out: dict[str, object] = {
        "machine": {
            **cpu_model(),
            "threads": torch.get_num_threads(),
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "kernel_isa": kernel.isa,
            "kernel_bf16": kernel.bf16,
            "mem_read_GBps": round(bw, 2),
            "fp32_gemm_GFLOPs": round(peak, 1),
            "llc_MiB": llc_bytes() >> 20,
        },
    }
    sections = set(args.only.split(","))
    fmts = args.formats.split(",")
    ms = [1, 4, 16] if args.smoke else [1, 4, 16, 64, 256]
    shapes = {"small_64x576": (64, 576)} if args.smoke else SHAPES
    if "kernels" in sections:
        out["kernels"] = kernel_rows(kernel, fmts, shapes, ms, cold, reps, bw, peak)
        if not args.smoke:
            out["kernels_lm_head"] = kernel_rows(kernel, fmts, LM_HEAD, [1, 4, 16], cold, reps, bw, peak)
    if "small_m" in sections:
        out["small_m"] = small_m_rows(kernel, cold, reps)
    if "crossover" in sections:
        cross_ms = [16, 64] if args.smoke else [64, 256, 512, 1024, 2048]
        if args.crossover_rows:
            cross_ms = [int(m) for m in args.crossover_rows.split(",")]
        out["crossover"] = crossover_rows(kernel, cross_ms, reps, args.crossover_format)
    if "bf16" in sections:
        bf16_ms = [8, 16] if args.smoke else [8, 16, 32, 64, 128]
        out["bf16"] = bf16_rows(kernel, args.bf16_formats.split(","), bf16_ms, cold, reps)
    if "int8" in sections:
        int8_ms = [8, 16] if args.smoke else [8, 16, 32, 64, 128, 256, 512, 2048]
        out["int8"] = int8_rows(kernel, int8_ms, cold, reps)
    if args.rss:
        out["rss"] = rss_of_embedded_model()
    out["machine"]["load_avg_1m_end"] = round(os.getloadavg()[0], 2)  # type: ignore[index]
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
