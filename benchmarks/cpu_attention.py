"""The CPU attention kernels (server/attention/csrc/paged_decode.cpp) against what they replace; prints JSON.

    python benchmarks/cpu_attention.py [--threads 2 --reps 8]

- `decode`: 32 decode sequences x 30 layers (SmolLM2's 9 query / 3 KV heads of 64) over a bf16 cache, with
  the kernel's bf16 K pass on and off (`kubeinfer_paged_decode_set_bf16`, the switch
  KUBEINFER_CPU_DISABLE=avx512_bf16 turns off), for short private contexts, long private ones (both bound
  by memory bandwidth) and long ones over a shared 512-token prefix (held in cache: bound by the kernel's
  arithmetic);
- `prefill`: prompt chunks over the paged bf16 cache, one layer: the kernel's bf16 prefill attention
  (`DecodeKernel.prefill`) against torch's SDPA over the same K/V in fp32 (what the backend runs without
  it: one call per group of same-shape chunks, an additive causal mask over a cached prefix).
- `decode_fp32` (any CPU with AVX2 and FMA): the same 32 x 30-layer decode over an fp32 cache (the
  default `--kv-cache-dtype auto` on a CPU without bf16) with the AVX2 (x86-64-v3) build of the kernel,
  its 8-lane register passes, against the same build with them compiled out (-DKI_GENERIC_DECODE: the
  generic loops an AVX2 build ran before), for short and long private contexts and long ones over a
  shared 512-token prefix (held in cache: bound by arithmetic).
- `decode_int8`: a decode step's attention in Llama-3.2-1B's shape (32 query / 8 KV heads of 64, 16 layers),
  8 sequences of 512, 2,048 and 8,192 private tokens, over the bf16 cache `auto` gives a CPU with bf16
  (the bf16 K pass on where it runs) against an int8 cache (`--kv-cache-dtype int8`, server/attention/int8_kv.py:
  0.56x its bytes) and an fp32 one, with the KV bytes each reads.
Times are the median and minimum of `--reps` calls, the calls of both sides alternating so that the load
of this shared machine hits both alike. `decode` and `prefill` only where the CPU has usable AVX512-BF16
(else it says so).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import server  # noqa: F401  (CPU runtime settings before torch loads)

# isort: split
import torch
import torch.nn.functional as F
from paged_batch import make_paged_batch

from server.attention import int8_kv
from server.attention.cpu_kernel import (
    NATIVE,
    DecodeKernel,
    PrefillChunks,
    bind_decode_kernel,
    load_decode_kernel,
)
from server.native import VARIANTS, build, compiler, usable_cpu_features, variant_flags

HQ, HKV, D, BS, LAYERS = 9, 3, 64, 16, 30


def alternate(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps + 1):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t) * 1000)
    return {name: ts[1:] for name, ts in times.items()}  # the first call of each warms up


def summary(ts: list[float]) -> dict[str, float]:
    return {"median_ms": round(statistics.median(ts), 3), "min_ms": round(min(ts), 3)}


def decode_case(kernel: DecodeKernel, reps: int, ctx: int, shared: int) -> dict[str, object]:
    seqs = 32
    q = torch.randn(seqs, HQ, D)
    idx = torch.arange(seqs)
    nb, sh = -(-ctx // BS), shared // BS
    total = sh + seqs * (nb - sh)
    caches = [
        (torch.randn(total, BS, HKV, D).bfloat16(), torch.randn(total, BS, HKV, D).bfloat16())
        for _ in range(LAYERS)
    ]
    tables = torch.zeros(seqs, nb, dtype=torch.int32)
    for i in range(seqs):
        tables[i, :sh] = torch.arange(sh)
        tables[i, sh:] = sh + i * (nb - sh) + torch.arange(nb - sh)
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    out = {"bf16": torch.empty_like(q), "widened": torch.empty_like(q)}

    def step(mode: str) -> None:
        kernel.lib.kubeinfer_paged_decode_set_bf16(int(mode == "bf16"))
        for kc, vc in caches:
            kernel(out[mode], q, kc, vc, tables, lens, idx, idx, 0.125, indices_checked=True)

    t = alternate({"bf16": lambda: step("bf16"), "widened": lambda: step("widened")}, reps)
    kernel.lib.kubeinfer_paged_decode_set_bf16(1)
    return {
        "sequences": seqs,
        "context": ctx,
        "shared_prefix": shared,
        "layers": LAYERS,
        "bf16_k_pass": summary(t["bf16"]),
        "widened_k_pass": summary(t["widened"]),
        "speedup_median": round(statistics.median(t["widened"]) / statistics.median(t["bf16"]), 2),
        "max_abs_difference": float((out["bf16"] - out["widened"]).abs().max()),
    }


def avx2_builds(folder: str) -> dict[str, DecodeKernel]:
    """The kernel's x86-64-v3 (AVX2 + FMA) build with its 8-lane decode passes and without them."""
    (variant,) = [v for v in VARIANTS if v.march == "x86-64-v3"]
    kernels = {}
    for name, extra in (("avx2_passes", ()), ("avx2_generic", ("-DKI_GENERIC_DECODE",))):
        path = Path(folder) / f"paged_decode-{name}.so"
        build(NATIVE, compiler(), path, variant_flags(NATIVE, variant) + extra)
        kernels[name] = bind_decode_kernel(ctypes.CDLL(str(path)), path)
    assert (kernels["avx2_passes"].isa, kernels["avx2_generic"].isa) == ("avx2", "generic")
    return kernels


