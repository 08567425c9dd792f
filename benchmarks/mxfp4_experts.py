"""gpt-oss's MXFP4 experts on CPU: one MoE layer's step, the MXFP4 kernel (server/quant/csrc/mxfp4.cpp)
against the former path (each chosen expert dequantized to fp32, then torch's GEMM), alternated in one
run, and how close a one-token step gets to the weights' bandwidth bound.

The layer is gpt-oss-20b-shaped (hidden 2880, expert intermediate 2880, 32 experts, top-4, biased
router, clamped SwiGLU), random MXFP4 bytes (scales 2**-7..2**-4). Each timed step draws new tokens, so
the chosen experts change from step to step (the 32 experts' 423 MB do not fit in any cache; the same
token every step would time a cached handful). Bound: the chosen experts' packed bytes (blocks +
scales of w13 and w2; 13.2 MB per expert) over the step's time, against the memory bandwidth of a
64 MiB copy (read + write, as benchmarks/cpu_ceilings.py measures it) on the same thread count.
The machine may be shared: compare ratios; the load average is printed before and after.

    python benchmarks/mxfp4_experts.py [--tokens 1 16 --rounds 3 --threads 1 --kernel-reps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from cpu_ceilings import copy_gb_per_s

from server.models.moe import FusedMoE, MoEConfig, Mxfp4Experts, Mxfp4Tensor
from server.models.moe.weights import ExpertWeights
from server.native import usable_cpu_features
from server.quant.cpu_mxfp4 import load_mxfp4_kernel

HIDDEN, INTER, EXPERTS, TOP_K = 2880, 2880, 32, 4


def _packed(shape: tuple[int, int, int], g: torch.Generator) -> Mxfp4Tensor:  # [E, N, K]
    e, n, k = shape
    blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=g, dtype=torch.uint8)
    return Mxfp4Tensor(blocks, torch.randint(120, 124, (e, n, k // 32), generator=g, dtype=torch.uint8))


def _layer(
    g: torch.Generator,
) -> tuple[MoEConfig, ExpertWeights, Mxfp4Tensor, Mxfp4Tensor, torch.Tensor, torch.Tensor]:
    cfg = MoEConfig(
        "gpt_oss",
        EXPERTS,
        TOP_K,
        HIDDEN,
        INTER,
        routing="topk_softmax",
        router_bias=True,
        activation="swigluoai",
        expert_bias=True,
    )
    b13 = torch.randn(EXPERTS, 2 * INTER, generator=g) * 0.01
    b2 = torch.randn(EXPERTS, HIDDEN, generator=g) * 0.01
    weights = ExpertWeights(
        router=torch.randn(EXPERTS, HIDDEN, generator=g) * 0.02,
        router_bias=torch.randn(EXPERTS, generator=g) * 0.02,
        w13=None,
        w2=None,
        b13=b13,
        b2=b2,
    )
    return (
        cfg,
        weights,
        _packed((EXPERTS, 2 * INTER, HIDDEN), g),
        _packed((EXPERTS, HIDDEN, INTER), g),
        b13,
        b2,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two paths")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kernel-reps", type=int, default=10, help="kernel steps per round (the old path: 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    g = torch.Generator().manual_seed(0)
    cfg, weights, w13, w2, b13, b2 = _layer(g)
    kernel = load_mxfp4_kernel()
    paths = {
        "kernel": FusedMoE(cfg, weights, experts=Mxfp4Experts(w13, w2, b13, b2, kernel)),
        "dequantize": FusedMoE(cfg, weights, experts=Mxfp4Experts(w13, w2, b13, b2, None)),
    }
    per_expert = w13.nbytes() // EXPERTS + w2.nbytes() // EXPERTS
    out: dict[str, object] = {
        "shape": {"hidden": HIDDEN, "intermediate": INTER, "experts": EXPERTS, "top_k": TOP_K},
        "kernel_path": kernel.isa,
        "cpu_features": usable_cpu_features().names(),
        "threads": args.threads,
        "expert_bytes": per_expert,
        "copy_gb_per_s": round(copy_gb_per_s(), 2),
    }
    for t in args.tokens:
        times: dict[str, list[float]] = {name: [] for name in paths}
        experts_read: list[int] = []
        with torch.inference_mode():
            paths["kernel"](torch.randn(t, HIDDEN, generator=g))  # warm: the kernel's first call
            for _ in range(args.rounds):
                for name, moe in paths.items():
                    for _ in range(args.kernel_reps if name == "kernel" else 1):
                        x = torch.randn(t, HIDDEN, generator=g) * 0.5
                        if name == "kernel":
                            experts_read.append(len(set(moe.route(x).ids.reshape(-1).tolist())))
                        t0 = time.perf_counter()
                        moe(x)
                        times[name].append(time.perf_counter() - t0)
        kernel_ms = statistics.median(times["kernel"]) * 1e3
        old_ms = statistics.median(times["dequantize"]) * 1e3
        case: dict[str, object] = {
            "kernel_ms_median": round(kernel_ms, 3),
            "kernel_ms_best": round(min(times["kernel"]) * 1e3, 3),
            "dequantize_ms_median": round(old_ms, 1),
            "speedup": round(old_ms / kernel_ms, 1),
            "experts_read_mean": round(statistics.mean(experts_read), 2),
        }
        if t == 1:
            gbs = TOP_K * per_expert / (kernel_ms / 1e3) / 1e9
            case["kernel_weight_gb_per_s"] = round(gbs, 2)
            case["of_copy_bandwidth"] = round(gbs / float(out["copy_gb_per_s"]), 2)  # type: ignore[arg-type]
        out[f"tokens_{t}"] = case
    out["load_average_before_after"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
