"""A GGUF's metadata parsed once a load (server/gguf_file.py): gguf-py's reader builds an object per
vocabulary entry when it opens a file (~3 s for SmolLM2's 49k tokens and merges), and a load used to open
the file once for each thing it asked of it (architecture, tokenizer twice, config, MoE fields, estimate,
tensors): nine readers a load of a tiny Llama GGUF; the embedded model's first start took 57-60 s, 38 s
with one reader for resolving. The opens that need no vocabulary (the memory estimate, the tensors, the
config) step over long arrays (0.05 s against 2.7 s on the embedded model's file): a warm start builds none."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf_models import write_tiny_gguf
from gguf_opens import count_gguf_opens

from server import gguf_file
from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.gguf_file import LONG_ARRAY, ArrayNotRead, GgufFileError, open_gguf, shared_gguf_readers
from server.request import SamplingParams


@pytest.mark.slow
def test_an_engine_load_parses_the_file_once_and_a_warm_start_builds_no_vocabulary(
    tiny_model_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_tiny_gguf(tiny_model_factory("llama", tie=True), tmp_path / "tiny.gguf", "Q8_0")
    opened = count_gguf_opens(monkeypatch)

    def load() -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model=ModelConfig(model=str(path), cache_dir=tmp_path / "cache"),
                cache=CacheConfig(cache_dtype="float32"),
            )
        )

    engine = load()
    # resolving (architecture, tokenizer, transformers' tokenizer and config builders, MoE fields) one
    # reader; the memory estimate (and its config) and the weights each their own stepping over the
    # vocabulary, so that none is held while the weights load (held through the whole load, the embedded
    # model's first start peaked 216 MB higher)
    # (the estimate and the weights: opens that step over the vocabulary, ~1/50 the cost of a full one)
    assert opened == {("tiny.gguf", "full"): 1, ("tiny.gguf", "short"): 2}, opened
    assert not gguf_file._shared  # the metadata is not kept for the server's life
    out = engine.generate([engine.tokenizer.encode("Water boils at")], SamplingParams(max_tokens=2))
    assert len(out[0]) == 2
    del engine
    opened.clear()
    engine = load()  # the metadata folder is cached: no vocabulary is built at all
    assert opened == {("tiny.gguf", "short"): 2}, opened
    out = engine.generate([engine.tokenizer.encode("Water boils at")], SamplingParams(max_tokens=2))
    assert len(out[0]) == 2


@pytest.mark.slow
def test_a_conversion_parses_the_metadata_once_and_the_tensors_apart(
    tiny_model_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--dtype` or tensor parallelism converts a GGUF to a safetensors folder (loader.convert_gguf): its
    metadata questions share one reader, the fp32 tensors are read apart from it (no vocabulary held while
    they are built), and nothing is kept."""
    from server.models.loader import resolve_model

    path = write_tiny_gguf(tiny_model_factory("llama", tie=True), tmp_path / "tiny.gguf", "Q8_0")
    opened = count_gguf_opens(monkeypatch)
    source = resolve_model(str(path), tmp_path / "cache", keep_gguf=False)
    assert (source.folder / "model.safetensors").is_file() and source.gguf is None
    # the metadata (MoE fields, architecture, tokenizer with transformers' builder) once; transformers'
    # model loader (a Llama file: its reader, not ours) twice, its config's and its tensors'
    assert opened == {("tiny.gguf", "full"): 3}, opened
    assert not gguf_file._shared


def test_readers_are_shared_only_inside_the_scope_and_per_version_of_the_file(
    tiny_model_factory: Any, tmp_path: Path
) -> None:
    path = write_tiny_gguf(
        tiny_model_factory("llama", tie=True), tmp_path / "tiny.gguf", "Q8_0", tokenizer=False
    )
    assert open_gguf(path) is not open_gguf(path)
    with shared_gguf_readers():
        first = open_gguf(path)
        with shared_gguf_readers():  # nested: the outer scope's readers
            assert open_gguf(str(path)) is first
        assert open_gguf(path) is first
        data = path.read_bytes()
        path.write_bytes(data)  # rewritten in place: another mtime, another reader
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        assert open_gguf(path) is not first
    assert not gguf_file._shared


def test_the_scope_puts_back_whatever_gguf_reader_was(monkeypatch: pytest.MonkeyPatch) -> None:
    class Spy(gguf.GGUFReader):  # type: ignore[misc]
        pass

    monkeypatch.setattr(gguf, "GGUFReader", Spy)
    with shared_gguf_readers():
        assert gguf.GGUFReader is not Spy  # transformers' opens go through the shared reader
    assert gguf.GGUFReader is Spy