def decode_fp32_case(kernels: dict[str, DecodeKernel], reps: int, ctx: int, shared: int) -> dict[str, object]:
    seqs = 32
    q = torch.randn(seqs, HQ, D)
    idx = torch.arange(seqs)
    nb, sh = -(-ctx // BS), shared // BS
    total = sh + seqs * (nb - sh)
    caches = [(torch.randn(total, BS, HKV, D), torch.randn(total, BS, HKV, D)) for _ in range(LAYERS)]
    tables = torch.zeros(seqs, nb, dtype=torch.int32)
    for i in range(seqs):
        tables[i, :sh] = torch.arange(sh)
        tables[i, sh:] = sh + i * (nb - sh) + torch.arange(nb - sh)
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    out = {name: torch.empty_like(q) for name in kernels}

    def step(name: str) -> None:
        for kc, vc in caches:
            kernels[name](out[name], q, kc, vc, tables, lens, idx, idx, 0.125, indices_checked=True)

    t = alternate({name: functools.partial(step, name) for name in kernels}, reps)
    return {
        "sequences": seqs,
        "context": ctx,
        "shared_prefix": shared,
        "layers": LAYERS,
        "kv_MB_read": round(total * BS * HKV * D * 4 * 2 * LAYERS / 1e6),
        "avx2_passes": summary(t["avx2_passes"]),
        "avx2_generic": summary(t["avx2_generic"]),
        "speedup_median": round(
            statistics.median(t["avx2_generic"]) / statistics.median(t["avx2_passes"]), 2
        ),
        "max_abs_difference": float((out["avx2_passes"] - out["avx2_generic"]).abs().max()),
    }


def decode_fp32_rows(reps: int) -> list[dict[str, object]]:
    with tempfile.TemporaryDirectory() as folder:
        kernels = avx2_builds(folder)
        rows: list[dict[str, object]] = []
        for ctx, shared in ((128, 0), (640, 0), (640, 512)):
            rows.append(decode_fp32_case(kernels, reps, ctx, shared))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def decode_rows(kernel: DecodeKernel, reps: int) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for ctx, shared in ((128, 0), (640, 0), (640, 512)):
        rows.append(decode_case(kernel, reps, ctx, shared))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def decode_int8_case(kernel: DecodeKernel, reps: int, ctx: int) -> dict[str, object]:
    seqs, hq, hkv, d, layers = 8, 32, 8, 64, 16  # Llama-3.2-1B
    q = torch.randn(seqs, hq, d)
    idx = torch.arange(seqs)
    nb = -(-ctx // BS)
    tables = (torch.arange(seqs * nb, dtype=torch.int32).view(seqs, nb) * 7919) % (seqs * nb)  # scattered
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    caches: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {"bf16": [], "int8": [], "fp32": []}
    slots = torch.arange(seqs * nb * BS)
    for _ in range(layers):
        k, v = torch.randn(seqs * nb, BS, hkv, d), torch.randn(seqs * nb, BS, hkv, d)
        caches["bf16"].append((k.bfloat16(), v.bfloat16()))
        caches["fp32"].append((k, v))
        kc, vc = (int8_kv.allocate(seqs * nb, BS, hkv, d) for _ in range(2))
        kernel.store_kv(kc, vc, slots, k.view(-1, hkv, d), v.view(-1, hkv, d))
        caches["int8"].append((kc, vc))
    out = {name: torch.empty_like(q) for name in caches}

    def step(name: str) -> None:
        for kc, vc in caches[name]:
            kernel(out[name], q, kc, vc, tables, lens, idx, idx, 0.125, indices_checked=True)

    t = alternate({name: functools.partial(step, name) for name in caches}, reps)
    per_row = {"bf16": 2 * d, "int8": int8_kv.block_bytes(1, 1, d), "fp32": 4 * d}
    return {
        "sequences": seqs,
        "context": ctx,
        "layers": layers,
        **{
            f"{name}_kv_MB": round(seqs * nb * BS * hkv * per_row[name] * 2 * layers / 1e6) for name in caches
        },
        **{name: summary(t[name]) for name in caches},
        "int8_over_bf16_time": round(statistics.median(t["int8"]) / statistics.median(t["bf16"]), 2),
        "int8_max_abs_difference_to_fp32": float((out["int8"] - out["fp32"]).abs().max()),
    }


def decode_int8_rows(kernel: DecodeKernel, reps: int) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for ctx in (512, 2048, 8192):
        rows.append(decode_int8_case(kernel, reps, ctx))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def prefill_case(kernel: DecodeKernel, reps: int, chunks: int, n: int, ctx: int) -> dict[str, object]:
    batch = make_paged_batch(
        [n] * chunks,
        [ctx] * chunks,
        num_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        block_size=BS,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    kc, vc = batch.k_cache.bfloat16(), batch.v_cache.bfloat16()
    spec = PrefillChunks(
        seqs=torch.arange(chunks),
        q_starts=torch.arange(chunks) * n,
        q_lens=torch.full((chunks,), n, dtype=torch.int32),
        ctx_lens=torch.full((chunks,), ctx, dtype=torch.int32),
    )
    out = torch.empty_like(batch.q)
    qs = batch.q.view(chunks, n, HQ, D).transpose(1, 2)  # [B, Hq, n, D]
    ks = torch.randn(chunks, HKV, ctx, D).bfloat16().float()  # [B, Hkv, ctx, D], as the backend widens
    vs = torch.randn(chunks, HKV, ctx, D).bfloat16().float()
    pos, q_pos = torch.arange(ctx), torch.arange(ctx - n, ctx)
    mask = torch.zeros(n, ctx).masked_fill_(pos[None, :] > q_pos[:, None], float("-inf"))

    def sdpa() -> object:
        if ctx > n:
            return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=0.125, enable_gqa=True)
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=0.125, enable_gqa=True)

    ks16, vs16, mask16 = ks.bfloat16(), vs.bfloat16(), mask.bfloat16()

    def sdpa_bf16() -> (
        object
    ):  # q rounded here (it arrives fp32); oneDNN's bf16 kernels (AMX tiles where usable)
        q16 = qs.bfloat16()
        if ctx > n:
            return F.scaled_dot_product_attention(
                q16, ks16, vs16, attn_mask=mask16, scale=0.125, enable_gqa=True
            )
        return F.scaled_dot_product_attention(q16, ks16, vs16, is_causal=True, scale=0.125, enable_gqa=True)

    def fused() -> object:
        return kernel.prefill(out, batch.q, kc, vc, batch.block_tables, spec, 0.125, indices_checked=True)

    t = alternate({"kernel": fused, "sdpa": sdpa, "sdpa_bf16": sdpa_bf16}, reps)
    flop = chunks * HQ * n * ctx * D * 4 * (0.5 if ctx == n else 1.0)
    return {
        "chunks": chunks,
        "query_len": n,
        "context": ctx,
        "kernel_bf16": summary(t["kernel"]),
        "sdpa_fp32": summary(t["sdpa"]),
        "kernel_GFLOPs": round(flop / statistics.median(t["kernel"]) / 1e6, 1),
        "sdpa_GFLOPs": round(flop / statistics.median(t["sdpa"]) / 1e6, 1),
        "speedup_median": round(statistics.median(t["sdpa"]) / statistics.median(t["kernel"]), 2),
        "sdpa_bf16": summary(t["sdpa_bf16"]),
        "sdpa_bf16_over_kernel": round(statistics.median(t["sdpa_bf16"]) / statistics.median(t["kernel"]), 2),
    }


def prefill_rows(kernel: DecodeKernel, reps: int) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for chunks, n, ctx in ((2, 128, 640), (16, 128, 128), (16, 128, 640), (1, 2048, 2048)):
        rows.append(prefill_case(kernel, reps, chunks, n, ctx))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=8)
    sections = ("decode_fp32", "decode", "prefill", "decode_int8")
    ap.add_argument("--only", nargs="+", choices=sections, default=list(sections))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    kernel = load_decode_kernel()
    result: dict[str, object] = {
        "benchmark": "CPU attention kernels: fp32 decode passes vs generic, decode bf16 K pass on/off, prefill "
        "kernel vs SDPA, decode over int8 vs bf16 caches",
        "threads": args.threads,
        "usable_features": [f for f, on in vars(usable_cpu_features()).items() if on],
        "load_average_at_start": os.getloadavg(),
    }
    usable = usable_cpu_features()
    if "decode_fp32" in args.only:
        if usable.avx2 and usable.fma:
            result["decode_fp32"] = decode_fp32_rows(args.reps)
        else:
            result["decode_fp32"] = "skipped: no usable AVX2 + FMA here"
    if {"decode", "prefill"} & set(args.only) and not kernel.bf16:
        result["skipped"] = (
            "decode, prefill: no usable AVX512-BF16 here (or KUBEINFER_CPU_DISABLE turned it off)"
        )
    else:
        if "decode" in args.only:
            result["decode"] = decode_rows(kernel, args.reps)
        if "prefill" in args.only:
            result["prefill"] = prefill_rows(kernel, args.reps)
    if "decode_int8" in args.only:
        result["decode_int8"] = decode_int8_rows(kernel, args.reps)
    result["load_average_at_end"] = os.getloadavg()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
