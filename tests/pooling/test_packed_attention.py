"""A decoder embedder's attention row by row over the packed real tokens (server/pooling/packed_attention.py):
the per-row SDPA in fp32 and the compiled bf16 prefill kernel, against the attention formula per query
(causal or bidirectional, windows, gpt-oss's sinks, Gemma 2's soft-cap) over left- and right-padded rows
and an empty one, GQA 4:2; and the auto embedder that takes the kernel, against sentence-transformers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from server.attention.cpu_kernel import DecodeKernel, KernelBuildError, load_decode_kernel
from server.pooling.packed_attention import PackedRowsAttention

# left padding, right padding, no real token, one token, a row longer than a 16-token block
REAL = [[0] * 3 + [1] * 17, [1] * 9 + [0] * 11, [0] * 20, [1] + [0] * 19, [1] * 20]
HQ, HKV = 4, 2


def _kernel() -> DecodeKernel:
    try:
        kernel = load_decode_kernel()
    except KernelBuildError as e:
        pytest.skip(f"no CPU attention kernel here: {e}")
    if not kernel.prefill_supported(torch.float32, torch.bfloat16, 64):
        pytest.skip("the prefill kernel needs AVX512-BF16")
    return kernel


class _Counting:
    """A DecodeKernel that counts the prefill calls that ran (returned True)."""

    def __init__(self, kernel: DecodeKernel) -> None:
        self.kernel, self.calls = kernel, 0

    def prefill_supported(self, *args: Any) -> bool:
        return self.kernel.prefill_supported(*args)

    def store_kv(self, *args: Any, **kw: Any) -> None:
        self.kernel.store_kv(*args, **kw)

    def prefill(self, *args: Any, **kw: Any) -> bool:
        done = self.kernel.prefill(*args, **kw)
        self.calls += int(done)
        return done


def _reference(
    q: Tensor,  # [T, Hq, D] fp32
    k: Tensor,  # [T, Hkv, D]
    v: Tensor,  # [T, Hkv, D]
    row: list[int],  # [T] each token's row
    pos: list[int],  # [T] each token's position in its row
    scale: float,
    bidirectional: bool,
    window: int | None,
    sinks: Tensor | None,  # [Hq]
    softcap: float,
) -> Tensor:  # [T, Hq, D] fp32
    """out = sum_j e^s_j v_j / (sum_j e^s_j + e^sink), s the (capped) scaled scores of the keys the query
    sees: its row's, earlier ones only when causal, |p - key| < W (bidirectional) or p - key < W."""
    t, g = q.shape[0], HQ // HKV
    out = torch.empty_like(q)
    for i in range(t):
        keys = [
            j
            for j in range(t)
            if row[j] == row[i]
            and (bidirectional or pos[j] <= pos[i])
            and (window is None or abs(pos[i] - pos[j]) < window)
        ]
        for h in range(HQ):
            s = (k[keys, h // g].double() @ q[i, h].double()) * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            top = s.max() if sinks is None else torch.maximum(s.max(), sinks[h].double())
            w = torch.exp(s - top)
            den = w.sum() + (0.0 if sinks is None else torch.exp(sinks[h].double() - top))
            out[i, h] = ((w[:, None] * v[keys, h // g].double()).sum(0) / den).float()
    return out


def _batch(d: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    real = torch.tensor(REAL, dtype=torch.bool)
    positions = (real.long().cumsum(1) - 1).clamp(min=0)
    t = int(real.sum())
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (HQ, HKV, HKV))
    flat = real.reshape(-1).nonzero().squeeze(1)
    row = (flat // real.shape[1]).tolist()
    pos = positions.reshape(-1)[flat].tolist()
    return real, positions, q, k, v, row, pos


@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("window", [None, 5, 64])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_per_row_attention_matches_the_formula(
    bidirectional: bool, window: int | None, sinks: bool, softcap: float
) -> None:
    """fp32 (no kernel): one SDPA per row where the window does not reach inside a row and there are no
    sinks or cap, the dense masked pass otherwise; equal to the formula to fp32 rounding either way."""
    real, positions, q, k, v, row, pos = _batch(16)
    sink = torch.randn(HQ, generator=torch.Generator().manual_seed(9)) if sinks else None
    attn = PackedRowsAttention(real, positions, bidirectional)
    empty = torch.zeros(0)
    got = attn.forward(q, k, v, empty, empty, None, 0.3, None, window, sink, softcap)  # type: ignore[arg-type]
    want = _reference(q, k, v, row, pos, 0.3, bidirectional, window, sink, softcap)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the dense pass only where the rows cannot be attended one by one
    assert (attn._dense is not None) == (window == 5 or sinks or bool(softcap))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernel_attention_matches_the_formula_in_bf16_products(
    head_dim: int, window: int | None, sinks: bool, softcap: float, dtype: torch.dtype
) -> None:
    """With the kernel every causal layer is one prefill call over the rows' K/V in 16-token blocks: the
    formula over bf16-rounded q * scale, K and V to within the kernel's bf16 probabilities."""
    kernel = _Counting(_kernel())
    real, positions, q, k, v, row, pos = _batch(head_dim, seed=1)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    sink = torch.randn(HQ, generator=torch.Generator().manual_seed(9)) if sinks else None
    scale = head_dim**-0.5
    attn = PackedRowsAttention(real, positions, False, kernel)  # type: ignore[arg-type]
    empty = torch.zeros(0)
    got = attn.forward(q, k, v, empty, empty, None, scale, None, window, sink, softcap)  # type: ignore[arg-type]
    assert kernel.calls == 1 and attn._dense is None and got.dtype == dtype
    qb = (q.float() * scale).to(torch.bfloat16).float() / scale
    kb, vb = k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()
    want = _reference(qb, kb, vb, row, pos, scale, False, window, sink, softcap)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_kernel_refused_operands_fall_back() -> None:
    """A head_dim the kernel has no path for (16): the rows go through the per-row SDPA instead."""
    kernel = _Counting(_kernel())
    real, positions, q, k, v, row, pos = _batch(16)
    attn = PackedRowsAttention(real, positions, False, kernel)  # type: ignore[arg-type]
    empty = torch.zeros(0)
    got = attn.forward(q, k, v, empty, empty, None, 0.3)  # type: ignore[arg-type]
    assert kernel.calls == 0
    torch.testing.assert_close(got, _reference(q, k, v, row, pos, 0.3, False, None, None, 0.0))


def test_auto_embedder_attends_with_the_kernel(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`--dtype auto` on a CPU with native bf16, a Qwen3 embedder of head_dim 64: every layer's attention is
    one prefill-kernel call (the padded masked SDPA took 27% of a Qwen3-Embedding-0.6B step), its vectors
    within cosine 0.9999 of sentence-transformers' fp32 over left- and right-padded batches; `--dtype
    float32` keeps fp32 attention (no kernel)."""
    from embedding_models import build_qwen3_embedding
    from sentence_transformers import SentenceTransformer

    from server.models.loader import cpu_has_native_bf16
    from server.pooling.model import load_pooling_model, pooling_dtypes
    from server.pooling.pooler import finish_embedding

    if not cpu_has_native_bf16():
        pytest.skip("auto keeps fp32 GEMMs and attention without native bf16")
    _kernel()
    folder = build_qwen3_embedding(
        tiny_model_factory("qwen3", tie=True, head_dim=64), tmp_path_factory.mktemp("qwen3-embed-d64")
    )
    m = load_pooling_model(folder, **pooling_dtypes("auto"))
    assert m.module.attention_kernel is not None
    counting = _Counting(m.module.attention_kernel)
    m.module.attention_kernel = counting
    assert load_pooling_model(folder, **pooling_dtypes("float32")).module.attention_kernel is None
    texts = [
        "a kubernetes pod serves the embedding model",
        "short",
        "the node's cache holds every layer's keys and values for the longest of these texts",
    ]
    ref = SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_tensor=True)
    layers = len(m.module.model.model.layers)
    for side in ("left", "right"):
        m.tokenizer.padding_side = side
        enc = m.tokenizer(texts, padding=True, return_tensors="pt")
        args = (enc["input_ids"], torch.zeros_like(enc["input_ids"]), enc["attention_mask"])
        before = counting.calls
        ours = finish_embedding(m.forward(*args), True, None)
        assert counting.calls - before == layers
        cos = F.cosine_similarity(ours, ref.float())
        assert cos.min().item() >= 0.9999, (side, cos)


def test_a_batch_without_real_tokens_attends_nothing() -> None:
    """Every row padding: no chunk reaches the kernel (its work split divided by the chunk count and killed
    the process with SIGFPE), the rows' result is empty, as the per-row path's."""
    kernel = _Counting(_kernel())
    real = torch.zeros(2, 5, dtype=torch.bool)
    positions = torch.zeros(2, 5, dtype=torch.long)
    q, k, v = torch.randn(0, HQ, 64), torch.randn(0, HKV, 64), torch.randn(0, HKV, 64)
    empty = torch.zeros(0)
    for backend in (kernel, None):
        attn = PackedRowsAttention(real, positions, False, backend)  # type: ignore[arg-type]
        got = attn.forward(q, k, v, empty, empty, None, 0.125)  # type: ignore[arg-type]
        assert got.shape == (0, HQ, 64)
    assert kernel.calls == 1  # the launcher took the empty step and wrote nothing
