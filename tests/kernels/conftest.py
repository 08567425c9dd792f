"""Kernel tests: on a CUDA machine they run compiled on the GPU; elsewhere under Triton's interpreter.

TRITON_INTERPRET must be set before any @triton.jit function is defined, i.e. before `kernels` is
imported; conftest modules load before the test modules next to them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Imported only after the environment setup above, or the kernels would be compiled for a missing GPU.
from kubeinfer_kernels._common import interpreting

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marker = pytest.mark.interpreter if interpreting() else pytest.mark.gpu
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(marker)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cpu" if interpreting() else "cuda")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
