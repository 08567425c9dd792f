"""Each Triton kernel against its plain-torch reference, on CUDA. Prints one JSON document.

    python benchmarks/kernel_bench.py            # CUDA: full sizes, triton.testing.do_bench timings
    python benchmarks/kernel_bench.py --smoke    # tiny sizes; without CUDA runs the interpreter (checks the
                                            # script and the numerics, the timings mean nothing)

Without CUDA and without --smoke it prints {"status": "skipped", ...} and exits 0.
Figures: time in ms (median), achieved GB/s for memory-bound kernels (decode, store, weight-only GEMMs
and experts at small M) and TFLOP/s for compute-bound ones (prefill, GEMMs), the speedup over the
reference (fused_moe: over our per-expert torch loop, FusedMoE._grouped), and the largest absolute difference.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Imported after TRITON_INTERPRET is settled: it decides how the kernels are defined.
import kubeinfer_kernels
from kubeinfer_kernels import reference as ref


@dataclass(frozen=True)
class Result:
    kernel: str
    config: str
    triton_ms: float
    torch_ms: float
    speedup: float
    gbps: float | None
    tflops: float | None
    max_abs_diff: float


def _time_ms(fn: Callable[[], object], cuda: bool) -> float:
    if cuda:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _result(
    kernel: str,
    config: str,
    fn: Callable[[], torch.Tensor],
    ref_fn: Callable[[], torch.Tensor],
    cuda: bool,
    nbytes: float | None = None,
    flops: float | None = None,
) -> Result:
    out, expected = fn(), ref_fn()
    diff = float((out.float() - expected.float()).abs().max())
    t_ms, r_ms = _time_ms(fn, cuda), _time_ms(ref_fn, cuda)
    # as each finishes (the JSON comes at the end): a run stopped at its time limit still shows these
    print(
        f"{kernel} {config}: {t_ms:.4f} ms, reference {r_ms:.4f} ms, diff {diff:.3g}",
        file=sys.stderr,
        flush=True,
    )
    return Result(
        kernel=kernel,
        config=config,
        triton_ms=round(t_ms, 4),
        torch_ms=round(r_ms, 4),
        speedup=round(r_ms / t_ms, 2),
        gbps=None if nbytes is None else round(nbytes / t_ms / 1e6, 1),
        tflops=None if flops is None else round(flops / t_ms / 1e9, 2),
        max_abs_diff=diff,
    )


def _paged(
    query_lens: list[int], context_lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype, device: torch.device,
) -> dict[str, torch.Tensor]:  # fmt: skip
    needed = [math.ceil(c / block_size) for c in context_lens]
    num_blocks = sum(needed) + 1
    order = torch.randperm(num_blocks - 1) + 1
    tables = torch.zeros(len(needed), max(needed), dtype=torch.int32)
    used = 0
    for s, n in enumerate(needed):
        tables[s, :n] = order[used : used + n].to(torch.int32)
        used += n
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return {
        "q": torch.randn(sum(query_lens), heads, head_dim, device=device).to(dtype),
        "k_cache": torch.randn(shape, device=device).to(dtype),
        "v_cache": torch.randn(shape, device=device).to(dtype),
        "block_tables": tables.to(device),
        "context_lens": torch.tensor(context_lens, dtype=torch.int32, device=device),
        "query_start_loc": qsl.to(device),
    }


def bench(smoke: bool) -> list[Result]:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16
    es = torch.finfo(dtype).bits // 8
    heads, kv_heads, head_dim, block_size = (8, 2, 64, 16) if smoke else (32, 8, 128, 16)
    results: list[Result] = []

    # decode: many medium sequences, and one long one (split-K keeps the GPU busy)
    decode_cases = [(4, 100)] if smoke else [(64, 2048), (1, 32768)]
    for num_seqs, ctx in decode_cases:
        p = _paged([1] * num_seqs, [ctx] * num_seqs, heads, kv_heads, head_dim, block_size, dtype, device)
        scale = head_dim**-0.5
        args = (p["q"], p["k_cache"], p["v_cache"], p["block_tables"], p["context_lens"], scale)
        kv_bytes = 2 * num_seqs * ctx * kv_heads * head_dim * es
        results.append(
            _result(
                "paged_attention_decode",
                f"seqs={num_seqs} ctx={ctx} heads={heads}/{kv_heads} d={head_dim} {dtype}",
                lambda args=args, ctx=ctx: kubeinfer_kernels.paged_attention_decode(
                    *args, max_context_len=ctx
                ),
                lambda args=args: ref.paged_attention_decode_ref(*args),
                cuda,
                nbytes=kv_bytes,
            )
        )

    # prefill: chunks of new tokens after a cached prefix
    num_seqs, q_len, prefix = (2, 40, 24) if smoke else (4, 1024, 1024)
    p = _paged(
        [q_len] * num_seqs, [q_len + prefix] * num_seqs, heads, kv_heads, head_dim, block_size, dtype, device
    )
    pairs = num_seqs * (q_len * prefix + q_len * (q_len + 1) // 2)  # visible (query, key) pairs
    pf_args = (p["q"], p["k_cache"], p["v_cache"], p["block_tables"], p["context_lens"], p["query_start_loc"])
    results.append(
        _result(
            "paged_prefill_attention",
            f"seqs={num_seqs} new={q_len} prefix={prefix} heads={heads}/{kv_heads} d={head_dim} {dtype}",
            lambda: kubeinfer_kernels.paged_prefill_attention(*pf_args, head_dim**-0.5, max_query_len=q_len),
            lambda: ref.paged_attention_ref(*pf_args, head_dim**-0.5),
            cuda,
            flops=4.0 * pairs * heads * head_dim,
        )
    )

    # store: one step's K/V for a batch of tokens
    num_tokens = 64 if smoke else 8192
    num_blocks = math.ceil(num_tokens / block_size) + 1
    kc = torch.zeros(num_blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    vc, kc_ref, vc_ref = torch.zeros_like(kc), torch.zeros_like(kc), torch.zeros_like(kc)
    k = torch.randn(num_tokens, kv_heads, head_dim, device=device).to(dtype)
    v = torch.randn_like(k)
    slots = torch.randperm(num_tokens, device=device) + block_size

    def store() -> torch.Tensor:
        kubeinfer_kernels.store_kv_cache(k, v, kc, vc, slots)
        return kc

    def store_ref() -> torch.Tensor:
        ref.store_kv_cache_ref(k, v, kc_ref, vc_ref, slots)
        return kc_ref

    results.append(
        _result(
            "store_kv_cache",
            f"tokens={num_tokens} kv_heads={kv_heads} d={head_dim} {dtype}",
            store,
            store_ref,
            cuda,
            nbytes=4 * k.numel() * es,
        )
    )

    # weight-only GEMMs: decode-sized and prefill-sized M
    k_dim, n_dim = (256, 128) if smoke else (4096, 4096)
    group = 128
    quant = ref.quantize_int4(torch.randn(k_dim, n_dim) * 0.05, group)
    awq = ref.pack_awq(quant)
    qw, qz, sc = awq.qweight.to(device), awq.qzeros.to(device), awq.scales.to(device)
    w8 = ref.quantize_fp8_per_channel(torch.randn(n_dim, k_dim) * 0.05)
    w8w, w8s = w8.weight.to(device), w8.scale.to(device)
    for m in [1, 16] if smoke else [1, 16, 256, 2048]:
        x = torch.randn(m, k_dim, device=device).to(torch.float16)
        flops = 2.0 * m * n_dim * k_dim
        int4_bytes = k_dim * n_dim / 2 + 2 * x.numel() + 2 * m * n_dim + sc.numel() * 2
        results.append(
            _result(
                "int4_gemm",
                f"M={m} K={k_dim} N={n_dim} G={group} fp16 (AWQ layout)",
                lambda x=x: kubeinfer_kernels.int4_gemm(x, qw, qz, sc, group),
                lambda x=x: ref.int4_gemm_ref(x, qw, qz, sc, group),
                cuda,
                nbytes=int4_bytes,
                flops=flops,
            )
        )
        xb = x.to(torch.bfloat16)
        fp8_bytes = k_dim * n_dim + 2 * x.numel() + 2 * m * n_dim
        results.append(
            _result(
                "fp8_gemm",
                f"M={m} K={k_dim} N={n_dim} bf16 x e4m3 per-channel",
                lambda xb=xb: kubeinfer_kernels.fp8_gemm(xb, w8w, w8s),
                lambda xb=xb: ref.fp8_gemm_ref(xb, w8w, w8s),
                cuda,
                nbytes=fp8_bytes,
                flops=flops,
            )
        )
    results += _bench_fused_moe(smoke, cuda, device)
    return results


def _grouped_moe(
    w13: torch.Tensor,  # [E, 2I, H] bf16
    w2: torch.Tensor,  # [E, H, I] bf16
    top_k: int,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """Our torch path without the kernel, as the baseline: FusedMoE._grouped (the pairs grouped by
    expert, each expert with tokens runs its two GEMMs in bf16) over these experts, called as
    (x [T, H] bf16, topk_weights [T, top_k] fp32, topk_ids [T, top_k] int32) -> [T, H] bf16.
    fused_moe_ref gathers every pair's weights densely, which at these sizes would take hundreds of GB,
    so this loop is the baseline and the diff is against it."""
    from server.models.moe.config import MoEConfig
    from server.models.moe.layer import FusedMoE
    from server.models.moe.routing import Routing
    from server.models.moe.weights import ExpertWeights

    e, h, i = w2.shape
    cfg = MoEConfig("qwen3_moe", num_experts=e, top_k=top_k, hidden_size=h, intermediate_size=i)
    router = torch.zeros(e, h, device=w13.device)  # unused: the routing is given
    block = FusedMoE(cfg, ExpertWeights(router, None, w13, w2, None, None), gemm_dtype=torch.bfloat16)

    def run(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return block._grouped(x, Routing(topk_weights, topk_ids.long())).to(x.dtype)

    return run


def _bench_fused_moe(smoke: bool, cuda: bool, device: torch.device) -> list[Result]:
    """Qwen3-30B-A3B's expert shapes (hidden 2048, experts of 768, 128 experts, top-8) in bf16, routed
    uniformly at random; smoke: a tiny block."""
    hidden, inter, experts, top_k = (64, 32, 8, 2) if smoke else (2048, 768, 128, 8)
    w13 = (torch.randn(experts, 2 * inter, hidden, device=device) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter, device=device) * 0.02).to(torch.bfloat16)
    baseline = _grouped_moe(w13, w2, top_k)
    out: list[Result] = []
    for t in [1, 16] if smoke else [1, 16, 256, 2048]:
        x = torch.randn(t, hidden, device=device).to(torch.bfloat16)
        scores = torch.rand(t, experts, device=device)
        topk_weights, ids = scores.topk(top_k, dim=-1)
        topk_weights = (topk_weights / topk_weights.sum(-1, keepdim=True)).float()
        topk_ids = ids.to(torch.int32)
        active = int(topk_ids.unique().numel())
        out.append(
            _result(
                "fused_moe",
                f"T={t} H={hidden} I={inter} E={experts} top{top_k} bf16 ({active} experts hit)",
                lambda x=x, w=topk_weights, i=topk_ids: kubeinfer_kernels.fused_moe(x, w13, w2, w, i),
                lambda x=x, w=topk_weights, i=topk_ids: baseline(x, w, i),
                cuda,
                nbytes=active * 3 * inter * hidden * 2,  # the experts' weights read once each
                flops=2.0 * t * top_k * 3 * inter * hidden,
            )
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; runs under the interpreter on CPU")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print(json.dumps({"status": "skipped", "reason": "benchmarks/kernel_bench.py needs a CUDA device"}))
        return 0
    results = bench(args.smoke)
    doc = {
        "status": "ok",
        "device": torch.cuda.get_device_name() if cuda else "cpu (TRITON_INTERPRET=1, timings meaningless)",
        "torch": torch.__version__,
        "results": [asdict(r) for r in results],
    }
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
