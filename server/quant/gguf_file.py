"""Opening a GGUF file (llama.cpp's format, read by gguf-py's `GGUFReader`) with one clear error for a file
that is not a complete, valid one. gguf-py builds a numpy view of every tensor when it opens a file, so a
truncated file, a tensor type id it does not know, or a quantized row that is not whole blocks fail there
with numpy's or an enum's message ("cannot reshape array of size ...", "4 is not a valid
GGMLQuantizationType"), which names neither the file nor what is wrong with it."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any


class GgufFileError(ValueError):
    """`path` is not a readable GGUF file; the message names the file, its size and gguf-py's reason."""


def open_gguf(path: Path | str) -> Any:
    """gguf-py's `GGUFReader` over `path` (memory-mapped). Raises GgufFileError for a file gguf-py cannot
    read as a GGUF, OSError (FileNotFoundError, PermissionError) as the file system raises it."""
    from gguf import GGUFReader

    path = Path(path)
    try:
        return GGUFReader(str(path))
    except (ValueError, KeyError, IndexError, TypeError, EOFError, struct.error) as e:
        size = path.stat().st_size
        raise GgufFileError(
            f"{path.name} ({size} bytes) is not a readable GGUF file: truncated or corrupt, or a tensor "
            f"type or shape gguf-py does not read ({type(e).__name__}: {e})"
        ) from e
