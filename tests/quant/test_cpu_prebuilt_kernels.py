"""Kernels prebuilt per x86-64 level (as the CPU server image has them) and chosen at run time by the CPU's
flags (server/native.py): an AVX2-only CPU gets the x86-64-v3 build, an AVX-512 one the v4 build, and each
level this CPU can run computes what the torch reference does."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from server import native
from server.prebuild_kernels import main as prebuild_main
from server.quant import cpu_qlinear as cq

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 levels only")

AVX2_ONLY = native.VARIANTS[1].cpu_flags | {"sse", "sse2", "fpu"}  # e.g. a Haswell..Alder Lake CPU
AVX512 = native.VARIANTS[0].cpu_flags | {"avx512_bf16", "avx512_vnni", "amx_tile"}


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("prebuilt")
    assert prebuild_main([str(folder)]) == 0  # what Dockerfile.server runs
    return folder


def level_of(path: Path) -> str:
    return path.parent.name


@pytest.mark.parametrize(
    ("flags", "level"),
    [
        (AVX512, "x86-64-v4"),
        (AVX2_ONLY, "x86-64-v3"),
        (native.VARIANTS[2].cpu_flags, "x86-64-v2"),
        (frozenset(), "x86-64"),
    ],
)
def test_the_best_level_the_cpu_runs_is_chosen(prebuilt: Path, flags: frozenset[str], level: str) -> None:
    found = native.find_prebuilt(cq.NATIVE, prebuilt, flags)
    assert found is not None and level_of(found) == level


def test_a_missing_level_falls_back_to_the_next_lower_one(prebuilt: Path, tmp_path: Path) -> None:
    v4 = native.prebuilt_path(cq.NATIVE, native.VARIANTS[0], prebuilt)
    partial = tmp_path / "partial"
    (partial / "x86-64-v3").mkdir(parents=True)
    v3 = native.prebuilt_path(cq.NATIVE, native.VARIANTS[1], prebuilt)
    (partial / "x86-64-v3" / v3.name).write_bytes(v3.read_bytes())
    assert v4.is_file()
    found = native.find_prebuilt(cq.NATIVE, partial, AVX512)
    assert found is not None and level_of(found) == "x86-64-v3"
    # A library of another source or other flags has another name: never loaded by mistake.
    other = native.NativeSource("qlinear", cq.NATIVE.source, ("-O0", "-march=native"))
    assert native.find_prebuilt(other, prebuilt, AVX512) is None


@pytest.mark.parametrize("variant", native.VARIANTS, ids=lambda v: v.march)
def test_each_level_this_cpu_runs_loads_without_a_compiler_and_matches_the_reference(
    prebuilt: Path, variant: native.Variant, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not variant.cpu_flags <= native.cpu_flags():
        pytest.skip(f"this CPU cannot run {variant.march} code")
    monkeypatch.setenv(native.PREBUILT_ENV, str(prebuilt))
    monkeypatch.setattr(native, "cpu_flags", lambda: variant.cpu_flags)  # a CPU of exactly this level
    monkeypatch.setenv("CXX", "no-such-compiler")  # the image has none: a build attempt would raise
    kernel = cq.load_qlinear_kernel(tmp_path / "cache")
    assert level_of(kernel.path) == variant.march
    assert not (tmp_path / "cache" / "kernels").exists()
    assert kernel.isa in ({"avx2", "avx512"} if "avx2" in variant.cpu_flags else {"portable"})
    g = torch.Generator().manual_seed(0)
    for fmt in ("q4_0", "q8_0"):
        w = cq.quantize_block(torch.randn(37, 576, generator=g) * 0.1, fmt)
        for m in (1, 7):
            x = torch.randn(m, 576, generator=g)
            ref = cq.linear_reference(x.double(), w).float()
            torch.testing.assert_close(kernel.linear(x, w), ref, rtol=1e-4, atol=1e-4 * 576**0.5)


def test_prebuild_command_builds_every_kernel_for_every_level(prebuilt: Path) -> None:
    built = sorted((p.parent.name, p.name.split("-")[0]) for p in prebuilt.rglob("*.so"))
    kernels = (
        "bf16_gemm",
        "cpu_fused",
        "fp8",
        "moe_experts",
        "mxfp4",
        "paged_decode",
        "qgemv_q8",
        "qk_native",
        "qlinear",
        "sampling",
    )
    # and the CPU probe once, for any x86-64 CPU: it picks the level
    expected = [(v.march, k) for v in native.VARIANTS for k in kernels] + [(native.ANY.march, "cpu_probe")]
    assert built == sorted(expected)


def test_a_level_the_os_has_not_enabled_is_not_chosen(
    prebuilt: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # cpuinfo lists AVX-512 (as a VM that does not enable its state would), the probe says unusable
    monkeypatch.setenv(native.PREBUILT_ENV, str(prebuilt))
    monkeypatch.setattr(native, "cpu_flags", lambda: AVX512)
    monkeypatch.setenv("KUBEINFER_CPU_DISABLE", "avx512")
    monkeypatch.setenv("CXX", "no-such-compiler")  # the probe comes prebuilt too
    assert "avx512f" not in native.runnable_cpu_flags(tmp_path / "cache")
    _, path = native.load_library(cq.NATIVE, tmp_path / "cache")
    assert level_of(path) == "x86-64-v3"


def test_the_x86_64_v3_build_runs_the_tiles_avx2_path(
    prebuilt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An AVX2-only CPU gets the x86-64-v3 build of the tile kernel (qk_native), and it runs the tiles on its
    avx2 path (AVX-512 turned off here as such a CPU lacks it), within the reference's fp32 slack."""
    from server.quant import cpu_qk_native as qk

    v3 = native.VARIANTS[1]
    if not v3.cpu_flags <= native.cpu_flags():
        pytest.skip("this CPU cannot run x86-64-v3 code")
    monkeypatch.setenv(native.PREBUILT_ENV, str(prebuilt))
    monkeypatch.setattr(native, "cpu_flags", lambda: v3.cpu_flags)
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("KUBEINFER_CPU_DISABLE", "avx512f,avx512_bf16,avx512_vnni,avx_vnni,amx_tile,amx_bf16")
    kernel = qk.load_qk_native_kernel(tmp_path / "cache")
    assert level_of(kernel.path) == v3.march and kernel.isa == "avx2"
    rng = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (32, 2 * 144), dtype=torch.uint8, generator=rng)
    raw.view(-1, 144)[:, 0:4] = torch.tensor([1e-3, 1e-3], dtype=torch.float16).view(torch.uint8)
    w = qk.from_gguf(raw.numpy(), "q4_k", 32, 512)
    tiles = kernel.interleave(w)
    x = torch.randn(5, 512, generator=rng)
    slack = 2e-5 * (qk.quantize_activations_reference(x).abs() @ qk.dequantize_reference(w).abs().t()) + 1e-5
    assert ((kernel.linear(x, tiles) - qk.linear_reference(x, w)).abs() <= slack).all()


def test_a_failed_build_fails_the_prebuild_naming_the_source(tmp_path: Path) -> None:
    """The builds run side by side (one compiler a CPU); one that fails is raised with the compiler's
    message, and the others' libraries are whole files or absent (each published atomically)."""
    good = tmp_path / "good.cpp"
    good.write_text('extern "C" int kubeinfer_good(void) { return 1; }\n')
    bad = tmp_path / "bad.cpp"
    bad.write_text("int broken( {\n")
    sources = tuple(
        native.NativeSource(p.stem, p, ("-O0", "-fPIC", "-march=native"), ("-shared",)) for p in (good, bad)
    )
    with pytest.raises(native.KernelBuildError, match=r"bad\.cpp"):
        native.prebuild(sources, tmp_path / "out")
    assert not list((tmp_path / "out").rglob("bad-*.so"))
    assert not list((tmp_path / "out").rglob(".build-*"))
