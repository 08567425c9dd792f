"""benchmarks/real_shape_models.py (issue 49 item 1): the shapes are the public models' (parameter counts
of their checkpoints), and a made folder loads into our model with greedy decoding that only emits ids
the tokenizer has."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch


def _maker() -> Any:
    name = "kubeinfer_benchmarks_real_shape_models"
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "real_shape_models.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("llama-3.2-1b", 1_235_814_400),  # meta-llama/Llama-3.2-1B's safetensors (tied embedding)
        ("qwen3-4b", 4_022_468_096),  # Qwen/Qwen3-4B's safetensors (tied embedding)
        ("qwen3-moe-2b", None),  # ours: 16 of Qwen3-30B-A3B's 48 layers, 16 of its 128 experts
    ],
)
def test_real_shapes_have_the_public_models_sizes(name: str, params: int | None) -> None:
    m = _maker()
    total = sum(int(torch.Size(shape).numel()) for _, shape in m.tensor_shapes(m.SHAPES[name]))
    if params is not None:
        assert total == params
    else:
        assert 2.0e9 < total <= 3.0e9  # issue 49: a MoE of at most 3B total parameters


def test_a_made_folder_loads_and_decodes_only_tokenizer_ids(tmp_path: Path, monkeypatch: Any) -> None:
    from server.models.loader import load_model
    from server.quantize.evaluation import SequenceRunner
    from server.tokenizer import Tokenizer

    m = _maker()
    small = {
        **m.SHAPES["qwen3-4b"],
        "num_hidden_layers": 2,
        "hidden_size": 128,
        "intermediate_size": 256,
        "head_dim": 32,
        "vocab_size": m.TOKENIZER_TOKENS + 4096,  # ids beyond the tokenizer, as in the real shapes
    }
    monkeypatch.setitem(m.SHAPES, "tiny-qwen3", small)
    monkeypatch.setattr(m, "SHARD_BYTES", 8 << 20)  # several shards and the index
    made = m.make_hf_folder("tiny-qwen3", tmp_path)
    folder = Path(made["folder"])
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    model = load_model(folder, torch.float32, torch.device("cpu"), 64).model  # the server's loader
    ids = Tokenizer(folder).encode("The history of the printing press")
    for _ in range(12):  # greedy, the whole sequence each time (tiny model)
        logits = SequenceRunner(model, len(ids)).logits(torch.tensor(ids))  # [T, vocab]
        assert logits.shape[1] == small["vocab_size"]
        ids.append(int(logits[-1].argmax()))
    assert all(0 <= t < m.TOKENIZER_TOKENS for t in ids[-12:]), ids
