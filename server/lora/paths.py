"""Where the run-time route `POST /v1/load_lora_adapter` may read adapters from.

A client names a `lora_path`; without a fence the server would stat (and answer about) any path on its
filesystem. Like vLLM's `--allowed-local-media-path`, local adapter folders must lie under configured
roots (`--lora-allowed-paths`; by default the adapter paths given at startup in `--lora-modules` and the
server's cache dir, where hub adapters land). The check runs on the path with symlinks and `..`
resolved (`os.path.realpath`), for the folder and for the two files the loader reads in it, so a link
inside a root cannot point outside it. Every refusal outside the roots - missing, not a folder,
outside, a link out, no adapter files - is the same `AdapterPathRefused` with the same message, so
the answer never tells whether a path exists. A hub repo id (`org/name`) is not a local path: it is
fetched into the cache dir (a root) as before.
"""

from __future__ import annotations

import os
import re
import unicodedata
from collections.abc import Iterable
from pathlib import Path

from server.config import LoRAConfig

from .adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS

# PATH_MAX on Linux is 4096 bytes; no adapter folder needs more than this, and longer input made
# `os.stat` raise ENAMETOOLONG (a 500 before this check).
MAX_PATH_CHARS = 1024
MAX_NAME_CHARS = 256
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


class AdapterPathRefused(ValueError):
    """The path is not a loadable adapter folder under the allowed roots (one message for every cause)."""

    def __init__(self, path: str) -> None:
        shown = path if len(path) <= 200 else path[:200] + "..."
        super().__init__(
            f"No adapter found for {shown!r} under the allowed adapter paths (--lora-allowed-paths)"
        )


class AdapterInputError(ValueError):
    """A name or path that is malformed whatever the filesystem holds (too long, NUL, control chars);
    `field` is the request field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def allowed_roots(config: LoRAConfig, cache_dir: Path) -> tuple[Path, ...]:
    """`--lora-allowed-paths`, else the startup adapters' local folders (`--lora-modules`, hub ids
    skipped); the cache dir always (hub adapters are fetched there)."""
    if config.allowed_paths:
        given: Iterable[str] = config.allowed_paths
    else:
        given = (m.path for m in config.lora_modules if not is_hub_id(m.path))
    return (cache_dir, *(Path(p).expanduser() for p in given))


def is_hub_id(path: str) -> bool:
    """`org/name` as the hub spells repo ids (never absolute, never starting with `.` or `~`)."""
    return _HUB_ID.fullmatch(path) is not None and not path.startswith((".", "~")) and ".." not in path


# Unicode categories refused in names and paths: Cc (C0/C1 controls), Cf (format: the bidirectional
# overrides and isolates U+202A-202E and U+2066-2069 that make a name display as another - "Trojan
# Source", CVE-2021-42574 - and zero-width characters), Zl/Zp (line/paragraph separators), Co/Cn.
_INVISIBLE = frozenset({"Cc", "Cf", "Zl", "Zp", "Co", "Cn"})


def check_input(name: str, path: str) -> None:
    """Raises AdapterInputError for a name or path no filesystem lookup should see."""
    if len(name) > MAX_NAME_CHARS:
        raise AdapterInputError("lora_name", f"'lora_name' is longer than {MAX_NAME_CHARS} characters")
    if len(path) > MAX_PATH_CHARS:
        raise AdapterInputError("lora_path", f"'lora_path' is longer than {MAX_PATH_CHARS} characters")
    for field, value in (("lora_name", name), ("lora_path", path)):
        if any(unicodedata.category(c) in _INVISIBLE for c in value):
            raise AdapterInputError(
                field,
                f"'{field}' holds a control, format (e.g. bidirectional override) or separator character",
            )


def _within(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def confine(path: str, roots: Iterable[Path]) -> Path:
    """The real (symlink- and `..`-free) adapter folder for a local `path`, if it and the adapter files
    in it lie under one of `roots`. Raises AdapterPathRefused otherwise (the same for every cause).
    Call check_input first."""
    real_roots = tuple(os.path.realpath(os.path.expanduser(str(r))) for r in roots)
    try:
        folder = os.path.realpath(os.path.expanduser(path))
    except (OSError, ValueError):
        raise AdapterPathRefused(path) from None
    if not _within(folder, real_roots):  # decided before anything under the path is looked at
        raise AdapterPathRefused(path)
    try:
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            file = os.path.realpath(os.path.join(folder, name))
            if not _within(file, real_roots) or not os.path.isfile(file):
                raise AdapterPathRefused(path)
    except OSError:
        raise AdapterPathRefused(path) from None
    return Path(folder)
