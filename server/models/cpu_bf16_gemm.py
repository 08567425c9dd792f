"""bf16 Linear layers at decode-sized row counts on AVX512-BF16 CPUs (csrc/bf16_gemm.cpp).

oneDNN's pre-packed bf16 GEMM streams weights at ~10 GB/s at 1-64 rows on Zen 4 (benchmarks/bf16_gemm.py),
about half the rate of the int8 kernels, and a decode step at those rows is bound by the weight stream.
`Bf16Panels` holds a [N, K] bf16 weight re-laid once into panels of 16 output columns x pairs of K
(the operand layout of `vdpbf16ps`, same bytes as the weight); the kernel reads each weight vector once per
8 rows of x and keeps a thread's block of 3 panels in L2 for the next 8 rows; at 9-64 rows chunk by chunk of
K, each pass fetching part of the next chunk, so the weight stream runs under the arithmetic (bf16_gemm.cpp
`run_chunked`; the sums in the same order, so the same result).

Result: x W^T (+ bias) accumulated in fp32 in K order, then rounded to bf16 (nearest even) as F.linear's
bf16 output is. oneDNN sums in another order, so the two agree to fp32 rounding before the final bf16
rounding: within one bf16 ulp of each other per output, not bit for bit (`linear_reference` is the fp64
reference; `error_bound` the tolerance the tests use).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from server.config import default_cache_dir
from server.native import KernelBuildError, NativeSource, load_library, usable_cpu_features

SOURCE = Path(__file__).with_name("csrc") / "bf16_gemm.cpp"
ABI_VERSION = 2  # 2: kubeinfer_bf16_linear's round_f32 (fp32 out holding bf16 values)
NATIVE = NativeSource(
    "bf16_gemm",
    SOURCE,
    ("-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c++20", "-ffp-contract=off"),
    abi_version=ABI_VERSION,
)
PANEL = 16  # output columns per panel (bf16_gemm.cpp's PANEL)
PATHS = {"scalar": 0, "avx512bf16": 1}  # kubeinfer_bf16_set_path's codes


@dataclass(frozen=True)
class Bf16Panels:
    """A [N, K] bf16 weight as bf16_gemm.cpp's panels: [ceil(N/16), ceil(K/2), 16, 2] bf16, zero-padded."""

    panels: Tensor  # [ceil(N/16), ceil(K/2), 16, 2] bf16, contiguous, CPU
    in_features: int  # K
    out_features: int  # N

    def __post_init__(self) -> None:
        n, k = self.out_features, self.in_features
        want = (-(-n // PANEL), -(-k // 2), PANEL, 2)
        p = self.panels
        if tuple(p.shape) != want or p.dtype != torch.bfloat16:
            raise ValueError(f"panels must be {list(want)} bf16, got {tuple(p.shape)} {p.dtype}")
        if p.device.type != "cpu" or not p.is_contiguous():
            raise ValueError("panels must be a contiguous CPU tensor")

    @property
    def k_pairs(self) -> int:
        return self.panels.shape[1]


def panels_reference(w: Tensor) -> Tensor:  # w: [N, K] bf16 -> [ceil(N/16), ceil(K/2), 16, 2] bf16
    """The layout in plain torch (tests check the kernel's pack against it)."""
    n, k = w.shape
    np_, k2 = -(-n // PANEL), -(-k // 2)
    padded = torch.zeros(np_ * PANEL, k2 * 2, dtype=w.dtype)
    padded[:n, :k] = w
    return padded.reshape(np_, PANEL, k2, 2).permute(0, 2, 1, 3).contiguous()


def linear_reference(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [M, K] bf16, w [N, K] bf16, bias [N] -> [M, N] fp32: the exact products summed in fp64."""
    y = x.double() @ w.double().t()
    if bias is not None:
        y = y + bias.double()
    return y.float()


def error_bound(x: Tensor, w: Tensor) -> Tensor:  # x [M, K], w [N, K] -> [M, N] fp32
    """Most an fp32 sum of K products in any order differs from the exact one: K * 2^-24 * sum |x w|
    (Higham's bound, first order), plus vdpbf16ps's flushed denormals (below 2^-126 each: negligible here)."""
    k = x.shape[-1]
    return (k * 2.0**-24) * (x.double().abs() @ w.double().abs().t()).float()


@dataclass(frozen=True)
class Bf16GemmKernel:
    """The loaded library; `pack` and `linear` check their arguments (a wrong pointer would crash)."""

    lib: ctypes.CDLL
    path: Path
    isa: str  # "avx512bf16" or "scalar"

    def set_path(self, name: str) -> str:
        """Runs `name` ("avx512bf16", "scalar") from now on where the CPU can; returns the path in use.
        Process-wide: never while another thread runs the kernel."""
        if name not in PATHS:
            raise ValueError(f"unknown path {name!r}; expected one of {sorted(PATHS)}")
        if name == "avx512bf16" and not _cpu_has_bf16_dot():
            name = "scalar"
        got = int(self.lib.kubeinfer_bf16_set_path(PATHS[name]))
        object.__setattr__(self, "isa", "avx512bf16" if got == 1 else "scalar")
        return self.isa

    def pack(self, w: Tensor) -> Bf16Panels:  # w: [N, K] bf16, unit stride along K
        """The weight's panels (a new tensor; `w` may be freed afterwards). TypeError for a non-bf16 or
        non-CPU weight, ValueError for a shape the kernel cannot take."""
        if w.dtype != torch.bfloat16 or w.device.type != "cpu":
            raise TypeError(f"w must be a CPU bf16 tensor, got {w.dtype} on {w.device}")
        if w.dim() != 2 or w.shape[0] == 0 or w.shape[1] == 0:
            raise ValueError(f"w must be a non-empty [N, K] matrix, got {tuple(w.shape)}")
        if w.stride(1) != 1:
            w = w.contiguous()
        n, k = w.shape
        panels = torch.empty(-(-n // PANEL), -(-k // 2), PANEL, 2, dtype=torch.bfloat16)
        rc = self.lib.kubeinfer_bf16_pack(
            w.data_ptr(), n, k, w.stride(0), panels.data_ptr(), torch.get_num_threads()
        )
        if rc != 0:
            raise RuntimeError(f"bf16_gemm pack returned {rc} for [{n}, {k}]")
        return Bf16Panels(panels, k, n)

    def linear(
        self,
        x: Tensor,  # [M, K] bf16
        w: Bf16Panels,
        bias: Tensor | None = None,  # [N] fp32 or bf16
        out_dtype: torch.dtype = torch.bfloat16,
        bf16_values: bool = False,  # fp32 out only: each value rounded to bf16 (`.bfloat16().float()`)
    ) -> Tensor:  # [M, N] out_dtype (bf16 or fp32)
        """x W^T (+ bias) (module docstring). With `bf16_values` the fp32 result is bit for bit the bf16
        one widened (a bf16 model's logits, without a [M, N] widening pass after the GEMM). TypeError for a
        non-CPU or non-bf16 x or another output dtype, ValueError for a shape mismatch or `bf16_values`
        with a bf16 out, RuntimeError if the kernel refuses its arguments."""
        if x.dtype != torch.bfloat16 or x.device.type != "cpu":
            raise TypeError(f"x must be a CPU bf16 tensor, got {x.dtype} on {x.device}")
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"out_dtype must be bf16 or fp32, got {out_dtype}")
        if bf16_values and out_dtype != torch.float32:
            raise ValueError("bf16_values rounds an fp32 out; a bf16 out is rounded already")
        k, n = w.in_features, w.out_features
        if x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
        if k % 2:  # the kernel reads pairs: one zero past K (the panels hold zeros there too)
            x = torch.nn.functional.pad(x, (0, 1))
        elif x.stride(1) != 1:
            x = x.contiguous()
        b = None
        if bias is not None:
            if tuple(bias.shape) != (n,):
                raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
            b = bias.float().contiguous()
        m = x.shape[0]
        out = torch.empty(m, n, dtype=out_dtype)
        if m == 0:
            return out
        bf = out.data_ptr() if out_dtype == torch.bfloat16 else None
        f32 = out.data_ptr() if out_dtype == torch.float32 else None
        rc = self.lib.kubeinfer_bf16_linear(
            w.panels.data_ptr(),
            n,
            w.k_pairs,
            x.data_ptr(),
            m,
            x.stride(0),
            None if b is None else b.data_ptr(),
            bf,
            f32,
            n,
            torch.get_num_threads(),
            int(bf16_values),
        )
        if rc != 0:
            raise RuntimeError(f"bf16_gemm kernel returned {rc} for [{n}, {k}] at {m} rows")
        return out


def _cpu_has_bf16_dot() -> bool:
    f = usable_cpu_features(default_cache_dir())
    return bool(f.avx512_bf16 and f.avx512bw and f.avx512vl)


@functools.cache
def load_bf16_gemm_kernel(cache_dir: Path | None = None) -> Bf16GemmKernel:
    """Builds (or finds) and loads the kernel on its AVX512-BF16 path where the usable CPU features have
    it, else the scalar path (tests only: slow); raises KernelBuildError if it cannot be built."""
    lib, path = load_library(NATIVE, cache_dir or default_cache_dir())
    i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    lib.kubeinfer_bf16_pack.restype = i32
    lib.kubeinfer_bf16_pack.argtypes = [ptr, i64, i64, i64, ptr, i32]
    lib.kubeinfer_bf16_linear.restype = i32
    lib.kubeinfer_bf16_linear.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr, i64, i32, i32]
    lib.kubeinfer_bf16_set_path.restype = i32
    lib.kubeinfer_bf16_set_path.argtypes = [i32]
    features = usable_cpu_features(cache_dir)
    fast = features.avx512_bf16 and features.avx512bw and features.avx512vl
    got = int(lib.kubeinfer_bf16_set_path(PATHS["avx512bf16" if fast else "scalar"]))
    return Bf16GemmKernel(lib, path, "avx512bf16" if got == 1 else "scalar")


def try_load_fast_bf16_gemm(cache_dir: Path | None = None) -> Bf16GemmKernel | None:
    """The kernel where it runs its AVX512-BF16 path, else None (oneDNN stays: the scalar path is slow)."""
    try:
        kernel = load_bf16_gemm_kernel(cache_dir)
    except (KernelBuildError, OSError):
        return None
    return kernel if kernel.isa == "avx512bf16" else None


class Bf16PanelLinear(nn.Module):
    """Drop-in for a bf16 `nn.Linear` on an AVX512-BF16 CPU: the weight held once, as `Bf16Panels`."""

    def __init__(self, linear: nn.Linear, kernel: Bf16GemmKernel) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel = kernel
        self.weight_panels = kernel.pack(linear.weight.detach())
        self.bias: Tensor | None = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: Tensor) -> Tensor:  # x: [..., in_features] bf16 -> [..., out_features] bf16
        lead = x.shape[:-1]
        y = self.kernel.linear(x.reshape(-1, self.in_features), self.weight_panels, self.bias)
        return y.reshape(*lead, self.out_features)

    def widened(self, x: Tensor) -> Tensor:  # x: [T, in_features] bf16 -> [T, out_features] fp32
        """`forward(x).float()` bit for bit, written as fp32 by the GEMM itself: a bf16 model's logits
        (a [64, 128256] widening pass cost 1.3-4.8 ms of a 64-user Llama-3.2-1B decode step, Zen 5)."""
        return self.kernel.linear(x, self.weight_panels, self.bias, torch.float32, bf16_values=True)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )
