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
@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
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
