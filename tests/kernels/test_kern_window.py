"""Sliding windows in the Triton kernels (decode single-pass and split-K, varlen prefill) and the Triton
backend, against the torch reference (the query at position p sees keys p - W + 1 .. p)."""

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


@pytest.mark.parametrize("window", [1, 7, 20, 45])
@pytest.mark.parametrize("partition_size", [512, 16], ids=["single-pass", "split-k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_window_matches_reference(
    window: int, partition_size: int, dtype: torch.dtype, device: torch.device
) -> None:
    # split-K with 16-token partitions: whole partitions before the window, one cut by its edge
    ctx = [1, 30, 77, 45]
    batch = make_paged_batch(
        [1] * len(ctx), ctx, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype,
        device=device,
    )  # fmt: skip
    out = paged_attention_decode(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125,
        max_context_len=batch.max_context_len, partition_size=partition_size, sliding_window=window,
    )  # fmt: skip
    ref = paged_attention_decode_ref(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.context_lens,
        0.125,
        sliding_window=window,
    )
    atol, rtol = ATTN_TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    full = paged_attention_decode_ref(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125
    )
    assert (full[2].float() - ref[2].float()).abs().max() > 0.05  # 77 tokens: every window here cuts it


@pytest.mark.parametrize("window", [1, 7, 20, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_window_matches_reference(window: int, dtype: torch.dtype, device: torch.device) -> None:
    # a whole prompt of 3 query tiles, a chunk over a cached prefix, a 1-token chunk, a short prompt
    query_lens, ctx_lens = [150, 37, 1, 5], [150, 100, 60, 5]
    batch = make_paged_batch(
        query_lens, ctx_lens, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype,
        device=device,
    )  # fmt: skip
    out = paged_prefill_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, batch.query_start_loc,
        0.125, max_query_len=batch.max_query_len, sliding_window=window,
    )  # fmt: skip
    ref = paged_attention_ref(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, batch.query_start_loc,
        0.125, sliding_window=window,
    )  # fmt: skip
    atol, rtol = ATTN_TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def test_launchers_refuse_a_bad_window(device: torch.device) -> None:
    batch = make_paged_batch(
        [1], [5], num_heads=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, device=device
    )
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window"):
            paged_attention_decode(
                batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125,
                max_context_len=5, sliding_window=bad,  # type: ignore[arg-type]
            )  # fmt: skip
        with pytest.raises(ValueError, match="sliding_window"):
            paged_prefill_attention(
                batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens,
                batch.query_start_loc, 0.125, max_query_len=1, sliding_window=bad,  # type: ignore[arg-type]
            )  # fmt: skip


def test_triton_backend_interleaves_windowed_and_global_layers(device: torch.device) -> None:
    """One step's metadata through layers of different windows (Gemma 2/3's pattern), decode and mixed."""
    for query_lens, prefix_lens in (([1, 1, 1], [0, 40, 70]), ([1, 30, 9, 1], [50, 0, 40, 20])):
        meta = make_attention_metadata(query_lens, prefix_lens, 16, device)
        t = sum(query_lens)
        shape = (int(meta.block_tables.max()) + 2, 16, 2, 64)
        k_cache, v_cache = torch.randn(shape, device=device), torch.randn(shape, device=device)
        backend = TritonAttentionBackend(decode_partition_size=16)
        for window in (None, 16, 5, None, 33):
            q = torch.randn(t, 8, 64, device=device)
            k, v = torch.randn(t, 2, 64, device=device), torch.randn(t, 2, 64, device=device)
            kc, vc = k_cache.clone(), v_cache.clone()
            out = backend.forward(q, k, v, kc, vc, meta, 0.125, sliding_window=window)
            rk, rv = k_cache.clone(), v_cache.clone()
            store_kv_cache_ref(k, v, rk, rv, meta.slot_mapping)
            ref = paged_attention_ref(
                q,
                rk,
                rv,
                meta.block_tables,
                meta.context_lens,
                meta.query_start_loc,
                0.125,
                sliding_window=window,
            )
            atol, rtol = ATTN_TOL[torch.float32]
            torch.testing.assert_close(out, ref, atol=atol, rtol=rtol, msg=f"window {window}")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gemma3"])
def test_engine_on_triton_matches_transformers_past_the_window(
    arch: str, tmp_path: Path, smollm2_dir: Path, device: torch.device
) -> None:
    """A tiny sliding-window model (window 16) through the engine on the Triton backend, chunked prefill
    (a 12-token budget) over prompts ~3 windows long: transformers' greedy tokens (eager attention). Qwen2's
    and Gemma 3's windowed layers read their own KV group of 8 blocks, too few for both seats' windows."""
    from transformers import AutoModelForCausalLM

    folder = build_window_model(tmp_path / arch, smollm2_dir, arch)
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
            cache=CacheConfig(block_size=8, num_kv_blocks=48),
            max_num_batched_tokens=12,
            long_prefill_token_threshold=12,
            attention_backend="triton",
            max_num_seqs=2,
        )
    )
    assert engine.backend_name == "triton"
    windows = [layer.self_attn.sliding_window for layer in engine.loaded.model.decoder_layers()]
    if None in windows:  # server/core/kv_groups.py: 48 x 3 layer blocks leave the global layer short of
        # one 1024-token sequence (128 blocks) beside two seats' windows (2 x 5 blocks), so the windowed
        # group gives back down to 8, between one seat's window and chunk (6) and both seats' (10)
        sizes = [k.shape[0] for k, _ in engine.runner.kv_caches]
        assert sizes == [48 * 3 - 2 * 8 if w is None else 8 for w in windows]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert run_staggered(engine, prompts, params) == ref
