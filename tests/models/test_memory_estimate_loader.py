"""The loader's side of the memory estimate (server/download.py --memory-estimate-file): the JSON the
operator reads back from the loader pod's termination message."""

from __future__ import annotations

import json
from pathlib import Path

from test_memory_estimate import GEMMA3, _write_folder

from server.download import build_parser, write_memory_estimate
from server.memory_estimate import ServingSettings, estimate_memory


def test_loader_writes_the_estimate_for_the_serving_flags(tmp_path: Path) -> None:
    folder = _write_folder(tmp_path / "m", GEMMA3)
    link = tmp_path / "models--m"
    link.symlink_to(folder.name)
    out = tmp_path / "termination-log"
    args = build_parser().parse_args(
        [
            "--model", "org/m", "--output", str(link), "--memory-estimate-file", str(out),
            "--max-model-len", "2048", "--max-num-seqs", "8", "--kv-cache-memory", "1GiB", "--device", "cuda",
        ]
    )  # fmt: skip
    write_memory_estimate(args, link)
    got = json.loads(out.read_text())
    want = estimate_memory(
        folder,
        ServingSettings(auto_dtype="bfloat16", max_model_len=2048, max_num_seqs=8, kv_cache_memory=1 << 30),
    )
    assert got == json.loads(want.to_json())
    assert got["kv_cache_bytes"] == 1 << 30 and got["max_num_seqs"] == 8


def test_no_estimate_leaves_the_file_alone(tmp_path: Path) -> None:
    out = tmp_path / "termination-log"
    args = build_parser().parse_args(["--model", "org/m", "--memory-estimate-file", str(out)])
    write_memory_estimate(args, tmp_path)  # no config.json: logged, nothing written
    assert not out.exists()
