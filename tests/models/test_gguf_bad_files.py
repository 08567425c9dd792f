"""A GGUF file that is not a complete, valid one (truncated, a tensor type id gguf-py does not know) or of an
architecture we do not serve: one clear error naming the file and the reason, through the server's
load-failure path (exit 1, "the model could not be loaded: ..."), never a bare numpy traceback from the
task probe that runs before loading."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from serving import free_port

from server.gguf_file import GgufFileError, open_gguf
from server.pooling.model import resolve_task


def _tiny_gguf(path: Path, arch: str = "llama") -> Path:
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.arange(64 * 32, dtype=np.float32).reshape(64, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _truncated(tmp_path: Path) -> Path:
    whole = _tiny_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) - 4096])  # the tensor's data short by 1,024 values
    return cut


def _bad_type(tmp_path: Path) -> Path:
    data = bytearray(_tiny_gguf(tmp_path / "whole.gguf").read_bytes())
    # the tensor info: name, n_dims (u32), dims (u64 each), type (u32), offset (u64)
    name = b"token_embd.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8
    assert struct.unpack_from("<I", data, at)[0] == 0  # F32
    struct.pack_into("<I", data, at, 4)  # a type id gguf's enum has no member for
    bad = tmp_path / "badtype.gguf"
    bad.write_bytes(bytes(data))
    return bad


@pytest.mark.parametrize("make", [_truncated, _bad_type], ids=["truncated", "unknown-type"])
def test_an_unreadable_gguf_raises_one_error_naming_the_file(tmp_path: Path, make) -> None:  # type: ignore[no-untyped-def]
    bad = make(tmp_path)
    with pytest.raises(GgufFileError, match=rf"{bad.name} \(\d+ bytes\) is not a readable GGUF file"):
        open_gguf(bad)
    # the task probe before loading does not raise: the load reports it
    assert resolve_task(str(bad), "auto") == "generate"


def test_the_server_exits_1_with_the_files_error(tmp_path: Path) -> None:
    bad = _truncated(tmp_path)
    env = {**os.environ, "KUBEINFER_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "server", "--model", str(bad), "--port", str(free_port())]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 1, done.stderr[-2000:]
    lines = [line for line in (done.stdout + done.stderr).splitlines() if "could not be loaded" in line]
    assert lines and "cut.gguf" in lines[0] and "is not a readable GGUF file" in lines[0], lines


def test_an_unserved_architecture_names_the_ones_served(tmp_path: Path) -> None:
    from server.models.arch import UnsupportedModelError
    from server.models.loader import gguf_metadata_folder

    path = _tiny_gguf(tmp_path / "foobar.gguf", arch="foobar")
    with pytest.raises(
        UnsupportedModelError, match=r"architecture 'foobar' is not served; .*gemma3.*llama.*qwen3"
    ):
        gguf_metadata_folder(path, tmp_path / "cache")
