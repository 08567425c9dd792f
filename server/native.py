"""Builds our C++ kernels (plain C ABI, no torch headers) once per source, flags and CPU, and loads them.

Shared by every compiled kernel (server/attention/csrc, server/quant/csrc): each is one .cpp file compiled
for this CPU (-march=native, so the AVX2 or AVX-512 code paths are chosen when the kernel is built on the
machine that runs it), linked into a shared library under `<cache>/kernels/`, and called via ctypes.
The cache key holds the source, the flags and the CPU's feature flags: a library built once (say, into
a cache volume) loads on a machine with the same CPU features and no compiler at all.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


class KernelBuildError(RuntimeError):
    pass


@dataclass(frozen=True)
class NativeSource:
    """One kernel: its .cpp file and how to compile and link it."""

    name: str  # library file stem, e.g. "paged_decode"
    source: Path
    compile_flags: tuple[str, ...]
    link_flags: tuple[str, ...] = ("-shared", "-fopenmp")
    # What `kubeinfer_<name>_abi()` must return: a library built from another version of the source
    # (same cache key only if the source matched, but a stale file can be copied in) is refused.
    abi_version: int | None = None


def compiler() -> str:
    if cxx := os.environ.get("CXX"):
        if path := shutil.which(cxx):
            return path
        raise KernelBuildError(f"CXX={cxx!r} is not an executable C++ compiler")
    for candidate in ("g++", "c++", "clang++"):
        if path := shutil.which(candidate):
            return path
    raise KernelBuildError("no C++ compiler found (install g++, or set CXX)")


def cpu_identity() -> str:
    # -march=native code is only valid on a CPU with the same features: a cache folder on a shared
    # volume may be read from nodes with different CPUs.
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def library_path(src: NativeSource, cache_dir: Path) -> Path:
    key = hashlib.sha256()
    for part in (
        src.source.read_bytes(),
        repr(src.compile_flags + src.link_flags).encode(),
        cpu_identity().encode(),
    ):
        key.update(part)
        key.update(b"\0")
    return cache_dir / "kernels" / f"{src.name}-{key.hexdigest()[:20]}.so"


def build(src: NativeSource, cxx: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        obj, lib = Path(tmp) / f"{src.name}.o", Path(tmp) / target.name
        for cmd in (
            [cxx, *src.compile_flags, "-c", str(src.source), "-o", str(obj)],
            [cxx, *src.link_flags, str(obj), "-o", str(lib)],
        ):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise KernelBuildError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()[-2000:]}")
        os.replace(lib, target)  # atomic: concurrent builders each publish a complete library


def load_library(src: NativeSource, cache_dir: Path) -> tuple[ctypes.CDLL, Path]:
    """Builds (unless cached) and loads `src`; raises KernelBuildError saying why it cannot (including
    an ABI version other than `src.abi_version`)."""
    path = library_path(src, cache_dir)
    if not path.is_file():
        log.info("building the %s kernel into %s", src.name, path)
        build(src, compiler(), path)
    lib = ctypes.CDLL(str(path))
    if src.abi_version is not None:
        abi = getattr(lib, f"kubeinfer_{src.name}_abi")()
        if abi != src.abi_version:
            raise KernelBuildError(f"{path} reports ABI {abi}, expected {src.abi_version}")
    return lib, path
