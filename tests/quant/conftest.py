"""Quantized SmolLM2 checkpoints and the held-out scores, built once per test session.

Calibration is deliberately small (128 tokens, a coarse AWQ grid) to keep the suite fast; the bounds in
test_quant_accuracy.py were measured with exactly these settings.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# The CUDA int4 path is checked under Triton's interpreter here; that must be chosen before any @triton.jit
# function is defined (bitsandbytes imports triton too).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

CALIB_TOKENS = 128
AWQ_GRID = 10
EVAL_TOKENS = 257  # 256 predicted positions

# Checkpoints the accuracy, format and engine tests share: name -> QuantizeOptions keywords.
CHECKPOINTS: dict[str, dict[str, object]] = {
    "awq": {"method": "awq", "awq_grid": AWQ_GRID},
    "gptq": {"method": "gptq", "sym": False, "act_order": True},
}


@pytest.fixture(scope="session")
def quantized_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path
) -> Callable[[str], Path]:
    from server.quantize import QuantizeOptions, quantize_model

    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            out = tmp_path_factory.mktemp(f"smollm2-{name}")
            opts = QuantizeOptions(calib_tokens=CALIB_TOKENS, **CHECKPOINTS[name])  # type: ignore[arg-type]
            quantize_model(str(smollm2_dir), out, opts)
            cache[name] = out
        return cache[name]

    return get


@pytest.fixture(scope="session")
def heldout_ids(smollm2_dir: Path) -> torch.Tensor:  # [EVAL_TOKENS] int64
    from server.quant.evaluation import HELDOUT_TEXT
    from server.tokenizer import Tokenizer

    ids = Tokenizer(smollm2_dir).encode(HELDOUT_TEXT, add_special_tokens=False)
    assert len(ids) >= EVAL_TOKENS
    return torch.tensor(ids[:EVAL_TOKENS], dtype=torch.int64)
