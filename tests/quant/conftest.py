"""Quantized SmolLM2 checkpoints and the held-out scores, built once per test session.

Calibration is deliberately small (128 tokens, a coarse AWQ grid) to keep the suite fast; the bounds in
test_quant_accuracy.py were measured with exactly these settings. The quantizer itself is exercised on
tiny models in every session (test_quant_formats.py).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
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
    "gptq": {"method": "gptq", "sym": False, "act_order": True, "damp_percent": 0.1},
}


def _code_key(name: str, smollm2_dir: Path) -> str:
    """Changes whenever anything that shapes the checkpoint changes: quantizer code, formats, model code."""
    root = Path(__file__).resolve().parents[2]
    files = [
        *sorted((root / "server" / "quantize").glob("*.py")),
        root / "server" / "quant" / "formats.py",
        root / "server" / "models" / "llama.py",
        root / "server" / "models" / "loader.py",
    ]
    h = hashlib.sha256(
        f"{name}:{sorted(CHECKPOINTS[name].items())}:{CALIB_TOKENS}:{smollm2_dir.name}".encode()
    )
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


@pytest.fixture(scope="session")
def quantized_checkpoint(smollm2_dir: Path) -> Callable[[str], Path]:
    """Our quantizer's SmolLM2 checkpoints, cached next to the converted model (like it) and keyed by the
    code that writes them, so a later session with unchanged code skips the ~1 min of calibration."""
    from server.models.loader import default_cache_dir
    from server.quantize import QuantizeOptions, quantize_model

    def get(name: str) -> Path:
        target = default_cache_dir() / "quant-tests" / f"smollm2-{name}-{_code_key(name, smollm2_dir)}"
        if not (target / "config.json").is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
            try:
                opts = QuantizeOptions(calib_tokens=CALIB_TOKENS, **CHECKPOINTS[name])  # type: ignore[arg-type]
                quantize_model(str(smollm2_dir), tmp, opts)
                try:
                    tmp.rename(target)
                except OSError:  # another session finished the same checkpoint first
                    if not (target / "config.json").is_file():
                        raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            for stale in target.parent.glob(f"smollm2-{name}-*"):  # written by older code
                if stale != target:
                    shutil.rmtree(stale, ignore_errors=True)
        return target

    return get


@pytest.fixture(scope="session")
def heldout_ids(smollm2_dir: Path) -> torch.Tensor:  # [EVAL_TOKENS] int64
    from server.quantize.evaluation import HELDOUT_TEXT
    from server.tokenizer import Tokenizer

    ids = Tokenizer(smollm2_dir).encode(HELDOUT_TEXT, add_special_tokens=False)
    assert len(ids) >= EVAL_TOKENS
    return torch.tensor(ids[:EVAL_TOKENS], dtype=torch.int64)


@pytest.fixture(params=["scalar", "avx2", "vnni"])
def qk_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each code path of csrc/qk_native.cpp this CPU runs (the library qlinear also hands its tiles to),
    set for the test and restored after; a path this CPU lacks is skipped. (avx2 here runs in this CPU's
    own build, which may encode its AVX2 ops as AVX-512 ones: test_cpu_qk_native's avx2_only_kernel is the
    build without AVX-512.)"""
    from server.quant import cpu_qk_native as qk

    kernel = qk.load_qk_native_kernel()
    default = kernel.isa
    if kernel.set_path(request.param) != request.param:
        kernel.set_path(default)
        pytest.skip(f"this CPU does not run the {request.param} path")
    yield request.param
    kernel.set_path(default)
