"""Process environment for torch's CPU runtime; read once by libgomp and oneDNN, so it must be in place
before torch loads (`server/__init__.py` applies it). A value the user set always wins.

OpenMP wait policy. Measured on the 2-core CI machine (fp32 SmolLM2, benchmarks/offline_throughput.py
and serve_load.py):
- libgomp's default (spin ~300k iterations, then sleep) starves the HTTP event loop and any neighbour
  process: torch slows 10-50x next to a busy process, and serving at 16 users drops ~25%;
- OMP_WAIT_POLICY=PASSIVE (sleep at once) wakes the workers with a futex for every op: in a decode
  step, where ops are small and many, that costs ~0.4 ms per op (a 64-row RMSNorm takes 0.5 ms
  instead of 0.07 ms);
- a short spin (GOMP_SPINCOUNT=20000, some tens of microseconds) covers the gap between consecutive
  ops of one forward pass and still sleeps as soon as the step ends: ~10% more offline throughput and
  ~15% more requests/s at 16 users than PASSIVE.

oneDNN caches. The pre-packed CPU matmuls (models/serving_weights.py) get a compiled primitive per
input row count, kept in two LRU caches (torch's ideep cache, LRU_CACHE_CAPACITY, and oneDNN's own,
ONEDNN_PRIMITIVE_CACHE_CAPACITY), 1024 entries each by default at ~0.3 MB an entry. A server sees a
new row count almost every step, so its memory grew by hundreds of MB before the caches filled
(tests/reliability soak: +22% RSS between requests 200 and 1000). 64 entries keep the ~5 shapes of a
step for the last dozen distinct batch sizes at no measurable cost in speed.

Heap (glibc malloc). A prefill step allocates and frees tens of activation and scratch tensors of 1-30 MB
(a 2048-token step: 26-58 thousand minor page faults per step, measured here); glibc serves each from a
fresh mmap and unmaps it on free, so every step pays the kernel to map and zero those pages again. With
the mmap threshold at 64 MiB and the trim threshold at 256 MiB (`mallopt`), freed blocks stay in the heap
for the next step: the 16-user 2048-token prefill step of the embedded SmolLM2 on a 2-core AMD EPYC (AVX-512)
went from 1.63-2.50 s (median 1.79) to 1.66-2.01 s (median 1.68) over 9 waves each, its faults to ~0
(docs/benchmarks.md). The cost: the heap keeps up to the largest step's working set mapped. Not applied
where the user tuned malloc (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, or malloc tunables in
GLIBC_TUNABLES) or where the C library has no `mallopt` that takes them (it returns 0: left as is).
The server runs engine steps on a thread of its own, and glibc gives each thread beyond the first an
arena of its own: heaps of at most 64 MiB, grown and unmapped apart from the main heap, so the thresholds
above did not hold there and every prefill step mapped its pages afresh (a 4,096-token prompt of a
Gemma-3-1B-shaped GGUF: 7.5 s in-process on the main thread, 10.8-11.2 s on another thread, 7.7 s there
with one arena; 2-core AMD EPYC Zen 5, 2026-12-05). So the arenas are limited to one (M_ARENA_MAX; our
threads allocate little outside the step, so they hardly contend for its lock), unless the user set
MALLOC_ARENA_MAX.

Thread count in a container. torch's default is the number of CPUs the process may run on (its affinity
mask), which in a Kubernetes pod with a CPU limit and no exclusive cpuset is every CPU of the node: a pod
limited to 2 CPUs on a 64-CPU node would start 64 OpenMP threads, and the CFS quota would stop all of
them for the rest of every period once 2 CPUs' worth was spent. So, unless the user set OMP_NUM_THREADS,
it is set to the CPU quota of our cgroup rounded down (at least 1) when that is below the affinity count:
cgroup v2 `cpu.max` ("QUOTA PERIOD" or "max PERIOD"), else cgroup v1 `cpu.cfs_quota_us` /
`cpu.cfs_period_us` (-1: no limit), read from the cgroup of this process (/proc/self/cgroup).
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
from pathlib import Path

DEFAULTS = {
    "GOMP_SPINCOUNT": "20000",
    "LRU_CACHE_CAPACITY": "64",
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64",
}


# mallopt parameters (glibc's malloc.h) and the values set (module docstring, "Heap")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
MMAP_THRESHOLD_BYTES = 64 << 20
TRIM_THRESHOLD_BYTES = 256 << 20
MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def configure_malloc() -> bool:
    """Keeps freed blocks below 64 MiB in the heap (module docstring, "Heap"); True where it took effect.
    False, changing nothing, where the user tuned malloc or the C library does not take these settings."""
    if any(k in os.environ for k in MALLOC_ENV) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # The trim threshold first: set alone it is harmless; the mmap threshold alone would grow the heap.
    done = bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)) and bool(
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    )
    if done and "MALLOC_ARENA_MAX" not in os.environ:
        mallopt(M_ARENA_MAX, 1)  # the step thread's blocks in the main heap too (module docstring)
    return done


def release_free_heap(collect: bool = True) -> int | None:
    """Hands the heap's free pages back to the OS (glibc `malloc_trim(0)`, after a garbage collection
    when `collect`); the resident bytes released, None where the C library has no `malloc_trim` (not
    glibc).

    The thresholds above keep what a step frees in the heap; what loading frees (a GGUF's row-major
    reads, a 262,144-entry tokenizer's JSON parse: ~80 MiB; the warm-up's first steps) would stay
    resident for the server's life. Called after the loader's phases and once the engine is warm
    (`LLMEngine.warmup`): a Gemma-3-1B Q4_K_M server 1,535 -> 1,437 MiB (2026-12-05); and, without
    the collection, by the engine loop once it has been idle a while (`LLMEngine.release_idle_memory`)."""
    import gc

    if collect:
        gc.collect()
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    before = _rss_bytes()
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return None if before is None else max(0, before - (_rss_bytes() or before))


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def configure_cpu_runtime() -> None:
    configure_malloc()
    for key, value in DEFAULTS.items():
        if key == "GOMP_SPINCOUNT" and "OMP_WAIT_POLICY" in os.environ:
            continue  # the user chose a wait policy; a spin count would override part of it
        os.environ.setdefault(key, value)
    if "OMP_NUM_THREADS" not in os.environ:
        threads = container_thread_count(cgroup_cpu_limit(), _available_cpus())
        if threads is not None:
            os.environ["OMP_NUM_THREADS"] = str(threads)


def cgroup_cpu_limit(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> float | None:
    """This process's CPU quota in CPUs (e.g. 1.5), or None when unlimited or unreadable.
    cgroup v2 `cpu.max` of our group (the unified hierarchy's `0::/path` line), else v1's cpu controller
    `cpu.cfs_quota_us` / `cpu.cfs_period_us`; the group's own file first, then the mount root's (a
    container usually sees only its own group at the root)."""
    v2_path, v1_path = _cgroup_paths(proc_cgroup, "cpu")
    for base in (root / v2_path.lstrip("/"), root):
        try:
            quota, period = (base / "cpu.max").read_text().split()[:2]
        except (OSError, ValueError):
            continue
        if quota == "max":
            return None
        try:
            q, p = int(quota), int(period)
        except ValueError:
            return None
        return q / p if q > 0 and p > 0 else None
    for cpu_dir in (root / "cpu,cpuacct", root / "cpu"):
        for base in (cpu_dir / v1_path.lstrip("/"), cpu_dir):
            try:
                q = int((base / "cpu.cfs_quota_us").read_text())
                p = int((base / "cpu.cfs_period_us").read_text())
            except (OSError, ValueError):
                continue
            return q / p if q > 0 and p > 0 else None
    return None


def _cgroup_paths(proc_cgroup: Path, controller: str) -> tuple[str, str]:
    """(cgroup v2 path, cgroup v1 path of `controller`) of this process, "" where absent."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    v2_path, v1_path = "", ""
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2_path = parts[2]
        elif controller in parts[1].split(","):
            v1_path = parts[2]
    return v2_path, v1_path


def cgroup_memory_headroom(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> int | None:
    """Bytes this process's memory cgroup may still charge (limit - usage, at least 0), or None when
    unlimited or unreadable: cgroup v2 `memory.max` - `memory.current`, else v1 `memory.limit_in_bytes` -
    `memory.usage_in_bytes` (a limit of 2^60 or more: none); the group's own files first, then the mount
    root's, as cgroup_cpu_limit reads them. A container's /proc/meminfo shows the node's memory, not this."""
    v2_path, v1_path = _cgroup_paths(proc_cgroup, "memory")
    pairs = [(base, "memory.max", "memory.current") for base in (root / v2_path.lstrip("/"), root)]
    mem = root / "memory"
    pairs += [
        (base, "memory.limit_in_bytes", "memory.usage_in_bytes") for base in (mem / v1_path.lstrip("/"), mem)
    ]
    for base, limit_file, usage_file in pairs:
        try:
            raw = (base / limit_file).read_text().strip()
        except OSError:
            continue
        if raw == "max":
            return None
        try:
            limit, usage = int(raw), int((base / usage_file).read_text().strip())
        except (OSError, ValueError):
            return None
        return None if limit >= 1 << 60 else max(0, limit - usage)
    return None


def available_memory_bytes(
    meminfo: Path = Path("/proc/meminfo"),
    root: Path = Path("/sys/fs/cgroup"),
    proc_cgroup: Path = Path("/proc/self/cgroup"),
) -> int | None:
    """What this process can still allocate: the smaller of /proc/meminfo's MemAvailable and its memory
    cgroup's headroom (cgroup_memory_headroom); None when neither can be read."""
    avail = None
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        avail = None
    headroom = cgroup_memory_headroom(root, proc_cgroup)
    known = [v for v in (avail, headroom) if v is not None]
    return min(known) if known else None


def container_thread_count(limit: float | None, available: int) -> int | None:
    """OMP_NUM_THREADS for a CPU quota of `limit` CPUs when `available` CPUs are in the affinity mask:
    the quota rounded down, at least 1; None when there is no quota or it does not bind."""
    if limit is None:
        return None
    threads = max(1, math.floor(limit))
    return threads if threads < available else None


def usable_cpus() -> int:
    """The CPUs this process may keep busy: its CPU quota rounded down where one binds, else the affinity
    mask's count (for sizing pools of worker processes, such as the kernels' compilers)."""
    available = _available_cpus()
    return container_thread_count(cgroup_cpu_limit(), available) or available


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
