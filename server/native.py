"""Builds our C++ kernels (plain C ABI, no torch headers) once per source, flags and CPU, and loads them.

Shared by every compiled kernel (server/attention/csrc, server/quant/csrc): each is one .cpp file compiled
for this CPU (-march=native, so the AVX2 or AVX-512 code paths are chosen when the kernel is built on the
machine that runs it), linked into a shared library under `<cache>/kernels/`, and called via ctypes.
The cache key holds the source, the flags and the CPU's feature flags: a library built once (say, into
a cache volume) loads on a machine with the same CPU features and no compiler at all.

Images have no compiler and a read-only root filesystem, and must serve on any x86-64 node. So an image
builds each kernel ahead of time once per x86-64 micro-architecture level (`prebuild`, the levels of
`VARIANTS`: -march=x86-64-v4 for AVX-512, v3 for AVX2+FMA, v2, and the x86-64 baseline) into the folder
$KUBEINFER_PREBUILT_KERNELS names, and `load_library` dispatches at run time: it loads the highest level
whose CPU features /proc/cpuinfo lists. Only when none is there (another source, flags or CPU family) does
it compile for this CPU into the cache as above. The levels are the psABI's (x86-64 psABI 1.0, section
3.1.1, "Micro-architecture levels"), which gcc >= 11 and clang >= 12 accept as -march values.
The CPU probe (below) is prebuilt once for any x86-64 CPU (`ANY`), and the level is chosen from the
cpuinfo flags less the features the OS has not enabled (`runnable_cpu_flags`).

"-march=native" reads CPUID, which may list what the OS never enabled (AVX-512 state off in XCR0, AMX
without the Linux tile permission: SIGILL at the first such instruction). So it is expanded with -mno-*
flags for every feature `usable_cpu_features()` reports unusable (server/cpu_features.py), read by a
tiny probe (server/csrc/cpu_probe.cpp, built without -march flags), and those features are in the key.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
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

from server.cpu_env import usable_cpus
from server.cpu_features import CpuFeatures, CpuRegisters, apply_disable, decode, march_flags

log = logging.getLogger(__name__)

PREBUILT_ENV = "KUBEINFER_PREBUILT_KERNELS"


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


@dataclass(frozen=True)
class Variant:
    """One ahead-of-time build: its -march value and the /proc/cpuinfo flags a CPU needs to run it."""

    march: str
    cpu_flags: frozenset[str]


_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "ssse3", "sse4_1", "sse4_2"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# Code that runs on any x86-64 CPU (NativeSource.cpu_specific False: the CPU probe) is prebuilt once.
ANY = Variant("any", frozenset())
# Best first: load_library takes the first one the CPU can run.
VARIANTS = (
    Variant("x86-64-v4", _V4),
    Variant("x86-64-v3", _V3),
    Variant("x86-64-v2", _V2),
    Variant("x86-64", frozenset()),
)


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


def cpu_flags() -> frozenset[str]:
    return frozenset(cpu_identity().partition(":")[2].split())


def variant_flags(src: NativeSource, variant: Variant) -> tuple[str, ...]:
    """`src`'s compile flags with -march=native replaced by the variant's level (and -mtune=generic)."""
    flags = tuple(f"-march={variant.march}" if f == "-march=native" else f for f in src.compile_flags)
    return (*flags, "-mtune=generic")


def prebuilt_path(src: NativeSource, variant: Variant, folder: Path) -> Path:
    """Keyed by source and flags, like library_path, but not by the CPU: the variant names the CPUs."""
    key = hashlib.sha256()
    for part in (src.source.read_bytes(), repr(variant_flags(src, variant) + src.link_flags).encode()):
        key.update(part)
        key.update(b"\0")
    return folder / variant.march / f"{src.name}-{key.hexdigest()[:20]}.so"


def prebuild(sources: tuple[NativeSource, ...], folder: Path) -> list[Path]:
    """Builds every source for every x86-64 level into `folder` (an image's build step); returns the
    libraries. Raises KernelBuildError on a non-x86-64 machine or when a build fails."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise KernelBuildError(f"prebuilt kernels are built for x86-64 levels, not {platform.machine()}")
    cxx = compiler()
    jobs = [
        (
            NativeSource(src.name, src.source, variant_flags(src, variant), src.link_flags),
            prebuilt_path(src, variant, folder),
        )
        for src in sources
        for variant in (VARIANTS if src.cpu_specific else (ANY,))
    ]
    # one compiler a CPU (the quota's, in a container): 37 builds, ~115 CPU-seconds on a Zen 4 (an image
    # build, the prebuilt tests)
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(jobs), usable_cpus())) as pool:
        futures = [pool.submit(build, job, cxx, target) for job, target in jobs]
        try:
            for done in futures:
                done.result()  # the first failure, in the sources' order
        except BaseException:
            pool.shutdown(cancel_futures=True)  # the queued builds are not started
            raise
    return [target for _, target in jobs]


def find_prebuilt(src: NativeSource, folder: Path, flags: frozenset[str]) -> Path | None:
    """The library of the best level a CPU with `flags` runs, or None."""
    for variant in VARIANTS if src.cpu_specific else (ANY,):
        if variant.cpu_flags <= flags:
            path = prebuilt_path(src, variant, folder)
            if path.is_file():
                return path
    return None


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


def env_switch(name: str) -> bool | None:
    """A kernel path's on/off environment switch: `1` True, `0` False, unset or empty None (the caller's
    default), surrounding whitespace ignored. Read where used (tests flip switches per case). Raises
    ValueError for another value."""
    raw = os.environ.get(name, "").strip()
    if raw == "":
        return None
    if raw not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
    return raw == "1"


def is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def runnable_cpu_flags(cache_dir: Path) -> frozenset[str]:
    """/proc/cpuinfo's flags less the features the OS has not enabled or KUBEINFER_CPU_DISABLE turns
    off (the probe's `usable_cpu_features`): what picks a prebuilt level. The feature names are
    cpuinfo's; "avx" goes with the AVX state (no usable avx2, fma or f16c)."""
    usable = usable_cpu_features(cache_dir)
    unusable = {f.name for f in dataclasses.fields(usable) if not getattr(usable, f.name)}
    if not (usable.avx2 or usable.fma or usable.f16c):
        unusable.add("avx")
    return cpu_flags() - unusable


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
    """Loads `src` prebuilt for this CPU's x86-64 level from $KUBEINFER_PREBUILT_KERNELS, else builds it
    for this CPU (unless cached) under `cache_dir`; raises KernelBuildError saying why it cannot
    (including an ABI version other than `src.abi_version`)."""
    prebuilt = os.environ.get(PREBUILT_ENV)
    found = None
    if prebuilt:
        flags = runnable_cpu_flags(cache_dir) if src.cpu_specific else frozenset()
        found = find_prebuilt(src, Path(prebuilt), flags)
    path = found or library_path(src, cache_dir)
    if found is not None:
        log.info("loading the prebuilt %s kernel %s", src.name, found)
    elif not path.is_file():
        log.info("building the %s kernel into %s", src.name, path)
        build(src, compiler(), path, effective_compile_flags(src, cache_dir))
    lib = ctypes.CDLL(str(path))
    if src.abi_version is not None:
        abi = getattr(lib, f"kubeinfer_{src.name}_abi")()
        if abi != src.abi_version:
            raise KernelBuildError(f"{path} reports ABI {abi}, expected {src.abi_version}")
    return lib, path
