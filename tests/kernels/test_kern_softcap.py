"""Gemma 2's attention logit soft-cap (scores cap * tanh(s / cap) before the mask and softmax) in the Triton
kernels (decode single-pass and split-K, varlen prefill with and without a cached prefix) and the Triton
backend, alone, with a sliding window and with GQA, against the torch reference (transformers' eager
Gemma 2 attention)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_driver import run_staggered
from kubeinfer_kernels import paged_attention_decode, paged_prefill_attention
from kubeinfer_kernels.reference import paged_attention_decode_ref, paged_attention_ref, store_kv_cache_ref
from paged_batch import ATTN_TOL, make_attention_metadata, make_paged_batch
from window_models import WINDOW, build_window_model

from server.attention.triton_backend import TritonAttentionBackend
from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.request import SamplingParams

CAP = 1.5
Q_SCALE = 3.0  # scores reach several times the cap


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("partition_size", [512, 16], ids=["single-pass", "split-k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_softcap_matches_reference(
    window: int | None, partition_size: int, dtype: torch.dtype, device: torch.device
) -> None:
    ctx = [1, 30, 77, 45]
    batch = make_paged_batch(
        [1] * len(ctx), ctx, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype,
        device=device, q_scale=Q_SCALE,
    )  # fmt: skip
    out = paged_attention_decode(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125,
        max_context_len=batch.max_context_len, partition_size=partition_size, sliding_window=window,
        softcap=CAP,
    )  # fmt: skip
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125, window)
    ref = paged_attention_decode_ref(*args, softcap=CAP)
    atol, rtol = ATTN_TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    # the cap changes the answer well beyond the tolerance: a kernel ignoring it fails above
    assert (paged_attention_decode_ref(*args).float() - ref.float()).abs().max() > 0.2


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_softcap_matches_reference(
    window: int | None, dtype: torch.dtype, device: torch.device
) -> None:
    # a whole prompt of 3 query tiles, a chunk over a cached prefix, a 1-token chunk, a short prompt
    query_lens, ctx_lens = [150, 37, 1, 5], [150, 100, 60, 5]
    batch = make_paged_batch(
        query_lens, ctx_lens, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype,
        device=device, q_scale=Q_SCALE,
    )  # fmt: skip
    out = paged_prefill_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, batch.query_start_loc,
        0.125, max_query_len=batch.max_query_len, sliding_window=window, softcap=CAP,
    )  # fmt: skip
    args = (
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, batch.query_start_loc,
        0.125, window,
    )  # fmt: skip
    ref = paged_attention_ref(*args, softcap=CAP)
    atol, rtol = ATTN_TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    assert (paged_attention_ref(*args).float() - ref.float()).abs().max() > 0.2


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf"), True])
def test_launchers_refuse_bad_softcaps(device: torch.device, bad: float) -> None:
    batch = make_paged_batch(
        [1], [5], num_heads=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, device=device
    )
    with pytest.raises(ValueError, match="softcap"):
        paged_attention_decode(
            batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125,
            max_context_len=5, softcap=bad,
        )  # fmt: skip
    with pytest.raises(ValueError, match="softcap"):
        paged_prefill_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens,
            batch.query_start_loc, 0.125, max_query_len=1, softcap=bad,
        )  # fmt: skip


def test_triton_backend_softcap_with_and_without_windows(device: torch.device) -> None:
    """Gemma 2's layers alternate a window and global attention, both soft-capped: one step's metadata
    through both, decode-only and mixed batches."""
    for query_lens, prefix_lens in (([1, 1, 1], [0, 40, 70]), ([1, 30, 9, 1], [50, 0, 40, 20])):
        meta = make_attention_metadata(query_lens, prefix_lens, 16, device)
        t = sum(query_lens)
        shape = (int(meta.block_tables.max()) + 2, 16, 2, 64)
        k_cache, v_cache = torch.randn(shape, device=device), torch.randn(shape, device=device)
        backend = TritonAttentionBackend(decode_partition_size=16)
        for window in (16, None):
            q = torch.randn(t, 8, 64, device=device) * Q_SCALE
            k, v = torch.randn(t, 2, 64, device=device), torch.randn(t, 2, 64, device=device)
            kc, vc = k_cache.clone(), v_cache.clone()
            out = backend.forward(q, k, v, kc, vc, meta, 0.125, sliding_window=window, softcap=CAP)
            rk, rv = k_cache.clone(), v_cache.clone()
            store_kv_cache_ref(k, v, rk, rv, meta.slot_mapping)
            ref = paged_attention_ref(
                q, rk, rv, meta.block_tables, meta.context_lens, meta.query_start_loc, 0.125,
                sliding_window=window, softcap=CAP,
            )  # fmt: skip
            atol, rtol = ATTN_TOL[torch.float32]
            torch.testing.assert_close(out, ref, atol=atol, rtol=rtol, msg=f"window {window}")


@pytest.mark.slow
def test_gemma2_on_triton_matches_transformers(
    tmp_path: Path, smollm2_dir: Path, device: torch.device
) -> None:
    """A tiny Gemma 2 (soft-capped scores, window 16 on layers 0 and 2) through the engine on the Triton
    backend, chunked prefill (a 12-token budget) over prompts ~3 windows long, then the same prompts again
    from the prefix cache: transformers' greedy tokens (eager attention), and the soft-cap reached every
    kernel call."""
    from transformers import AutoModelForCausalLM

    folder = build_window_model(tmp_path / "gemma2", smollm2_dir, "gemma2")
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (3 * WINDOW + 5, 2 * WINDOW + 9)]
    hf: Any = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager"
    )
    with torch.inference_mode():
        ref = [
            hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(folder), dtype="float32"),
            cache=CacheConfig(block_size=8, num_kv_blocks=96, enable_prefix_caching=True),
            max_num_batched_tokens=12,
            long_prefill_token_threshold=12,
            attention_backend="triton",
            max_num_seqs=2,
        )
    )
    assert engine.backend_name == "triton"
    caps: list[float] = []
    forward = engine.runner.backend.forward

    def spy(*args: Any, **kwargs: Any) -> Any:
        caps.append(kwargs.get("softcap", 0.0))
        return forward(*args, **kwargs)

    engine.runner.backend.forward = spy  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert run_staggered(engine, prompts, params) == ref
    hits = engine.stats().prefix_cache_hits
    assert [engine.generate([p], params)[0] for p in prompts] == ref
    assert engine.stats().prefix_cache_hits > hits
    assert caps and set(caps) == {2.0}