def _write_arrays_gguf(path: Path) -> dict[str, Any]:
    """A GGUF with every kind of field around the long-array bound and two tensors; returns the fields
    written."""
    rng = np.random.default_rng(0)
    long = LONG_ARRAY + 1
    fields: dict[str, Any] = {
        "general.architecture": "llama",
        "test.count": 7,
        "test.eps": 1e-5,
        "test.flag": True,
        "test.short_ints": [1, 2, 3],
        "test.short_strings": ["a", "", "ü"],
        "test.bound_ints": list(range(LONG_ARRAY)),  # at the bound: read
        "test.long_strings": [
            "".join(rng.choice(list("abcé 中"), size=int(n))) for n in rng.integers(0, 9, long)
        ],
        "test.long_floats": rng.standard_normal(long).astype(np.float32).tolist(),
        "test.long_ints": rng.integers(-(2**31), 2**31 - 1, long, dtype=np.int64).tolist(),
        "test.after": "the field after the long arrays",
    }
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in fields.items():
        if key == "general.architecture":
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif key == "test.long_floats":
            w.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.FLOAT32)
        elif key == "test.long_ints":
            w.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT64)
        else:
            w.add_array(key, value)
    w.add_tensor("a.weight", rng.standard_normal((4, 32)).astype(np.float32))
    w.add_tensor("b.weight", rng.standard_normal((3, 64)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return fields


def test_a_short_arrays_open_reads_all_but_long_arrays_which_refuse_to_be_read(tmp_path: Path) -> None:
    path = tmp_path / "arrays.gguf"
    fields = _write_arrays_gguf(path)
    full, short = open_gguf(path), open_gguf(path, long_arrays=False)
    assert list(short.fields) == list(full.fields)
    for key, value in fields.items():
        got = short.fields[key]
        if isinstance(value, list) and len(value) > LONG_ARRAY:
            whole = full.fields[key].contents()
            assert whole == (value if key == "test.long_strings" else pytest.approx(value))
            assert len(got.data) == len(value)
            assert (got.offset, got.types) == (full.fields[key].offset, full.fields[key].types)
            with pytest.raises(ArrayNotRead, match=f"arrays.gguf: {key} \\({len(value)} entries\\)"):
                got.contents()
            with pytest.raises(ArrayNotRead):
                list(got.data)
        else:
            assert got.contents() == (pytest.approx(value) if isinstance(value, float) else value), key
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in short.tensors] == [
        (t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in full.tensors
    ]
    for a, b in zip(short.tensors, full.tensors, strict=True):
        assert np.array_equal(a.data, b.data)
    with shared_gguf_readers():  # the scope's steps read the vocabulary: every open there is the full one
        shared = open_gguf(path, long_arrays=False)
        assert shared is open_gguf(path) and len(shared.fields["test.long_ints"].data[0:3]) == 3


@pytest.mark.parametrize("before_key", ["test.long_floats", "test.after"])  # a string array, a numeric one
def test_a_file_cut_inside_a_long_array_is_refused_by_a_short_arrays_open(
    tmp_path: Path, before_key: str
) -> None:
    path = tmp_path / "arrays.gguf"
    _write_arrays_gguf(path)
    data = path.read_bytes()
    cut = data.index(before_key.encode()) - 100  # inside the long array before that key
    (tmp_path / "cut.gguf").write_bytes(data[:cut])
    with pytest.raises(GgufFileError, match=r"cut\.gguf \(\d+ bytes\) is not a readable GGUF file"):
        open_gguf(tmp_path / "cut.gguf", long_arrays=False)


def _long_array_last(path: Path, values: list[int]) -> bytes:
    """A GGUF whose last field is a long int32 array and that has no tensors: its bytes."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_key_value("test.last", values, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path.read_bytes()


def test_a_long_array_cut_at_the_end_of_the_file_is_refused(tmp_path: Path) -> None:
    """Nothing after the array to fail on: the short open's own bound (gguf-py's open reads such a file)."""
    data = _long_array_last(tmp_path / "last.gguf", list(range(LONG_ARRAY + 1)))
    (tmp_path / "cut.gguf").write_bytes(data[:-64])
    with pytest.raises(GgufFileError, match="runs past the end of the file"):
        open_gguf(tmp_path / "cut.gguf", long_arrays=False)


def test_a_string_length_past_any_file_is_refused_not_overflowed(tmp_path: Path) -> None:
    """A corrupt u64 length of 2**63 in a long string array: GgufFileError, as gguf-py's open gives, not an
    OverflowError from the next offset (found by review)."""
    path = tmp_path / "strings.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("test.strings", [f"s{i}" for i in range(LONG_ARRAY + 1)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    data = bytearray(path.read_bytes())
    first = data.index(b"s0") - 8  # the first string's u64 length
    data[first : first + 8] = (2**63).to_bytes(8, "little")
    (tmp_path / "corrupt.gguf").write_bytes(bytes(data))
    with pytest.raises(GgufFileError, match=r"corrupt\.gguf \(\d+ bytes\) is not a readable GGUF file"):
        open_gguf(tmp_path / "corrupt.gguf", long_arrays=False)
