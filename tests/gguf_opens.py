"""Counting gguf-py's readers built while a test runs (server/gguf_file.py: how often a load parses a file)."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import gguf
import pytest

from server import gguf_file


def count_gguf_opens(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[tuple[str, str]]:
    """(file name, "full" or "short") -> readers built from now on, those that step over long arrays
    (`open_gguf(..., long_arrays=False)`) apart."""
    opened: collections.Counter[tuple[str, str]] = collections.Counter()
    init = gguf.GGUFReader.__init__

    def counting(self: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        kind = "short" if isinstance(self, gguf_file._ShortArraysReader) else "full"
        opened[Path(path).name, kind] += 1
        init(self, path, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counting)
    return opened
