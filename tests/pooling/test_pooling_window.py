"""Decoder embedders with sliding windows (server/pooling/decoder.py): a tiny random Mistral (every layer
windowed) and an interleaved Qwen2, hidden states of every real token against transformers (eager),
right- and left-padded rows several windows long."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from window_models import WINDOW, build_window_model

from server.models.loader import load_model
from server.pooling.decoder import DecoderEncoder


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gemma2"])
def test_windowed_decoder_embedder_matches_transformers(
    arch: str, side: str, tmp_path: Path, smollm2_dir: Path
) -> None:
    from transformers import AutoModel

    folder = build_window_model(tmp_path / arch, smollm2_dir, arch)
    loaded = load_model(folder, torch.float32, torch.device("cpu"), max_positions=256, embedding_only=True)
    ours = DecoderEncoder(loaded.model).eval()
    hf: Any = AutoModel.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(11)
    lengths = [4 * WINDOW, 3 * WINDOW + 5, 10]
    s = max(lengths)
    ids = torch.zeros(len(lengths), s, dtype=torch.int64)
    mask = torch.zeros(len(lengths), s, dtype=torch.int64)
    for i, n in enumerate(lengths):
        cols = slice(0, n) if side == "right" else slice(s - n, s)
        ids[i, cols] = torch.randint(3, 49152, (n,), generator=g)
        mask[i, cols] = 1
    with torch.no_grad():
        got = ours(ids, torch.zeros_like(ids), mask)
        for i in range(len(lengths)):  # one row at a time, unpadded: the reference's own positions
            real = mask[i].bool()
            ref = hf(ids[i : i + 1, real]).last_hidden_state[0]
            torch.testing.assert_close(got[i, real], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("window", [None, 3])
def test_dense_batch_attention_sinks_and_soft_cap(softcap: float, window: int | None) -> None:
    """The embedding encoder's attention with gpt-oss's sinks and Gemma 2's soft-cap, against the
    backend contract's formula per query (out = sum_j e^s_j v_j / (sum_j e^s_j + e^sink), s the capped
    scaled scores of the keys the query sees), over left- and right-padded rows, GQA 4:2."""
    from server.pooling.dense_attention import DenseBatchAttention

    g = torch.Generator().manual_seed(5)
    real = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    positions = (real.long().cumsum(1) - 1).clamp(min=0)
    t, hq, hkv, d, scale = int(real.sum()), 4, 2, 8, 0.4
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, generator=g)
    attn = DenseBatchAttention(real, positions, bidirectional=False)
    empty = torch.zeros(0)
    got = attn.forward(
        q, k, v, empty, empty, None, scale, sliding_window=window, sinks=sinks, softcap=softcap
    )  # type: ignore[arg-type]
    want = torch.empty_like(got)
    rows = real.reshape(-1).nonzero().squeeze(1) // real.shape[1]  # each token's batch row
    for i in range(t):
        keys = [j for j in range(t) if rows[j] == rows[i] and j <= i and (window is None or i - j < window)]
        for h in range(hq):
            s = (k[keys, h // 2] @ q[i, h]) * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            w = torch.exp(s - torch.maximum(s.max(), sinks[h]))
            want[i, h] = (w[:, None] * v[keys, h // 2]).sum(0) / (
                w.sum() + torch.exp(sinks[h] - torch.maximum(s.max(), sinks[h]))
            )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="softcap"):
        attn.forward(q, k, v, empty, empty, None, scale, softcap=-1.0)  # type: ignore[arg-type]
