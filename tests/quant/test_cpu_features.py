"""CPU features as the OS enables them (server/cpu_features.py, server/csrc/cpu_probe.cpp) and every
dispatch decision that reads them: the kernels' -march flags and cache key, qlinear's AVX-512 path, the
loader's bf16 choice. Each feature is forced off with KUBEINFER_CPU_DISABLE and the next path must be
taken with the same results."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from server import native
from server.cpu_features import (
    DISABLE_ENV,
    XCR0_AVX512,
    CpuFeatures,
    CpuRegisters,
    apply_disable,
    decode,
    march_flags,
    parse_disable,
)
from server.quant import cpu_qlinear as cq

# CPUID words of a Sapphire Rapids-like CPU: AVX2, FMA, F16C, OSXSAVE, AVX; AVX-512 F/BW/VL, VNNI,
# BF16; AMX tile/bf16/int8.
LEAF1_ECX = (1 << 12) | (1 << 27) | (1 << 28) | (1 << 29)
LEAF7_EBX = (1 << 5) | (1 << 16) | (1 << 30) | (1 << 31)
LEAF7_ECX = 1 << 11
LEAF7_EDX = (1 << 22) | (1 << 24) | (1 << 25)
LEAF7_1_EAX = (1 << 4) | (1 << 5)
XCR0_ALL = XCR0_AVX512 | (1 << 17) | (1 << 18)


def regs(xcr0: int = XCR0_ALL, amx_permission: int = 1, leaf1_ecx: int = LEAF1_ECX) -> CpuRegisters:
    return CpuRegisters(leaf1_ecx, 0, LEAF7_EBX, LEAF7_ECX, LEAF7_EDX, LEAF7_1_EAX, xcr0, amx_permission)


def test_everything_usable_when_the_os_enables_it() -> None:
    f = decode(regs())
    assert all(getattr(f, name) for name in CpuFeatures.__dataclass_fields__)
    assert march_flags(f) == ("-march=native",)


def test_amx_listed_but_not_permitted_or_not_in_xcr0_is_not_usable() -> None:
    """The VM of issue 31: CPUID (and cpuinfo) list amx_tile, the tile state is off or not granted."""
    for r in (regs(amx_permission=0), regs(xcr0=XCR0_AVX512)):
        f = decode(r)
        assert not (f.amx_tile or f.amx_bf16 or f.amx_int8)
        assert f.avx512_bf16 and f.avx512f
        assert "-mno-amx-tile" in march_flags(f) and "-mno-avx512f" not in march_flags(f)


def test_avx512_listed_but_zmm_state_off_falls_back_to_avx2() -> None:
    f = decode(regs(xcr0=0b111))  # x87, SSE, AVX: no opmask/ZMM state
    assert f.avx2 and f.fma and not (f.avx512f or f.avx512_bf16 or f.avx512_vnni or f.amx_tile)
    assert "-mno-avx512f" in march_flags(f)
    # No OSXSAVE: XCR0 cannot be read, nothing AVX is usable.
    assert decode(regs(leaf1_ecx=LEAF1_ECX & ~(1 << 27))).names() == ()


def test_disable_groups_and_dependents() -> None:
    # AMX builds on AVX-512 (every AMX kernel's loads and epilogues are AVX-512)
    assert parse_disable("avx512") >= {
        "avx512f",
        "avx512_bf16",
        "avx512_vnni",
        "avx512bw",
        "amx_tile",
        "amx_bf16",
    }
    assert parse_disable(" AMX ,") == {"amx_tile", "amx_bf16", "amx_int8"}
    assert "avx512f" in parse_disable("avx2") and "amx_tile" in parse_disable("avx2")
    f = apply_disable(decode(regs()), "avx512_bf16")
    assert not f.avx512_bf16 and f.avx512f and f.amx_bf16
    with pytest.raises(ValueError, match="unknown CPU feature 'sse9'"):
        parse_disable("sse9")


def test_probe_agrees_with_the_kernel_on_this_machine() -> None:
    """The probe's XCR0 view against Linux's: cpuinfo lists avx512f only if the kernel enabled its
    state (Linux clears it otherwise), so the two agree here; AMX needs more than cpuinfo says."""
    if not native.is_x86_64():
        pytest.skip("x86-64 only")
    flags = next(
        ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")
    ).split()
    f = decode(native.probe_registers())
    assert f.avx2 == ("avx2" in flags)
    assert f.avx512f == ("avx512f" in flags)
    assert f.avx512_bf16 == ("avx512_bf16" in flags)
    assert not f.amx_tile or "amx_tile" in flags


def test_disable_changes_the_kernel_flags_and_cache_key(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    on_flags = native.effective_compile_flags(cq.NATIVE, tmp_path)
    on_path = native.library_path(cq.NATIVE, tmp_path)
    monkeypatch.setenv(DISABLE_ENV, "avx512,amx")
    off_flags = native.effective_compile_flags(cq.NATIVE, tmp_path)
    assert {"-mno-avx512f", "-mno-amx-tile"} <= set(off_flags)
    assert native.library_path(cq.NATIVE, tmp_path) != on_path or on_flags == off_flags
    # The probe itself is built for any CPU: no -march, no feature key.
    assert native.effective_compile_flags(native.PROBE, tmp_path) == native.PROBE.compile_flags


@pytest.mark.parametrize(("disable", "isa"), [("avx512", "avx2"), ("avx2", "portable")])
def test_forced_off_kernel_takes_the_next_path_with_the_same_results(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, disable: str, isa: str
) -> None:
    if not native.is_x86_64():
        pytest.skip("x86-64 only")
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    default = cq.load_qlinear_kernel()
    monkeypatch.setenv(DISABLE_ENV, disable)
    forced = cq.load_qlinear_kernel(tmp_path)
    assert forced.isa == isa and forced.path != default.path
    g = torch.Generator().manual_seed(0)
    w = cq.quantize_block(torch.randn(40, 256, generator=g) * 0.1, "q4_0")
    for m in (1, 3, 20):  # the GEMV path and the batched one
        x = torch.randn(m, 256, generator=g)
        ref = cq.linear_reference(x.double(), w, None).float()
        torch.testing.assert_close(forced.linear(x, w), ref, rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(forced.linear(x, w), default.linear(x, w), rtol=1e-4, atol=1e-3)


def test_bf16_choice_follows_the_usable_features(monkeypatch: pytest.MonkeyPatch) -> None:
    from server.models import loader

    monkeypatch.setenv(DISABLE_ENV, "bf16")
    assert not loader.cpu_has_native_bf16()
    assert loader.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    monkeypatch.setenv(DISABLE_ENV, "avx512")
    assert not loader.cpu_has_native_bf16()
    monkeypatch.delenv(DISABLE_ENV)
    f = native.usable_cpu_features()
    assert loader.cpu_has_native_bf16() == (f.avx512_bf16 or f.amx_bf16)
