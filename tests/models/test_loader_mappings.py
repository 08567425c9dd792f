"""What a loaded model keeps of its checkpoint files' mappings (server/models/loader.py): safetensors'
tensors are views of the file, mapped whole, so one embedding or norm weight left there keeps its shard
mapped and every page read while loading resident (a Qwen3-4B bf16 folder read 16.5 GiB resident for 8.6
GiB of weights, 2026-12-07). Embeddings, norms and other small tensors are copied out; a linear layer's
weight used as it is stays the file's (its only copy)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from server.models.loader import load_model

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")


def _mapped_spans(folder: Path) -> list[tuple[int, int]]:
    spans = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].startswith(str(folder)) and parts[5].endswith(".safetensors"):
                a, b = parts[0].split("-")
                spans.append((int(a, 16), int(b, 16)))
    return spans


def _in(t: torch.Tensor, spans: list[tuple[int, int]]) -> bool:
    return any(a <= t.data_ptr() < b for a, b in spans)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_only_linear_weights_stay_in_the_checkpoint_files(
    tiny_model_factory: Callable[..., Path], tie: bool
) -> None:
    folder = tiny_model_factory("llama", tie=tie)
    loaded = load_model(folder, torch.float32, torch.device("cpu"), 64)  # fp32 folder, fp32: no conversion
    model = loaded.model
    spans = _mapped_spans(folder)
    assert spans, "the linear layers' weights are used in place: their files stay mapped"
    embedding = model.model.embed_tokens.weight
    assert not _in(embedding, spans)
    assert (model.lm_head.weight is embedding) == tie  # still tied after the copy
    norms = [m.weight for m in model.modules() if "Norm" in type(m).__name__ and m.weight is not None]
    assert norms and not any(_in(w, spans) for w in norms)
    heads = {id(embedding)}
    linear = [m.weight for m in model.modules() if isinstance(m, nn.Linear) and id(m.weight) not in heads]
    assert linear and all(_in(w, spans) for w in linear)
