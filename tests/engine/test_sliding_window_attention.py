"""Sliding-window attention on CPU: the compiled decode and prefill kernels and the CPU/torch backends
against the fp32 reference (kubeinfer_kernels.reference, transformers' convention: the query at position p
sees keys p - W + 1 .. p), with contexts several windows long, windows straddling block edges, and an
interleaved pattern (windowed and global layers over one step's metadata)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kubeinfer_kernels.reference import paged_attention_decode_ref, paged_attention_ref, store_kv_cache_ref
from paged_batch import ATTN_TOL, make_attention_metadata, make_paged_batch

from server.attention.cpu_kernel import DecodeKernel, PrefillChunks, load_decode_kernel
from server.attention.torch_backend import TorchAttentionBackend

# 1: only the query itself; 7 and 33: edges inside blocks; 256: longer than the shorter contexts (no-op)
WINDOWS = [1, 7, 16, 33, 256]


@pytest.fixture(scope="module")
def kernel() -> DecodeKernel:
    return load_decode_kernel()


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gqa", [1, 4])
def test_decode_kernel_window_matches_reference(
    kernel: DecodeKernel, window: int, cache_dtype: torch.dtype, gqa: int
) -> None:
    torch.manual_seed(window + gqa)
    # 1 token, ragged short ones, and 1200 tokens: the kernel cuts a long context into parts (256+ tokens)
    ctx = [1, 45, 100, 1200]
    batch = make_paged_batch(
        [1] * len(ctx), ctx, num_heads=2 * gqa, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, device=torch.device("cpu"),
    )  # fmt: skip
    kc, vc = batch.k_cache.to(cache_dtype), batch.v_cache.to(cache_dtype)
    out = torch.full_like(batch.q, float("nan"))
    n = len(ctx)
    idx = torch.arange(n, dtype=torch.int64)
    kernel(
        out, batch.q, kc, vc, batch.block_tables, batch.context_lens, idx, idx, 0.125, sliding_window=window
    )
    ref = paged_attention_decode_ref(
        batch.q, kc.float(), vc.float(), batch.block_tables, batch.context_lens, 0.125, sliding_window=window
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if window < 45:  # the window changes the answer: a kernel ignoring it fails here
        full = paged_attention_decode_ref(
            batch.q, kc.float(), vc.float(), batch.block_tables, batch.context_lens, 0.125
        )
        assert (out[1:] - full[1:]).abs().max() > 1e-2


def test_kernels_refuse_a_window_below_one(kernel: DecodeKernel) -> None:
    batch = make_paged_batch(
        [1], [5], num_heads=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32,
        device=torch.device("cpu"),
    )  # fmt: skip
    idx = torch.zeros(1, dtype=torch.int64)
    out = torch.empty_like(batch.q)
    for bad in (0, -3):
        with pytest.raises(ValueError, match="sliding_window"):
            kernel(
                out, batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, idx, idx,
                0.125, sliding_window=bad,
            )  # fmt: skip


@pytest.mark.parametrize("window", [1, 7, 16, 33, 100])
@pytest.mark.parametrize("gqa", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_prefill_kernel_window_matches_reference(
    kernel: DecodeKernel, window: int, gqa: int, head_dim: int
) -> None:
    if not kernel.bf16:
        pytest.skip("no usable AVX512-BF16 here: the prefill kernel does not run")
    torch.manual_seed(10 * window + gqa + head_dim)
    # chunks with and without a cached prefix, one-token ones, a long chunk over a long prefix (tiles)
    query_lens, ctx_lens = [5, 128, 1, 37, 300], [5, 640, 300, 40, 900]
    batch = make_paged_batch(
        query_lens, ctx_lens, num_heads=2 * gqa, num_kv_heads=2, head_dim=head_dim, block_size=16,
        dtype=torch.float32, device=torch.device("cpu"),
    )  # fmt: skip
    kc, vc = batch.k_cache.bfloat16(), batch.v_cache.bfloat16()
    starts = batch.query_start_loc[:-1].long()
    chunks = PrefillChunks(
        seqs=torch.arange(len(query_lens), dtype=torch.int64),
        q_starts=starts.contiguous(),
        q_lens=torch.tensor(query_lens, dtype=torch.int32),
        ctx_lens=torch.tensor(ctx_lens, dtype=torch.int32),
    )
    out = torch.full_like(batch.q, float("nan"))
    scale = head_dim**-0.5
    assert kernel.prefill(out, batch.q, kc, vc, batch.block_tables, chunks, scale, sliding_window=window)
    ref = paged_attention_ref(
        batch.q, kc.float(), vc.float(), batch.block_tables, batch.context_lens, batch.query_start_loc, scale,
        sliding_window=window,
    )  # fmt: skip
    atol, rtol = ATTN_TOL[torch.bfloat16]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    # bf16 rounding of q and P, not a structural error: the typical error is far below the bound
    assert (out - ref).abs().mean() < 2e-3
    full = paged_attention_ref(
        batch.q, kc.float(), vc.float(), batch.block_tables, batch.context_lens, batch.query_start_loc, scale
    )
    assert (full - ref).abs().max() > 0.1  # the window changes the answer: ignoring it fails above


def _backends(kernel: DecodeKernel) -> dict[str, TorchAttentionBackend]:
    return {
        "torch": TorchAttentionBackend(16),
        "cpu": TorchAttentionBackend(16, kernel),
        # the bf16 SDPA groups (chosen where AMX-BF16 is usable), forced so they run on any CPU
        "cpu-amx": TorchAttentionBackend(16, dataclasses.replace(kernel, amx_bf16=True)),
    }


@pytest.mark.parametrize("backend", ["torch", "cpu", "cpu-amx"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backends_interleave_windowed_and_global_layers(
    kernel: DecodeKernel, backend: str, cache_dtype: torch.dtype
) -> None:
    """One step's metadata through layers of different windows, as Gemma 2/3 and gpt-oss interleave them:
    each layer's output matches the reference for its own window (the backend's per-step plan is per
    window). A mixed batch: decodes, whole prompts longer than the window, chunks over cached prefixes."""
    if backend == "cpu-amx" and not (kernel.bf16 and cache_dtype == torch.bfloat16):
        pytest.skip("the bf16 SDPA groups serve a bf16 cache where the prefill kernel would")
    torch.manual_seed(7)
    query_lens, prefix_lens = [1, 40, 1, 24, 24, 9], [70, 0, 20, 50, 50, 100]
    hq, hkv, d = 8, 2, 64
    meta = make_attention_metadata(query_lens, prefix_lens, 16, torch.device("cpu"))
    t = sum(query_lens)
    shape = (int(meta.block_tables.max()) + 2, 16, hkv, d)
    k_cache, v_cache = torch.randn(shape).to(cache_dtype), torch.randn(shape).to(cache_dtype)
    be = _backends(kernel)[backend]
    for layer, window in enumerate([None, 16, 5, None, 33, 16]):
        q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
        kc, vc = k_cache.clone(), v_cache.clone()
        out = be.forward(q, k, v, kc, vc, meta, d**-0.5, sliding_window=window)
        rk, rv = k_cache.clone(), v_cache.clone()
        store_kv_cache_ref(k, v, rk, rv, meta.slot_mapping)
        ref = paged_attention_ref(
            q, rk.float(), rv.float(), meta.block_tables, meta.context_lens, meta.query_start_loc, d**-0.5,
            sliding_window=window,
        )  # fmt: skip
        atol, rtol = ATTN_TOL[torch.bfloat16 if cache_dtype == torch.bfloat16 else torch.float32]
        torch.testing.assert_close(
            out.float(), ref, atol=atol, rtol=rtol, msg=f"layer {layer} window {window}"
        )


def test_backend_refuses_a_bad_window(kernel: DecodeKernel) -> None:
    meta = make_attention_metadata([3], [0], 16, torch.device("cpu"))
    shape = (4, 16, 2, 64)
    q, k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    for be in (TorchAttentionBackend(16), TorchAttentionBackend(16, kernel)):
        with pytest.raises(ValueError, match="sliding_window"):
            be.forward(q, k, v, torch.zeros(shape), torch.zeros(shape), meta, 0.125, sliding_window=0)
