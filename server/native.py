"""Builds our C++ kernels (plain C ABI, no torch headers) once per source, flags and CPU, and loads them.

Shared by every compiled kernel (server/attention/csrc, server/quant/csrc): each is one .cpp file compiled
for this CPU (-march=native, so the AVX2 or AVX-512 code paths are chosen when the kernel is built on the
machine that runs it), linked into a shared library under `<cache>/kernels/`, and called via ctypes.
The cache key holds the source, the flags and the CPU's feature flags: a library built once (say, into
a cache volume) loads on a machine with the same CPU features and no compiler at all.

"-march=native" reads CPUID, which may list what the OS never enabled (AVX-512 state off in XCR0, AMX
without the Linux tile permission: SIGILL at the first such instruction). So it is expanded with -mno-*
flags for every feature `usable_cpu_features()` reports unusable (server/cpu_features.py), read by a
tiny probe (server/csrc/cpu_probe.cpp, built without -march flags), and those features are in the key.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from server.cpu_features import CpuFeatures, CpuRegisters, apply_disable, decode, march_flags

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
    # False for code that must run on any CPU of the architecture (the CPU probe itself): neither the
    # CPU's features nor -march expansion enter its build.
    cpu_specific: bool = True


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


PROBE = NativeSource(
    "cpu_probe",
    Path(__file__).with_name("csrc") / "cpu_probe.cpp",
    ("-O2", "-fPIC", "-std=c++17"),
    ("-shared",),
    abi_version=1,
    cpu_specific=False,
)


@functools.cache
def probe_registers(cache_dir: Path | None = None) -> CpuRegisters:
    """CPUID, XCR0 and the AMX permission as the probe reads them (built once under `cache_dir`, default
    the kubeinfer cache folder); all zero off x86-64. Raises KernelBuildError when it cannot be built."""
    from server.config import default_cache_dir

    lib, _ = load_library(PROBE, cache_dir or default_cache_dir())
    words = (ctypes.c_uint32 * 9)()
    lib.kubeinfer_cpu_probe.restype = ctypes.c_int32
    lib.kubeinfer_cpu_probe.argtypes = [ctypes.c_void_p]
    lib.kubeinfer_cpu_probe(ctypes.addressof(words))
    w = list(words)
    return CpuRegisters(
        leaf1_ecx=w[0],
        leaf1_edx=w[1],
        leaf7_ebx=w[2],
        leaf7_ecx=w[3],
        leaf7_edx=w[4],
        leaf7_1_eax=w[5],
        xcr0=w[6] | (w[7] << 32),
        amx_permission=ctypes.c_int32(w[8]).value,
    )


def usable_cpu_features(cache_dir: Path | None = None) -> CpuFeatures:
    """The features this process may use: CPUID gated by XCR0 and the AMX permission, minus
    KUBEINFER_CPU_DISABLE (read on every call, so tests can change it). Raises KernelBuildError when
    the probe cannot be built (no compiler: then no kernel can be built either) and ValueError for an
    unknown name in KUBEINFER_CPU_DISABLE."""
    return apply_disable(decode(probe_registers(cache_dir)))


def is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def effective_compile_flags(src: NativeSource, cache_dir: Path) -> tuple[str, ...]:
    """`src.compile_flags` with "-march=native" expanded to exclude the unusable features."""
    if not src.cpu_specific or "-march=native" not in src.compile_flags:
        return src.compile_flags
    march = march_flags(usable_cpu_features(cache_dir), x86=is_x86_64())
    out: list[str] = []
    for flag in src.compile_flags:
        out.extend(march if flag == "-march=native" else (flag,))
    return tuple(out)


def library_path(src: NativeSource, cache_dir: Path) -> Path:
    key = hashlib.sha256()
    parts = [src.source.read_bytes(), repr(effective_compile_flags(src, cache_dir) + src.link_flags).encode()]
    if src.cpu_specific:
        parts += [cpu_identity().encode(), usable_cpu_features(cache_dir).key().encode()]
    for part in parts:
        key.update(part)
        key.update(b"\0")
    return cache_dir / "kernels" / f"{src.name}-{key.hexdigest()[:20]}.so"


def build(src: NativeSource, cxx: str, target: Path, compile_flags: tuple[str, ...] | None = None) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        obj, lib = Path(tmp) / f"{src.name}.o", Path(tmp) / target.name
        for cmd in (
            [
                cxx,
                *(src.compile_flags if compile_flags is None else compile_flags),
                "-c",
                str(src.source),
                "-o",
                str(obj),
            ],
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
        build(src, compiler(), path, effective_compile_flags(src, cache_dir))
    lib = ctypes.CDLL(str(path))
    if src.abi_version is not None:
        abi = getattr(lib, f"kubeinfer_{src.name}_abi")()
        if abi != src.abi_version:
            raise KernelBuildError(f"{path} reports ABI {abi}, expected {src.abi_version}")
    return lib, path
