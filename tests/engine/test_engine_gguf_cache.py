"""A GGUF conversion in the cache folder is reused only by the writer that made it (issue 30 item 6):
a folder another library version wrote (simulated by its manifest, and by the BOS-prepending
tokenizer transformers 4.57 wrote for SmolLM2) is converted again, so the server's tokens equal
transformers' own tokenizer for the embedded GGUF whatever the cache held before."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from server.models import loader
from server.tokenizer import Tokenizer

TEXTS = ["The capital of France is", "hi", "<|im_start|>user\nhello<|im_end|>\n", "  spaces and ünïcode ✓"]


def _reference_ids() -> list[list[int]]:
    from transformers import AutoTokenizer

    gguf = loader.embedded_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return [tok(t).input_ids for t in TEXTS]


def _make_stale(folder: Path, fresh: Path) -> None:
    """A copy of a fresh conversion as an older writer left it: its manifest names transformers
    4.57.1, and its tokenizer prepends <|im_start|> as BOS to every text."""
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(fresh, folder)
    tj = json.loads((folder / "tokenizer.json").read_text())
    bos = "<|im_start|>"
    bos_id = next(a["id"] for a in tj["added_tokens"] if a["content"] == bos)
    first = {"SpecialToken": {"id": bos, "type_id": 0}}
    tj["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [first, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [first, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }
    (folder / "tokenizer.json").write_text(json.dumps(tj))
    manifest_path = folder / "kubeinfer-conversion.json"
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        manifest["writer"]["transformers"] = "4.57.1"
        manifest_path.write_text(json.dumps(manifest))


def test_stale_gguf_metadata_cache_is_not_reused(tmp_path: Path) -> None:
    gguf = loader.embedded_gguf_path()
    reference = _reference_ids()
    assert reference[1][0] != 1  # SmolLM2 prepends no BOS to "hi"
    fresh_cache = tmp_path / "fresh"
    fresh = loader.gguf_metadata_folder(gguf, fresh_cache)
    assert [Tokenizer(fresh).encode(t) for t in TEXTS] == reference
    # The same cache folder, as another version wrote it: the loader must not read it as it is.
    cache = tmp_path / "shared"
    target = loader._gguf_cache_folder(gguf, cache)
    stale = target.with_name(target.name + "-meta")
    _make_stale(stale, fresh)
    assert Tokenizer(stale).encode("hi")[0] == 1  # the stale folder would prepend BOS
    folder = loader.gguf_metadata_folder(gguf, cache)
    assert [Tokenizer(folder).encode(t) for t in TEXTS] == reference
    manifest = json.loads((folder / "kubeinfer-conversion.json").read_text())
    assert manifest["writer"] == loader.conversion_writer() and manifest["kind"] == "meta"
    # Reused now that its writer matches: a second resolve converts nothing.
    assert loader.gguf_metadata_folder(gguf, cache) == folder
    assert loader.resolve_model(None, cache, keep_gguf=True).folder == folder


def test_stale_or_unmarked_full_conversion_is_converted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    class Reconverting(Exception):
        pass

    def reconvert(*a: object, **k: object) -> None:
        raise Reconverting

    gguf = loader.embedded_gguf_path()
    target = loader._gguf_cache_folder(gguf, tmp_path)
    writer = loader.conversion_writer()
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", reconvert)
    for manifest in (None, {"transformers": "4.57.1"}, {"gguf": "0.10.0"}, {"converter": "0"}):
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")
        if manifest is not None:
            st = gguf.stat()
            (target / "kubeinfer-conversion.json").write_text(
                json.dumps(
                    {
                        "kind": "full",
                        "source": {
                            "path": str(gguf.resolve()),
                            "size": st.st_size,
                            "mtime_ns": st.st_mtime_ns,
                        },
                        "writer": {**writer, **manifest},
                    }
                )
            )
        with pytest.raises(Reconverting):
            loader.convert_gguf(gguf, tmp_path)
    # The writer is part of the folder's key too: other versions' conversions sit side by side.
    monkeypatch.setattr(loader, "conversion_writer", lambda: {**writer, "transformers": "4.57.1"})
    assert loader._gguf_cache_folder(gguf, tmp_path) != target


@pytest.mark.slow
def test_a_new_conversion_removes_the_ones_it_supersedes(tmp_path: Path) -> None:
    """Each writer version or reinstall (a new mtime) keys a new cache folder: without pruning, every CI
    run left another 0.5 GB conversion of the embedded model behind. Superseded: the same source path's
    folders of the same kind, and those of a file that is gone; another file's folder stays."""
    gguf = tmp_path / "model.gguf"
    shutil.copy(loader.embedded_gguf_path(), gguf)
    cache = tmp_path / "cache"
    first = loader.gguf_metadata_folder(gguf, cache)
    # An older writer's folder of the same file, under another key.
    older = cache / f"{gguf.stem}-0000000000000000-meta"
    shutil.copytree(first, older)
    manifest = json.loads((older / "kubeinfer-conversion.json").read_text())
    manifest["writer"]["transformers"] = "4.57.1"
    (older / "kubeinfer-conversion.json").write_text(json.dumps(manifest))
    # A conversion of a deleted file with the same stem, and one of another live file.
    gone = cache / f"{gguf.stem}-1111111111111111-meta"
    shutil.copytree(first, gone)
    manifest["source"]["path"] = str(tmp_path / "deleted" / "model.gguf")
    (gone / "kubeinfer-conversion.json").write_text(json.dumps(manifest))
    other_file = tmp_path / "elsewhere" / "model.gguf"
    other_file.parent.mkdir()
    other_file.write_bytes(b"x")
    kept = cache / f"{gguf.stem}-2222222222222222-meta"
    shutil.copytree(first, kept)
    manifest["source"]["path"] = str(other_file)
    (kept / "kubeinfer-conversion.json").write_text(json.dumps(manifest))
    # The file is replaced (a reinstall: new mtime): a new key, a new conversion.
    gguf.touch()
    new = loader.gguf_metadata_folder(gguf, cache)
    assert new != first and new.is_dir()
    assert not first.exists() and not older.exists() and not gone.exists()
    assert kept.is_dir()
