"""The CPU features this process may use: what CPUID reports AND what the OS enabled, minus what the
operator turned off.

A feature listed by CPUID (and so by /proc/cpuinfo) can still fault: AVX and AVX-512 need their register
state enabled in XCR0 by the OS, and AMX on Linux also needs a per-process permission
(arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); a VM may list `amx_tile` without either, and
code built for it dies at its first tile instruction. So every dispatch decision (the kernels' -march
flags and cache key in server/native.py, qlinear's AVX-512 path, the loader's bf16 choice) reads
`CpuFeatures`, decoded here from the raw words server/csrc/cpu_probe.cpp returns.

`KUBEINFER_CPU_DISABLE` (comma-separated feature names or the groups `avx2`, `avx512`, `amx`, `vnni`,
`bf16`) turns features off: the next code path is then taken, as on a CPU without them.

Bit positions: Intel SDM vol. 2A, CPUID leaf 1 and leaf 7 (sub-leaves 0 and 1); XCR0 state components:
SDM vol. 1 ch. 13.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

DISABLE_ENV = "KUBEINFER_CPU_DISABLE"

# XCR0 state components the OS must enable before the registers are usable.
XCR0_AVX = 0b110  # SSE (1) and AVX (2): ymm
XCR0_AVX512 = XCR0_AVX | 0b1110_0000  # opmask (5), ZMM_Hi256 (6), Hi16_ZMM (7)
XCR0_AMX = (1 << 17) | (1 << 18)  # XTILECFG, XTILEDATA


@dataclass(frozen=True)
class CpuRegisters:
    """The probe's raw words (server/csrc/cpu_probe.cpp): CPUID leaf 1 ECX/EDX, leaf 7.0 EBX/ECX/EDX,
    leaf 7.1 EAX, XCR0, and the AMX permission (1 granted, 0 refused, -1 not asked)."""

    leaf1_ecx: int = 0
    leaf1_edx: int = 0
    leaf7_ebx: int = 0
    leaf7_ecx: int = 0
    leaf7_edx: int = 0
    leaf7_1_eax: int = 0
    xcr0: int = 0
    amx_permission: int = -1


@dataclass(frozen=True)
class CpuFeatures:
    """Usable instruction sets (each True only if the CPU has it AND the OS enabled its state)."""

    avx2: bool = False
    fma: bool = False
    f16c: bool = False
    avx512f: bool = False
    avx512bw: bool = False
    avx512vl: bool = False
    avx512_vnni: bool = False
    avx512_bf16: bool = False
    avx_vnni: bool = False
    amx_tile: bool = False
    amx_bf16: bool = False
    amx_int8: bool = False

    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self) if getattr(self, f.name))

    def key(self) -> str:
        """A stable text for cache keys: the usable features, sorted."""
        return ",".join(sorted(self.names()))


def int8_dot_path(features: CpuFeatures) -> str:
    """The int8 dot-product kernels' code path these features allow (qgemv_q8.cpp, qk_native.cpp): "vnni"
    needs AVX512-VNNI with AVX512VL/BW, "avx2" (vpmaddubsw) AVX2 with FMA and F16C, else "scalar"."""
    if features.avx512_vnni and features.avx512vl and features.avx512bw:
        return "vnni"
    if features.avx2 and features.fma and features.f16c:
        return "avx2"
    return "scalar"


def fp32_fma_path(features: CpuFeatures) -> str:
    """The fp32-FMA kernels' code path these features allow (mxfp4.cpp, fp8.cpp: codes widened to fp32 in
    registers): "avx512" needs AVX-512F, "avx2" AVX2 with FMA, else "scalar"."""
    if features.avx512f:
        return "avx512"
    if features.avx2 and features.fma:
        return "avx2"
    return "scalar"


# Groups for KUBEINFER_CPU_DISABLE; disabling a base feature also disables what builds on it.
_GROUPS = {
    "avx2": ("avx2", "fma", "avx512f", "avx_vnni", "amx_tile"),
    "avx512": ("avx512f",),
    "amx": ("amx_tile",),
    "vnni": ("avx512_vnni", "avx_vnni"),
    "bf16": ("avx512_bf16", "amx_bf16"),
}
# AMX counts as building on AVX-512: every AMX kernel (oneDNN's, ours) does its loads, conversions and
# epilogues in AVX-512, and no CPU has one without the other.
_DEPENDENTS = {
    "avx2": ("avx512f", "avx_vnni"),
    "avx512f": ("avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile"),
    "amx_tile": ("amx_bf16", "amx_int8"),
}


def _bit(word: int, n: int) -> bool:
    return bool((word >> n) & 1)


def decode(r: CpuRegisters) -> CpuFeatures:
    """CPUID bits gated by XCR0 (and, for AMX, the Linux permission)."""
    os_xsave = _bit(r.leaf1_ecx, 27)
    avx_os = os_xsave and _bit(r.leaf1_ecx, 28) and (r.xcr0 & XCR0_AVX) == XCR0_AVX
    avx512_os = avx_os and (r.xcr0 & XCR0_AVX512) == XCR0_AVX512
    amx_os = avx_os and (r.xcr0 & XCR0_AMX) == XCR0_AMX and r.amx_permission == 1
    avx512f = avx512_os and _bit(r.leaf7_ebx, 16)
    amx_tile = amx_os and _bit(r.leaf7_edx, 24)
    return CpuFeatures(
        avx2=avx_os and _bit(r.leaf7_ebx, 5),
        fma=avx_os and _bit(r.leaf1_ecx, 12),
        f16c=avx_os and _bit(r.leaf1_ecx, 29),
        avx512f=avx512f,
        avx512bw=avx512f and _bit(r.leaf7_ebx, 30),
        avx512vl=avx512f and _bit(r.leaf7_ebx, 31),
        avx512_vnni=avx512f and _bit(r.leaf7_ecx, 11),
        avx512_bf16=avx512f and _bit(r.leaf7_1_eax, 5),
        avx_vnni=avx_os and _bit(r.leaf7_1_eax, 4),
        amx_tile=amx_tile,
        amx_bf16=amx_tile and _bit(r.leaf7_edx, 22),
        amx_int8=amx_tile and _bit(r.leaf7_edx, 25),
    )


def parse_disable(text: str) -> frozenset[str]:
    """KUBEINFER_CPU_DISABLE's value -> the feature names it turns off (dependents included).
    Raises ValueError for an unknown name."""
    known = {f.name for f in fields(CpuFeatures)}
    off: set[str] = set()
    for raw in text.split(","):
        name = raw.strip().lower()
        if not name:
            continue
        if name in _GROUPS:
            off.update(_GROUPS[name])
        elif name in known:
            off.add(name)
        else:
            raise ValueError(
                f"{DISABLE_ENV}: unknown CPU feature {name!r}; expected one of "
                f"{', '.join(sorted(known | set(_GROUPS)))}"
            )
    todo = list(off)
    while todo:
        for dep in _DEPENDENTS.get(todo.pop(), ()):
            if dep not in off:
                off.add(dep)
                todo.append(dep)
    return frozenset(off)


def apply_disable(features: CpuFeatures, text: str | None = None) -> CpuFeatures:
    """`features` minus what KUBEINFER_CPU_DISABLE (or `text`) turns off."""
    off = parse_disable(os.environ.get(DISABLE_ENV, "") if text is None else text)
    return replace(features, **{name: False for name in off if getattr(features, name)})


# gcc/clang flags that keep -march=native from emitting what is not usable here (a VM may list AMX or
# AVX-512 in CPUID that the OS never enabled; -march=native reads CPUID).
_MNO_FLAGS = (
    ("avx2", ("-mno-avx2", "-mno-fma")),
    ("avx512f", ("-mno-avx512f",)),  # gcc: also turns off every AVX-512 extension
    ("avx512_bf16", ("-mno-avx512bf16",)),
    ("avx512_vnni", ("-mno-avx512vnni",)),
    ("avx_vnni", ("-mno-avxvnni",)),
    ("amx_tile", ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")),
)


def march_flags(features: CpuFeatures, x86: bool = True) -> tuple[str, ...]:
    """What replaces "-march=native" in a kernel's compile flags: -march=native plus -mno-* for each
    feature family that is not usable (x86 only; elsewhere just -march=native)."""
    if not x86:
        return ("-march=native",)
    extra: list[str] = []
    for name, flags in _MNO_FLAGS:
        if not getattr(features, name):
            extra.extend(flags)
    return ("-march=native", *extra)
