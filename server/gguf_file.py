"""Opening a GGUF file (llama.cpp's format, read by gguf-py's `GGUFReader`) with one clear error for a file
that is not a complete, valid one, and once per file while a model loads.

gguf-py builds a numpy view of every tensor when it opens a file, so a truncated file, a tensor type id it
does not know, or a quantized row that is not whole blocks fail there with numpy's or an enum's message
("cannot reshape array of size ...", "4 is not a valid GGMLQuantizationType"), which names neither the file
nor what is wrong with it.

It also parses every metadata field when it opens a file, an object and a numpy view per entry of each
array: SmolLM2's 49,152-token vocabulary and 48,900 merges take ~3 s and ~160 MB, a Llama-3 file's 128,256
tokens and 280,147 merges several times that. A model's metadata steps (`loader.gguf_metadata_folder`,
`loader.convert_gguf`'s and the EmbeddingGemma conversion's) ask the file for its architecture, tokenizer,
config and MoE fields, each through its own open, and transformers' GGUF tokenizer and config builders
(`load_gguf_checkpoint`) open it with their own `gguf.GGUFReader(path)`: inside `shared_gguf_readers()` all of those share one
reader per file (transformers' through `gguf.GGUFReader`, swapped for the scope: it imports the name when
it reads a file), dropped when the scope ends. The memory estimate and the tensors' read open the file
again, outside any scope: held through the weights' load, a reader raised the embedded model's first
start's peak by 216 MB (1.19 -> 1.41 GB) for 4 s of its 38. Plain Python (no torch): the loader Job's
memory estimate opens files through it too.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from gguf.gguf_reader import GGUFReader as _Reader  # the defining module's name: never swapped


class GgufFileError(ValueError):
    """`path` is not a readable GGUF file; the message names the file, its size and gguf-py's reason."""


# (device, inode, size, mtime_ns) -> reader: a file replaced or rewritten in place is a new key
_FileKey = tuple[int, int, int, int]
_lock = threading.Lock()
_depth = 0
_shared: dict[_FileKey, Any] = {}
_swapped: Any = _Reader


@contextmanager
def shared_gguf_readers() -> Iterator[None]:
    """Within it (nested scopes and other threads share the outermost), `open_gguf` returns one reader per
    file; on leaving the outermost scope the readers are dropped. Readers are read-only to every caller."""
    import gguf

    global _depth, _swapped
    with _lock:
        _depth += 1
        if _depth == 1:
            _swapped = gguf.GGUFReader  # whatever was there (a test's spy) is put back
            gguf.GGUFReader = _SharedReader  # type: ignore[misc]
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _shared.clear()
                gguf.GGUFReader = _swapped  # type: ignore[misc]


class _SharedReader(_Reader):
    """`gguf.GGUFReader` inside the scope: a read-only open of a file returns the shared reader (an
    instance of the real class, so `__init__` is not run again); any other open is gguf-py's own."""

    def __new__(cls, path: Any, mode: Literal["r", "r+", "c"] = "r") -> Any:
        if mode != "r":
            return _Reader(path, mode)
        return open_gguf(path)


def open_gguf(path: Path | str) -> Any:
    """gguf-py's `GGUFReader` over `path` (memory-mapped); inside `shared_gguf_readers()`, the one already
    opened for that file. Raises GgufFileError for a file gguf-py cannot read as a GGUF, OSError
    (FileNotFoundError, PermissionError) as the file system raises it."""
    path = Path(path)
    st = path.stat()
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _lock:
        reader = _shared.get(key) if _depth else None
    if reader is not None:
        return reader
    reader = _open(path, st.st_size)
    with _lock:
        if _depth:
            reader = _shared.setdefault(key, reader)
    return reader


def _open(path: Path, size: int) -> Any:
    try:
        return _Reader(str(path))
    except (ValueError, KeyError, IndexError, TypeError, EOFError, struct.error) as e:
        raise GgufFileError(
            f"{path.name} ({size} bytes) is not a readable GGUF file: truncated or corrupt, or a tensor "
            f"type or shape gguf-py does not read ({type(e).__name__}: {e})"
        ) from e
