"""benchmarks/*.py scripts imported by the tests that check their arithmetic and parsing, once each."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(file: str) -> ModuleType:
    """benchmarks/`file` as module `kubeinfer_benchmarks_<stem>` (cached in sys.modules: dataclasses look
    their module up there), loaded by path: benchmarks/ is no package, and this puts nothing on sys.path
    (its modules would shadow installed packages of the same name); a script that imports its neighbours
    puts its own folder there, as it does when run."""
    name = f"kubeinfer_benchmarks_{file.removesuffix('.py')}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
