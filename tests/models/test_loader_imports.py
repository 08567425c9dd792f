"""What loading a model imports: the loaders build the model on the meta device and assign the
checkpoint's tensors, and nothing on that path may pull in torch's compiler stack, which a server never
uses: torch._dynamo with sympy and torch._inductor (~70 MiB of resident memory) and triton where it is
installed (~74 MiB more), measured on a Gemma-3-1B Q4_K_M server (RSS 1,683 -> 1,556 MiB, 2026-12-05)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

_LOAD = """
import sys
from pathlib import Path

import torch

from server.models.loader import load_model

loaded = load_model(Path(sys.argv[1]), torch.float32, torch.device("cpu"), 64)
assert loaded.model.rotary.cos.shape[0] == 64  # the tables are built once the weights are in
print(sorted(m for m in ("torch._dynamo", "torch._inductor", "sympy", "triton") if m in sys.modules))
"""


def test_loading_a_model_imports_no_compiler(tiny_model_factory: Callable[..., Path]) -> None:
    """nn.Embedding's normal_ and the rotary tables' arithmetic on meta tensors run torch's Python meta
    kernels, whose first call imports torch._dynamo: the loaders' model skips both (TokenEmbedding,
    max_positions=None) and builds the tables once the weights are assigned."""
    folder = tiny_model_factory("llama")
    out = subprocess.run(
        [sys.executable, "-c", _LOAD, str(folder)], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr[-2000:]
