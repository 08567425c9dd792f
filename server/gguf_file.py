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

Those two, and every question that needs no vocabulary (architecture, config, tensors), open the file with
`long_arrays=False`: an array of more than `LONG_ARRAY` entries is stepped over (a string array's lengths
read, nothing built), its field keeping the array's length and raising `ArrayNotRead` when its entries are
asked for. On the embedded model's file that open takes 0.05 s against gguf-py's 2.7 s, on a 262,144-token
Gemma 3 file 0.1 s against 10.9 s: a start from a warm cache builds no vocabulary at all.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import numpy as np
from gguf.constants import GGUFEndian, GGUFValueType
from gguf.gguf_reader import GGUFReader as _Reader  # the defining module's name: never swapped

# Arrays longer than this are a vocabulary's (tokens, scores, types, merges: thousands of entries); the
# per-layer arrays some architectures write (KV heads, window pattern) are a few hundred at most.
LONG_ARRAY = 1024


class GgufFileError(ValueError):
    """`path` is not a readable GGUF file; the message names the file, its size and gguf-py's reason."""


class ArrayNotRead(RuntimeError):
    """An entry of a long array was asked of a reader opened with `long_arrays=False`."""


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


def open_gguf(path: Path | str, *, long_arrays: bool = True) -> Any:
    """gguf-py's `GGUFReader` over `path` (memory-mapped); inside `shared_gguf_readers()`, the one already
    opened for that file. `long_arrays=False`: arrays of more than `LONG_ARRAY` entries are not read (their
    field's `data` has the array's length and raises ArrayNotRead when indexed); inside the scope, whose
    steps read the vocabulary anyway, the shared full reader instead (opened by the first question asked).
    Raises GgufFileError for a file gguf-py cannot read as a GGUF, OSError (FileNotFoundError,
    PermissionError) as the file system raises it."""
    path = Path(path)
    st = path.stat()
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _lock:
        reader = _shared.get(key) if _depth else None
        scoped = _depth > 0
    if reader is not None:
        return reader
    if not long_arrays and not scoped:
        return _open(path, st.st_size, _ShortArraysReader)
    reader = _open(path, st.st_size, _Reader)
    with _lock:
        if _depth:
            reader = _shared.setdefault(key, reader)
    return reader


class _NotRead(Sequence[int]):
    """A long array's `ReaderField.data`: its length, and ArrayNotRead for its entries."""

    def __init__(self, path: str, key: str, length: int) -> None:
        self._what = f"{Path(path).name}: {key} ({length} entries)"
        self._length = length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: Any) -> Any:
        raise ArrayNotRead(f"{self._what} was not read: open the file with open_gguf(path) to read it")

    def __iter__(self) -> Iterator[int]:
        raise ArrayNotRead(f"{self._what} was not read: open the file with open_gguf(path) to read it")


class _ShortArraysReader(_Reader):
    """gguf-py's reader that steps over a field's long array: gguf-py builds a numpy view and an index per
    entry, the cost of opening a file with a vocabulary. Tensors, scalars and short arrays (and anything
    nested in an array) are gguf-py's own."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._nested = False
        # the length of the array just stepped over, until its field is pushed
        self._skipped: int | None = None
        super().__init__(path)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[Any]]:
        if raw_type != GGUFValueType.ARRAY or self._nested:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        raw_len = self._get(orig_offs + 4, np.uint64)
        itype, length = int(raw_itype[0]), int(raw_len[0])
        if length <= LONG_ARRAY or itype == GGUFValueType.ARRAY:
            self._nested = True
            try:
                return super()._get_field_parts(orig_offs, raw_type)
            finally:
                self._nested = False
        offs, end = orig_offs + 12, len(self.data)  # after the entry type (u32) and the length (u64)
        scalar = self.gguf_scalar_to_np.get(GGUFValueType(itype))
        if scalar is not None:
            offs += length * np.dtype(scalar).itemsize
        elif itype == GGUFValueType.STRING:  # each a u64 length and its bytes
            view = memoryview(self.data)  # type: ignore[arg-type]
            unpack = struct.Struct("<Q" if self.endianess == GGUFEndian.LITTLE else ">Q").unpack_from
            for _ in range(length):
                if offs + 8 > end:  # before unpacking: a corrupt length would overflow the next offset
                    raise ValueError(f"an array of {length} strings runs past the end of the file")
                offs += 8 + unpack(view, offs)[0]
        if offs > end:
            raise ValueError(f"an array of {length} entries runs past the end of the file")
        self._skipped = length
        return offs - orig_offs, [raw_itype, raw_len], [], [GGUFValueType.ARRAY, GGUFValueType(itype)]

    def _push_field(self, field: Any, skip_sum: bool = False) -> int:
        if self._skipped is not None:
            field = field._replace(data=_NotRead(self._path, field.name, self._skipped))
            self._skipped = None
        return super()._push_field(field, skip_sum)


def _open(path: Path, size: int, cls: type[_Reader]) -> Any:
    try:
        return cls(str(path))
    except (ValueError, KeyError, IndexError, TypeError, EOFError, struct.error) as e:
        raise GgufFileError(
            f"{path.name} ({size} bytes) is not a readable GGUF file: truncated or corrupt, or a tensor "
            f"type or shape gguf-py does not read ({type(e).__name__}: {e})"
        ) from e
