"""A GGUF's metadata parsed once a load (server/gguf_file.py): gguf-py's reader builds an object per
vocabulary entry when it opens a file (~3 s for SmolLM2's 49k tokens and merges), and a load used to open
the file once for each thing it asked of it (architecture, tokenizer twice, config, MoE fields, estimate,
tensors): nine readers a load of a tiny Llama GGUF; the embedded model's first start took 57-60 s, 38 s
with one reader for resolving."""

from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import Any

import gguf
import pytest
from gguf_models import write_tiny_gguf

from server import gguf_file
from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.gguf_file import open_gguf, shared_gguf_readers
from server.request import SamplingParams


def _count_readers(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    opened: collections.Counter[str] = collections.Counter()
    init = gguf.GGUFReader.__init__

    def counting(self: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        opened[Path(path).name] += 1
        init(self, path, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counting)
    return opened


@pytest.mark.slow
def test_an_engine_load_parses_the_file_once_and_keeps_no_reader(
    tiny_model_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_tiny_gguf(tiny_model_factory("llama", tie=True), tmp_path / "tiny.gguf", "Q8_0")
    opened = _count_readers(monkeypatch)
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(path), cache_dir=tmp_path / "cache"),
            cache=CacheConfig(cache_dtype="float32"),
        )
    )
    # resolving (architecture, tokenizer, transformers' tokenizer and config builders, MoE fields) one
    # reader; the memory estimate and the weights each their own, so that no vocabulary is held while the
    # weights load (held through the whole load, the embedded model's first start peaked 216 MB higher)
    assert opened == {"tiny.gguf": 3}, opened
    assert not gguf_file._shared  # the metadata is not kept for the server's life
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
    opened = _count_readers(monkeypatch)
    source = resolve_model(str(path), tmp_path / "cache", keep_gguf=False)
    assert (source.folder / "model.safetensors").is_file() and source.gguf is None
    # the metadata (MoE fields, architecture, tokenizer with transformers' builder) once; transformers'
    # model loader (a Llama file: its reader, not ours) twice, its config's and its tensors'
    assert opened == {"tiny.gguf": 3}, opened
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
