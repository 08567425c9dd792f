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


def test_the_loaders_cpu_estimate_counts_a_ggufs_k_quants_at_the_tiles_bits(tmp_path: Path) -> None:
    """A CPU server of one rank holds a GGUF's k-quants in 16-row tiles on every CPU from AVX2 on (the
    node is unknown to the loader; that is the floor it assumes): Q5_K at 5.625 bits, not the repack's 10
    (the operator's request was ~1.7x a Q5_K_M model's need). Q8_0 as on AVX2 (row-major, 8.5 either way);
    ranks of a tensor-parallel CPU group hold the repacks."""
    from test_memory_estimate import GGUF_TYPES, _write_gguf

    from server.memory_estimate import GGUF_RESIDENT_BITS, GGUF_TILE_BITS

    path = tmp_path / "m.gguf"
    _write_gguf(path, GGUF_TYPES)
    base = ["--model", "org/m", "--max-model-len", "1024", "--max-num-seqs", "1"]

    def loader_estimate(file: Path, *flags: str) -> dict[str, int]:
        out = tmp_path / "termination-log"
        write_memory_estimate(
            build_parser().parse_args([*base, "--memory-estimate-file", str(out), *flags]), file
        )
        got: dict[str, int] = json.loads(out.read_text())
        return got

    norms = 256 * 4  # the F32 norm _write_gguf adds
    tiles = [GGUF_TILE_BITS.get(t, GGUF_RESIDENT_BITS.get(t, 32.0)) for t in GGUF_TYPES]
    repacks = [GGUF_RESIDENT_BITS.get(t, 32.0) for t in GGUF_TYPES]
    one_rank = loader_estimate(path)
    assert one_rank["weight_bytes"] == int(sum(b * 64 * 256 for b in tiles) // 8) + norms
    two_ranks = loader_estimate(path, "--tensor-parallel-size", "2")
    assert two_ranks["weight_bytes"] == int(sum(b * 64 * 256 for b in repacks) // 8) + norms
    assert one_rank["weight_bytes"] < two_ranks["weight_bytes"] - 64 * 256 * (10 - 5.625) // 8 * 2
    # the 32-value formats' tiles on AVX2 too: Q5_0 5.5, Q5_1 6.0, IQ4_NL 4.5 bits (repacks: 8.5, 9.0, 8.5)
    legacy = tmp_path / "legacy.gguf"
    _write_gguf(legacy, ["Q5_0", "Q5_1", "IQ4_NL", "Q8_0"])
    assert loader_estimate(legacy)["weight_bytes"] == int((5.5 + 6.0 + 4.5 + 8.5) * 64 * 256 // 8) + norms
