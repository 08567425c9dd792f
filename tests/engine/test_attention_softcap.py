"""Gemma 2's attention logit soft-cap (scores cap * tanh(s / cap) before the mask and softmax) in the CPU
attention paths: the compiled decode and prefill kernels and the torch/cpu backends (torch decode path,
SDPA-free prefill groups with and without a cached prefix, the AMX configuration), alone, with sliding
windows, with GQA, against the fp32 reference (kubeinfer_kernels.reference, transformers' eager Gemma 2
attention). Before the backends took `softcap`, soft-capped layers ran a per-sequence torch loop."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from kubeinfer_kernels.reference import paged_attention_decode_ref, paged_attention_ref, store_kv_cache_ref
from paged_batch import ATTN_TOL, make_attention_metadata, make_paged_batch

from server.attention.cpu_kernel import DecodeKernel, PrefillChunks, load_decode_kernel
from server.attention.torch_backend import TorchAttentionBackend

CAP = 1.5  # well inside the scores' range below: the cap bends most of them
Q_SCALE = 3.0  # q scaled up so scores reach several times the cap


@pytest.fixture(scope="module")
def kernel() -> DecodeKernel:
    return load_decode_kernel()


@pytest.mark.parametrize("window", [None, 7, 33])
@pytest.mark.parametrize(
    "cache_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
@pytest.mark.parametrize("gqa", [1, 4])
def test_decode_kernel_softcap_matches_reference(
    kernel: DecodeKernel, window: int | None, cache_dtype: torch.dtype, gqa: int
) -> None:
    torch.manual_seed(gqa + (window or 0))
    ctx = [1, 45, 100, 1200]  # 1200: the kernel cuts it into parts, merged after the cap
    batch = make_paged_batch(
        [1] * len(ctx), ctx, num_heads=2 * gqa, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, device=torch.device("cpu"), q_scale=Q_SCALE,
    )  # fmt: skip
    kc, vc = batch.k_cache.to(cache_dtype), batch.v_cache.to(cache_dtype)
    out = torch.full_like(batch.q, float("nan"))
    idx = torch.arange(len(ctx), dtype=torch.int64)
    kernel(
        out, batch.q, kc, vc, batch.block_tables, batch.context_lens, idx, idx, 0.125,
        sliding_window=window, softcap=CAP,
    )  # fmt: skip
    args = (batch.q, kc.float(), vc.float(), batch.block_tables, batch.context_lens, 0.125, window)
    ref = paged_attention_decode_ref(*args, softcap=CAP)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert (paged_attention_decode_ref(*args) - ref).abs().max() > 0.2  # ignoring the cap fails above


@pytest.mark.parametrize("window", [None, 16, 100])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_prefill_kernel_softcap_matches_reference(
    kernel: DecodeKernel, window: int | None, head_dim: int
) -> None:
    if not kernel.bf16:
        pytest.skip("no usable AVX512-BF16 here: the prefill kernel does not run")
    torch.manual_seed(head_dim + (window or 0))
    query_lens, ctx_lens = [5, 128, 1, 37, 300], [5, 640, 300, 40, 900]
    batch = make_paged_batch(
        query_lens, ctx_lens, num_heads=6, num_kv_heads=2, head_dim=head_dim, block_size=16,
        dtype=torch.float32, device=torch.device("cpu"), q_scale=Q_SCALE,
    )  # fmt: skip
    kc, vc = batch.k_cache.bfloat16(), batch.v_cache.bfloat16()
    chunks = PrefillChunks(
        seqs=torch.arange(len(query_lens), dtype=torch.int64),
        q_starts=batch.query_start_loc[:-1].long().contiguous(),
        q_lens=torch.tensor(query_lens, dtype=torch.int32),
        ctx_lens=torch.tensor(ctx_lens, dtype=torch.int32),
    )
    out = torch.full_like(batch.q, float("nan"))
    scale = head_dim**-0.5
    assert kernel.prefill(
        out, batch.q, kc, vc, batch.block_tables, chunks, scale, sliding_window=window, softcap=CAP
    )
    args = (
        batch.q, kc.float(), vc.float(), batch.block_tables, batch.context_lens, batch.query_start_loc,
        scale, window,
    )  # fmt: skip
    ref = paged_attention_ref(*args, softcap=CAP)
    atol, rtol = ATTN_TOL[torch.bfloat16]  # q * scale and the probabilities in bf16
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    assert (out - ref).abs().mean() < 2e-3
    assert (paged_attention_ref(*args) - ref).abs().max() > 0.2


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True, "2"])
def test_kernel_and_backends_refuse_bad_softcaps(kernel: DecodeKernel, bad: object) -> None:
    batch = make_paged_batch(
        [1], [5], num_heads=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32,
        device=torch.device("cpu"),
    )  # fmt: skip
    idx = torch.zeros(1, dtype=torch.int64)
    out = torch.empty_like(batch.q)
    with pytest.raises(ValueError, match="softcap"):
        kernel(
            out, batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, idx, idx,
            0.125, softcap=bad,  # type: ignore[arg-type]
        )  # fmt: skip
    meta = make_attention_metadata([1, 6], [4, 0], 16, torch.device("cpu"))
    q, kv = torch.randn(7, 2, 64), torch.randn(7, 2, 64)
    shape = (int(meta.block_tables.max()) + 2, 16, 2, 64)
    for be in (TorchAttentionBackend(16), TorchAttentionBackend(16, kernel)):
        with pytest.raises(ValueError, match="softcap"):
            be.forward(q, kv, kv, torch.zeros(shape), torch.zeros(shape), meta, 0.125, softcap=bad)  # type: ignore[arg-type]


def _sinks(num_heads: int) -> torch.Tensor:
    s = torch.randn(num_heads) * 2
    s[0] = 40.0  # far above every (capped) score: the output goes to ~0
    return s


@pytest.mark.parametrize("backend", ["torch", "cpu", "cpu-amx"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 48])  # 48: no compiled prefill, the torch groups serve the chunks
def test_backends_softcap_with_and_without_windows(
    kernel: DecodeKernel, backend: str, cache_dtype: torch.dtype, head_dim: int
) -> None:
    """Gemma 2's pattern (windowed and global layers, each soft-capped) through one step's metadata: a
    mixed batch of decodes, whole prompts longer than the window, chunks over cached prefixes, GQA;
    plus an uncapped layer on the same metadata (its own plan) and a capped one with sinks."""
    if backend == "cpu-amx" and not (kernel.bf16 and cache_dtype == torch.bfloat16 and head_dim == 64):
        pytest.skip("the AMX configuration differs only where the compiled prefill kernel runs")
    torch.manual_seed(11 + head_dim)
    query_lens, prefix_lens = [1, 40, 1, 24, 24, 9, 300], [70, 0, 20, 50, 50, 100, 0]
    hq, hkv, d = 8, 2, head_dim
    meta = make_attention_metadata(query_lens, prefix_lens, 16, torch.device("cpu"))
    t = sum(query_lens)
    shape = (int(meta.block_tables.max()) + 2, 16, hkv, d)
    k_cache, v_cache = torch.randn(shape).to(cache_dtype), torch.randn(shape).to(cache_dtype)
    be = {
        "torch": TorchAttentionBackend(16),
        "cpu": TorchAttentionBackend(16, kernel),
        "cpu-amx": TorchAttentionBackend(16, dataclasses.replace(kernel, amx_bf16=True)),
    }[backend]
    layers: list[tuple[int | None, float, bool]] = [(16, CAP, False), (None, CAP, False), (5, CAP, False)]
    layers += [(None, 0.0, False), (16, CAP, True)]
    for layer, (window, cap, with_sinks) in enumerate(layers):
        sinks = _sinks(hq) if with_sinks else None
        q, k, v = torch.randn(t, hq, d) * Q_SCALE, torch.randn(t, hkv, d), torch.randn(t, hkv, d)
        kc, vc = k_cache.clone(), v_cache.clone()
        out = be.forward(q, k, v, kc, vc, meta, d**-0.5, sliding_window=window, sinks=sinks, softcap=cap)
        rk, rv = k_cache.clone(), v_cache.clone()
        store_kv_cache_ref(k, v, rk, rv, meta.slot_mapping)
        ref_args = (q, rk.float(), rv.float(), meta.block_tables, meta.context_lens, meta.query_start_loc)
        ref = paged_attention_ref(*ref_args, d**-0.5, window, sinks, cap)
        atol, rtol = ATTN_TOL[torch.bfloat16 if cache_dtype == torch.bfloat16 else torch.float32]
        msg = f"layer {layer} window {window} cap {cap}"
        torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol, msg=msg)
        if cap:  # the cap changes every row kind well beyond the tolerance
            uncapped = paged_attention_ref(*ref_args, d**-0.5, window, sinks)
            for s0, s1 in zip(
                meta.query_start_loc[:-1].tolist(), meta.query_start_loc[1:].tolist(), strict=True
            ):
                assert (uncapped[s0:s1] - ref[s0:s1]).abs().max() > 0.1, msg


@pytest.mark.parametrize("window", [None, 9])
def test_capped_groups_tile_their_rows(monkeypatch: pytest.MonkeyPatch, window: int | None) -> None:
    """Prompt chunks longer than `_CAPPED_ROWS` are attended in row tiles, each over the keys its rows see
    (causal, window): the same as one tile over every key, and as the reference."""
    import server.attention.torch_backend as tb

    torch.manual_seed(3)
    meta = make_attention_metadata([70, 1, 40], [30, 9, 0], 16, torch.device("cpu"))
    shape = (int(meta.block_tables.max()) + 2, 16, 2, 32)
    q, k, v = torch.randn(111, 4, 32) * Q_SCALE, torch.randn(111, 2, 32), torch.randn(111, 2, 32)
    outs = []
    for rows in (256, 16):
        monkeypatch.setattr(tb, "_CAPPED_ROWS", rows)
        kc, vc = torch.zeros(shape), torch.zeros(shape)
        be = TorchAttentionBackend(16)
        outs.append(be.forward(q, k, v, kc, vc, meta, 32**-0.5, sliding_window=window, softcap=CAP))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-6)
    ref = paged_attention_ref(
        q, kc, vc, meta.block_tables, meta.context_lens, meta.query_start_loc, 32**-0.5, window, softcap=CAP
    )
    torch.testing.assert_close(outs[1], ref, atol=2e-5, rtol=2e-5)
    assert math.isfinite(float(outs[1].abs().max()))
