"""`python -m server.download`: fetch a hub model (and LoRA adapters) into a cache folder ahead of
serving, with the server's own download code (`server.models.loader.download_from_hub`,
`server.lora.adapter.resolve_adapter_path`). The operator's cache loader Job runs it (cache.mode
Shared); the replicas then get `--output` as a plain local --model folder and load it offline.

    python -m server.download --model org/name [--revision REV] --cache-dir DIR --output DIR/models/x
        [--adapter org/lora=DIR/adapters/y ...]
    python -m server.download --model s3://bucket/prefix --cache-dir DIR --output DIR/models/x

An `s3://` model (server/download_s3.py: AWS_* environment, resumable and verified) is downloaded into
`<cache>/s3/<bucket>/<prefix>`.

Each `--output` becomes a relative symlink to the downloaded hub snapshot (or S3 folder) (so it stays valid wherever
the cache is mounted), replaced atomically. HF_TOKEN authenticates. Progress goes to stdout, one line
per step; exit code 0 when every folder is in place and loadable, 1 with the reason otherwise: the
last line `download failed: <Reason>: <message>` (Reason one CamelCase word, which the operator shows
as the cache's condition reason).

With `--memory-estimate-file PATH` (the operator passes the container's termination-message path), the
model's memory estimate for the serving flags given (`--dtype`, `--quantize`, `--max-model-len`,
`--max-num-seqs`, `--kv-cache-dtype`, `--kv-cache-memory`, `--device`; server/memory_estimate.py) is
written there as one line of JSON once the download succeeded; an estimate that cannot be made is logged
and leaves the file alone (the download still succeeds).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from server.cli import parse_size
from server.config import default_cache_dir
from server.download_s3 import S3DownloadError, download_prefix

# server.models.loader and server.lora.adapter import torch (seconds): imported where used, so that
# an S3 download, and its failure, start at once.

log = logging.getLogger("server.download")


def _size(folder: Path) -> tuple[int, int]:
    """(files, bytes) of a snapshot folder, following the hub cache's symlinks into blobs/."""
    files = [p for p in folder.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def link(target: Path, output: Path) -> None:
    """Make `output` a relative symlink to `target`, atomically (readers see the old or the new one)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    relative = os.path.relpath(target.resolve(), output.parent.resolve())
    tmp = output.parent / f".{output.name}.tmp-{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(relative, target_is_directory=True)
    os.replace(tmp, output)


def fetch_model(repo: str, revision: str | None, cache_dir: Path, output: Path | None) -> Path:
    from server.models.loader import download_from_hub

    started = time.monotonic()
    log.info("model %s%s: downloading into %s", repo, f"@{revision}" if revision else "", cache_dir)
    folder = download_from_hub(repo, cache_dir, revision=revision)
    files, size = _size(folder)
    log.info(
        "model %s: %d files, %.1f MiB in %.1f s (%s)",
        repo,
        files,
        size / 2**20,
        time.monotonic() - started,
        folder,
    )
    return folder if output is None else _publish_model(repo, folder, output, cache_dir)


def fetch_s3_model(uri: str, cache_dir: Path, output: Path | None) -> Path:
    started = time.monotonic()
    log.info("model %s: downloading into %s", uri, cache_dir)
    try:
        folder, fetched = download_prefix(uri, cache_dir)
    except ValueError as exc:  # the URI itself
        raise S3DownloadError("InvalidURI", str(exc)) from exc
    files, size = _size(folder)
    log.info(
        "model %s: %d files, %.1f MiB (%.1f MiB fetched now) in %.1f s (%s)",
        uri,
        files,
        size / 2**20,
        fetched / 2**20,
        time.monotonic() - started,
        folder,
    )
    return folder if output is None else _publish_model(uri, folder, output, cache_dir)


def _publish_model(name: str, folder: Path, output: Path, cache_dir: Path) -> Path:
    """`output` linked to the downloaded `folder`, then loaded as the server will load it (a local Hugging
    Face folder: config.json + *.safetensors), so a folder it cannot serve fails the loader, not a replica."""
    from server.models.loader import resolve_model

    link(folder, output)
    resolve_model(str(output), cache_dir=cache_dir)
    log.info("model %s: ready at %s", name, output)
    return output


def fetch_adapter(repo: str, cache_dir: Path, output: Path) -> Path:
    from server.lora.adapter import ADAPTER_CONFIG, LoRAAdapterError, resolve_adapter_path

    started = time.monotonic()
    log.info("adapter %s: downloading into %s", repo, cache_dir)
    folder = resolve_adapter_path(repo, cache_dir)
    if not (folder / ADAPTER_CONFIG).is_file():
        raise LoRAAdapterError(f"adapter {repo}: no {ADAPTER_CONFIG} in {folder}")
    link(folder, output)
    files, size = _size(folder)
    log.info(
        "adapter %s: %d files, %.1f MiB in %.1f s, ready at %s",
        repo,
        files,
        size / 2**20,
        time.monotonic() - started,
        output,
    )
    return output


def _adapter(value: str) -> tuple[str, Path]:
    repo, sep, out = value.partition("=")
    if not sep or not repo or not out:
        raise argparse.ArgumentTypeError(f"--adapter {value!r}: expected org/name=/path/to/folder")
    return repo, Path(out)


def _expected(exc: Exception) -> bool:
    """A failure the loader reports in one line (anything else is a bug: its traceback shows)."""
    if isinstance(exc, (S3DownloadError, OSError)):
        return True
    from server.lora.adapter import LoRAAdapterError
    from server.models.loader import ModelLoadError

    return isinstance(exc, (ModelLoadError, LoRAAdapterError))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m server.download", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="hub repo id org/name, or s3://bucket/prefix")
    p.add_argument("--revision", default=None, help="branch, tag or commit (default: MODEL_REVISION or main)")
    p.add_argument("--cache-dir", type=Path, default=None, help="cache root (default: KUBEINFER_CACHE_DIR)")
    p.add_argument("--output", type=Path, default=None, help="symlink to create to the model's folder")
    p.add_argument(
        "--adapter", type=_adapter, action="append", default=[], help="org/name=/output/folder (repeatable)"
    )
    p.add_argument(
        "--memory-estimate-file", type=Path, default=None, help="write the memory estimate (JSON) here"
    )
    p.add_argument("--dtype", default="auto", help="the server's --dtype, for the estimate")
    p.add_argument("--quantize", default=None, help="the server's --quantize, for the estimate")
    p.add_argument("--max-model-len", type=int, default=None, help="the server's --max-model-len")
    p.add_argument(
        "--max-num-seqs", type=int, default=None, help="the server's --max-num-seqs (default: its default)"
    )
    p.add_argument(
        "--block-size", type=int, default=None, help="the server's --block-size (default: its default)"
    )
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="the server's --max-num-batched-tokens"
    )
    p.add_argument("--kv-cache-dtype", default="auto", help="the server's --kv-cache-dtype")
    p.add_argument("--kv-cache-memory", type=parse_size, default=None, help="the server's --kv-cache-memory")
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="the server's --tensor-parallel-size (CPU ranks above 1 hold a GGUF's k-quants repacked)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the server runs: what --dtype auto resolves to (cpu: fp32, the bound; cuda: bf16)",
    )
    return p


def write_memory_estimate(args: argparse.Namespace, model: Path) -> None:
    """The estimate for `model` under the flags in `args`, as JSON into --memory-estimate-file."""
    from server.memory_estimate import (
        DEFAULT_KV_CACHE_MEMORY,
        EstimateError,
        ServingSettings,
        estimate_memory,
    )

    try:
        # a flag the caller left out takes the server's own default (ServingSettings' defaults are those)
        given = {
            name: getattr(args, name)
            for name in ("max_num_seqs", "block_size", "max_num_batched_tokens")
            if getattr(args, name) is not None
        }
        settings = ServingSettings(
            dtype=args.dtype,
            auto_dtype="bfloat16" if args.device == "cuda" else "float32",
            quantize=args.quantize,
            max_model_len=args.max_model_len,
            kv_cache_dtype=args.kv_cache_dtype,
            kv_cache_memory=args.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY,
            # A CPU server of one rank holds a GGUF served as it is in the 16-row tiles on every x86 CPU
            # from AVX2 on (gguf_checkpoint.super_blocks_enabled), the floor of the nodes clouds sell: the
            # figure for that floor, not the repacks' (~1.7x for Q5_K_M). A CPU below it holds more; the
            # server's own estimate there (engine.py, check_memory) refuses to start when even the weights
            # and one sequence do not fit the pod's limit, naming both figures, instead of being OOM-killed.
            gguf_tiles=args.device == "cpu" and args.tensor_parallel_size == 1,
            gguf_q8_tiles=False,  # Q8_0 stays row-major on AVX2 (q8_tiles_enabled): 8.5 bits either way
            **given,
        )
        estimate = estimate_memory(model.resolve(), settings)
    except (EstimateError, ValueError, OSError) as e:
        log.warning("no memory estimate for %s: %s", model, e)
        return
    log.info(
        "memory estimate: %d bytes (weights %d, KV cache %d, overhead %d)",
        estimate.total_bytes,
        estimate.weight_bytes,
        estimate.kv_cache_bytes,
        estimate.runtime_overhead_bytes,
    )
    try:
        args.memory_estimate_file.write_text(estimate.to_json() + "\n")
    except OSError as e:
        log.warning("memory estimate not written to %s: %s", args.memory_estimate_file, e)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(message)s", force=True)
    cache_dir: Path = args.cache_dir or default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    try:
        if args.model.startswith("s3://"):
            if args.revision is not None:
                raise S3DownloadError(
                    "InvalidArguments", "--revision is for hub models (a prefix is one version)"
                )
            fetch_s3_model(args.model, cache_dir, args.output)
        else:
            fetch_model(args.model, args.revision, cache_dir, args.output)
        for repo, out in args.adapter:
            fetch_adapter(repo, cache_dir, out)
    except Exception as exc:
        if not _expected(exc):
            raise
        # The last line is what the Job's termination message (FallbackToLogsOnError) shows.
        one_line = " ".join(str(exc).split())
        print(f"download failed: {one_line}", file=sys.stderr, flush=True)
        return 1
    if args.memory_estimate_file is not None and args.output is not None:
        write_memory_estimate(args, args.output)
    log.info("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
