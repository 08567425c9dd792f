"""Attention sinks (gpt-oss: one learned logit per query head joining every softmax's denominator) on CPU:
the compiled decode and prefill kernels and the torch/cpu backends (torch decode path, SDPA groups with
and without a cached prefix, the bf16 SDPA groups), alone and with sliding windows, against the fp32
reference (kubeinfer_kernels.reference: transformers' concatenated sink column)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kubeinfer_kernels.reference import paged_attention_decode_ref, paged_attention_ref, store_kv_cache_ref
from paged_batch import ATTN_TOL, make_attention_metadata, make_paged_batch

from server.attention.cpu_kernel import DecodeKernel, PrefillChunks, load_decode_kernel
from server.attention.torch_backend import TorchAttentionBackend


@pytest.fixture(scope="module")
def kernel() -> DecodeKernel:
    return load_decode_kernel()


def _sinks(num_heads: int) -> torch.Tensor:
    # ordinary values, plus one far above every score (output ~0: the merge must not overflow) and one
    # far below (no effect)
    s = torch.randn(num_heads) * 2
    s[0], s[-1] = 40.0, -40.0
    return s


@pytest.mark.parametrize("window", [None, 7, 33])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gqa", [1, 4])
def test_decode_kernel_sinks_match_reference(
    kernel: DecodeKernel, window: int | None, cache_dtype: torch.dtype, gqa: int
) -> None:
    torch.manual_seed(gqa + (window or 0))
    ctx = [1, 45, 100, 1200]  # 1200: the kernel cuts it into parts merged with the sink
    batch = make_paged_batch(
        [1] * len(ctx), ctx, num_heads=2 * gqa, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, device=torch.device("cpu"),
    )  # fmt: skip
    kc, vc = batch.k_cache.to(cache_dtype), batch.v_cache.to(cache_dtype)
    sinks = _sinks(2 * gqa)
    out = torch.full_like(batch.q, float("nan"))
    idx = torch.arange(len(ctx), dtype=torch.int64)
    kernel(
        out, batch.q, kc, vc, batch.block_tables, batch.context_lens, idx, idx, 0.125,
        sliding_window=window, sinks=sinks,
    )  # fmt: skip
    args = (batch.q, kc.float(), vc.float(), batch.block_tables, batch.context_lens, 0.125, window)
    ref = paged_attention_decode_ref(*args, sinks=sinks)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert (paged_attention_decode_ref(*args) - ref).abs().max() > 0.2  # ignoring the sinks fails above


@pytest.mark.parametrize("window", [None, 16, 100])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_prefill_kernel_sinks_match_reference(
    kernel: DecodeKernel, window: int | None, head_dim: int
) -> None:
    if not kernel.bf16:
        pytest.skip("no usable AVX512-BF16 here: the prefill kernel does not run")
    torch.manual_seed(head_dim + (window or 0))
    query_lens, ctx_lens = [5, 128, 1, 37, 300], [5, 640, 300, 40, 900]
    batch = make_paged_batch(
        query_lens, ctx_lens, num_heads=6, num_kv_heads=2, head_dim=head_dim, block_size=16,
        dtype=torch.float32, device=torch.device("cpu"),
    )  # fmt: skip
    kc, vc = batch.k_cache.bfloat16(), batch.v_cache.bfloat16()
    chunks = PrefillChunks(
        seqs=torch.arange(len(query_lens), dtype=torch.int64),
        q_starts=batch.query_start_loc[:-1].long().contiguous(),
        q_lens=torch.tensor(query_lens, dtype=torch.int32),
        ctx_lens=torch.tensor(ctx_lens, dtype=torch.int32),
    )
    sinks = _sinks(6)
    out = torch.full_like(batch.q, float("nan"))
    scale = head_dim**-0.5
    assert kernel.prefill(
        out, batch.q, kc, vc, batch.block_tables, chunks, scale, sliding_window=window, sinks=sinks
    )
    args = (
        batch.q, kc.float(), vc.float(), batch.block_tables, batch.context_lens, batch.query_start_loc,
        scale, window,
    )  # fmt: skip
    ref = paged_attention_ref(*args, sinks=sinks)
    atol, rtol = ATTN_TOL[torch.bfloat16]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    assert (out - ref).abs().mean() < 2e-3
    assert (paged_attention_ref(*args) - ref).abs().max() > 0.2


def test_kernel_refuses_bad_sinks(kernel: DecodeKernel) -> None:
    batch = make_paged_batch(
        [1], [5], num_heads=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32,
        device=torch.device("cpu"),
    )  # fmt: skip
    idx = torch.zeros(1, dtype=torch.int64)
    out = torch.empty_like(batch.q)
    for bad, err in ((torch.zeros(3), ValueError), (torch.zeros(2, dtype=torch.bfloat16), TypeError)):
        with pytest.raises(err, match="sinks"):
            kernel(
                out, batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, idx, idx,
                0.125, sinks=bad,
            )  # fmt: skip


@pytest.mark.parametrize("backend", ["torch", "cpu", "cpu-amx"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backends_sinks_with_and_without_windows(
    kernel: DecodeKernel, backend: str, cache_dtype: torch.dtype
) -> None:
    """gpt-oss's pattern (windowed and full layers, each with its sinks) through one step's metadata: a
    mixed batch of decodes, whole prompts longer than the window and chunks over cached prefixes."""
    if backend == "cpu-amx" and not (kernel.bf16 and cache_dtype == torch.bfloat16):
        pytest.skip("the bf16 SDPA groups serve a bf16 cache where the prefill kernel would")
    torch.manual_seed(11)
    query_lens, prefix_lens = [1, 40, 1, 24, 24, 9], [70, 0, 20, 50, 50, 100]
    hq, hkv, d = 8, 2, 64
    meta = make_attention_metadata(query_lens, prefix_lens, 16, torch.device("cpu"))
    t = sum(query_lens)
    shape = (int(meta.block_tables.max()) + 2, 16, hkv, d)
    k_cache, v_cache = torch.randn(shape).to(cache_dtype), torch.randn(shape).to(cache_dtype)
    be = {
        "torch": TorchAttentionBackend(16),
        "cpu": TorchAttentionBackend(16, kernel),
        "cpu-amx": TorchAttentionBackend(16, dataclasses.replace(kernel, amx_bf16=True)),
    }[backend]
    for layer, window in enumerate([16, None, 5, None]):
        sinks = _sinks(hq)
        q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
        kc, vc = k_cache.clone(), v_cache.clone()
        out = be.forward(q, k, v, kc, vc, meta, d**-0.5, sliding_window=window, sinks=sinks)
        rk, rv = k_cache.clone(), v_cache.clone()
        store_kv_cache_ref(k, v, rk, rv, meta.slot_mapping)
        ref = paged_attention_ref(
            q, rk.float(), rv.float(), meta.block_tables, meta.context_lens, meta.query_start_loc, d**-0.5,
            sliding_window=window, sinks=sinks,
        )  # fmt: skip
        atol, rtol = ATTN_TOL[torch.bfloat16 if cache_dtype == torch.bfloat16 else torch.float32]
        torch.testing.assert_close(
            out.float(), ref, atol=atol, rtol=rtol, msg=f"layer {layer} window {window}"
        )
