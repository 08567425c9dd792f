"""The CPU runtime environment the server sets before torch loads, and that a user's choice wins."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from server import cpu_env
from server.cpu_env import DEFAULTS, cgroup_cpu_limit, configure_cpu_runtime, container_thread_count

KEYS = ("OMP_WAIT_POLICY", *DEFAULTS)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for key in KEYS:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_defaults_fill_an_empty_environment(clean_env: pytest.MonkeyPatch) -> None:
    configure_cpu_runtime()
    assert {k: os.environ[k] for k in DEFAULTS} == DEFAULTS


def test_a_user_wait_policy_suppresses_the_spin_count(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("OMP_WAIT_POLICY", "PASSIVE")
    clean_env.setenv("LRU_CACHE_CAPACITY", "7")
    configure_cpu_runtime()
    assert "GOMP_SPINCOUNT" not in os.environ
    assert os.environ["LRU_CACHE_CAPACITY"] == "7"
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == DEFAULTS["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]


def test_importing_any_server_module_applies_it_before_torch_loads() -> None:
    env = {k: v for k, v in os.environ.items() if k not in KEYS}
    code = (
        "import sys, os; import server.engine; "
        "assert 'torch' in sys.modules; print(os.environ['GOMP_SPINCOUNT'], os.environ['LRU_CACHE_CAPACITY'])"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [DEFAULTS["GOMP_SPINCOUNT"], DEFAULTS["LRU_CACHE_CAPACITY"]]


def _cgroup(tmp_path: Path, lines: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(lines)
    return root, proc


@pytest.mark.parametrize(
    ("lines", "files", "limit"),
    [
        # cgroup v2, a pod's own group seen at the root of the container's mount
        ("0::/\n", {"cpu.max": "200000 100000\n"}, 2.0),
        ("0::/\n", {"cpu.max": "150000 100000\n"}, 1.5),
        ("0::/\n", {"cpu.max": "max 100000\n"}, None),
        # cgroup v2 with the group's path visible (a host process in a slice)
        (
            "0::/kubepods/pod1/c1\n",
            {"kubepods/pod1/c1/cpu.max": "400000 100000\n", "cpu.max": "max 100000\n"},
            4.0,
        ),
        # cgroup v1, joined cpu,cpuacct controller
        (
            "3:cpu,cpuacct:/\n0::/\n",
            {"cpu,cpuacct/cpu.cfs_quota_us": "300000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
            3.0,
        ),
        ("1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ("", {}, None),  # nothing readable: no limit assumed
    ],
)
def test_cgroup_cpu_limit(tmp_path: Path, lines: str, files: dict[str, str], limit: float | None) -> None:
    root, proc = _cgroup(tmp_path, lines, files)
    assert cgroup_cpu_limit(root, proc) == limit


def test_thread_count_follows_a_binding_quota() -> None:
    assert container_thread_count(2.0, 64) == 2
    assert container_thread_count(1.5, 64) == 1  # rounded down: 2 threads would be throttled every period
    assert container_thread_count(0.25, 64) == 1
    assert container_thread_count(4.0, 2) is None  # the quota does not bind: torch's default stands
    assert container_thread_count(None, 64) is None


def test_usable_cpus_is_a_binding_quota_else_the_affinity_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    # the kernels' prebuild sizes its compilers by it: a 64-CPU node with a 2-CPU quota runs 2, not 37
    monkeypatch.setattr(cpu_env, "_available_cpus", lambda: 64)
    monkeypatch.setattr(cpu_env, "cgroup_cpu_limit", lambda: 2.5)
    assert cpu_env.usable_cpus() == 2
    monkeypatch.setattr(cpu_env, "cgroup_cpu_limit", lambda: None)
    assert cpu_env.usable_cpus() == 64
    monkeypatch.setattr(cpu_env, "_available_cpus", lambda: 2)
    monkeypatch.setattr(cpu_env, "cgroup_cpu_limit", lambda: 8.0)  # the quota does not bind
    assert cpu_env.usable_cpus() == 2


def test_a_cpu_quota_sets_omp_num_threads_unless_the_user_did(
    clean_env: pytest.MonkeyPatch,
) -> None:
    import server.cpu_env as cpu_env

    clean_env.setenv("OMP_NUM_THREADS", "0")  # recorded, so teardown restores the real value (or its absence)
    clean_env.delenv("OMP_NUM_THREADS")
    clean_env.setattr(cpu_env, "cgroup_cpu_limit", lambda: 1.0)
    clean_env.setattr(cpu_env, "_available_cpus", lambda: 8)
    configure_cpu_runtime()
    assert os.environ["OMP_NUM_THREADS"] == "1"
    clean_env.setenv("OMP_NUM_THREADS", "3")
    configure_cpu_runtime()
    assert os.environ["OMP_NUM_THREADS"] == "3"


_FAULTS = """
import resource
import server  # noqa: F401  (applies the CPU runtime settings, the heap's included)
import torch

def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def step() -> None:  # a prefill step's pattern: tensors of 8-40 MiB allocated, written, all freed
    ts = [torch.empty(n << 20).fill_(1.0) for n in (10, 2, 3)]
    del ts

for _ in range(10):  # the heap settles within 3-6 steps (6 in ~1 of 6 runs with one arena)
    step()
before = faults()
for _ in range(3):
    step()
print(faults() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_large_tensors_stay_mapped_for_the_next_step() -> None:
    """Steps that each allocate and free 60 MiB of tensors, one of 40 MiB (above the 32 MiB up to which
    glibc's own threshold adapts): with the heap setting, after the first few steps no page is mapped
    afresh (seen: 10-13 thousand faults per step without it, 0 with it); a user's own setting wins."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    ours = subprocess.run(
        [sys.executable, "-c", _FAULTS], env=env, capture_output=True, text=True, check=True
    )
    assert int(ours.stdout.split()[-1]) < 1000, ours.stdout
    env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)  # the user's choice: mmap from 1 MiB
    theirs = subprocess.run(
        [sys.executable, "-c", _FAULTS], env=env, capture_output=True, text=True, check=True
    )
    assert int(theirs.stdout.split()[-1]) >= 3 * 10_000, theirs.stdout


_ARENAS = """
import ctypes
import threading

import server  # noqa: F401  (the CPU runtime settings, the heap's included)
import torch

def step() -> None:  # a step's tensor, allocated and freed on a thread other than the main one
    t = torch.empty(8 << 20).fill_(1.0)
    del t

thread = threading.Thread(target=step)
thread.start()
thread.join()
libc = ctypes.CDLL("libc.so.6")
libc.fdopen.restype = ctypes.c_void_p
out = libc.fdopen(1, b"w")
libc.malloc_info(0, ctypes.c_void_p(out))  # glibc's XML report: one <heap nr=...> per arena
libc.fflush(ctypes.c_void_p(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_step_thread_allocates_from_the_main_heap() -> None:
    """The server runs engine steps on a thread of its own, and glibc gives such a thread an arena of its
    own (heaps of at most 64 MiB, grown and unmapped apart from the main heap's thresholds), where prefill
    steps kept mapping their pages afresh: 2,000-token prompts of the embedded model after two warm-up
    prompts took [405, 3, 12516, 12010] or [1228, 1, 3, 11] page faults each, a 4,096-token prompt of a
    Gemma-3-1B-shaped GGUF 7.5 s on the main thread and 10.8-11.2 s on another (7.7 s there with one
    arena; 2026-12-05). With our settings such a thread allocates from the one main arena; a user's
    MALLOC_ARENA_MAX wins."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    ours = subprocess.run(
        [sys.executable, "-c", _ARENAS], env=env, capture_output=True, text=True, check=True
    )
    assert ours.stdout.count("<heap nr=") == 1, ours.stdout[:400]
    env["MALLOC_ARENA_MAX"] = "8"
    theirs = subprocess.run(
        [sys.executable, "-c", _ARENAS], env=env, capture_output=True, text=True, check=True
    )
    assert theirs.stdout.count("<heap nr=") > 1, theirs.stdout[:400]


_FREED_HEAP = """
import server  # noqa: F401  (the CPU runtime settings: freed blocks stay in the heap up to 256 MiB)
from server.cpu_env import _rss_bytes, release_free_heap

held = [bytearray(1 << 20) for _ in range(160)]  # 160 MiB of 1 MiB blocks, below the mmap threshold
del held
before = _rss_bytes()
released = release_free_heap()
print(before, _rss_bytes(), released)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_release_free_heap_returns_what_was_freed() -> None:
    """The heap keeps what is freed below the trim threshold (the settings above) for the next step;
    what loading freed would stay resident for the server's life, so the engine hands it back once warm
    (a Gemma-3-1B Q4_K_M server 1,535 -> 1,437 MiB). 160 MiB freed: RSS drops by most of it and the
    function says how much."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", _FREED_HEAP], env=env, capture_output=True, text=True, check=True
    )
    before, after, released = (int(x) for x in out.stdout.split())
    assert before - after > 120 << 20, out.stdout
    assert abs(released - (before - after)) < 8 << 20, out.stdout


@pytest.mark.parametrize(
    "lines,files,headroom",
    [
        ("0::/\n", {"memory.max": "1073741824\n", "memory.current": "805306368\n"}, 268435456),  # v2
        ("0::/\n", {"memory.max": "max\n", "memory.current": "5\n"}, None),
        ("0::/\n", {"memory.max": "100\n", "memory.current": "150\n"}, 0),  # over the limit: nothing left
        (
            "0::/kubepods/pod1/c1\n",
            {
                "kubepods/pod1/c1/memory.max": "2000\n",
                "kubepods/pod1/c1/memory.current": "500\n",
                "memory.max": "max\n",
            },
            1500,
        ),
        (  # v1, and v1's "unlimited" (a page-rounded 2^63)
            "4:memory:/\n",
            {"memory/memory.limit_in_bytes": "3000\n", "memory/memory.usage_in_bytes": "1000\n"},
            2000,
        ),
        (
            "4:memory:/\n",
            {"memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": "1\n"},
            None,
        ),
        ("", {}, None),
    ],
)
def test_cgroup_memory_headroom(
    tmp_path: Path, lines: str, files: dict[str, str], headroom: int | None
) -> None:
    root, proc = _cgroup(tmp_path, lines, files)
    assert cpu_env.cgroup_memory_headroom(root, proc) == headroom


def test_available_memory_is_the_smaller_of_meminfo_and_the_cgroup(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    2000000 kB\n")
    root, proc = _cgroup(tmp_path, "0::/\n", {"memory.max": "1000000\n", "memory.current": "400000\n"})
    assert cpu_env.available_memory_bytes(meminfo, root, proc) == 600000  # a pod's limit binds
    root, proc = _cgroup(tmp_path / "b", "0::/\n", {"memory.max": "max\n"})
    assert cpu_env.available_memory_bytes(meminfo, root, proc) == 2000000 * 1024
    assert cpu_env.available_memory_bytes(tmp_path / "none", root, proc) is None
