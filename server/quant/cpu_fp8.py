"""The compiled CPU kernel for weight-only fp8 layers (`--quantize fp8`, fp8 checkpoints): csrc/fp8.cpp.

A weight W[N, K] is float8_e4m3fn codes with one fp32 scale per output row (server/quant/layers.py
`Fp8Linear`; OCP 8-bit Floating Point Specification (OFP8) v1.0, E4M3). `Fp8Kernel.linear` (the checked
launcher) computes (x @ e4m3(W)^T) * scale (+ bias) in fp32 straight from the codes: each weight byte is read
once a call and widened in registers, so a decode step reads a byte a weight where torch's path converts
the whole weight to the activations' dtype first (the embedded model decoded at 1.3 tok/s that way).
`linear_reference` (float64 over the dequantized W) is what the tests hold it to. Three code paths,
AVX-512, AVX2 + FMA and scalar C++, chosen at run time from `usable_cpu_features()`; `set_path` forces a
lower one (tests, benchmarks). Made for decode batches and short chunks (M <= `MAX_ROWS`): its cost grows with
M (fp32 FMAs, no reuse across 4-row tiles beyond the cache), while torch's path pays the conversion once a call,
so larger M (prefill) stays on torch's GEMM over the converted weight.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from server.config import default_cache_dir
from server.cpu_features import fp32_fma_path as path_for  # cpu_mxfp4's too
from server.native import KernelBuildError, NativeSource, load_library, usable_cpu_features

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "fp8.cpp"
ABI_VERSION = 1
# No -ffast-math: the codes are exact in fp32 and the sums plain fp32.
NATIVE = NativeSource(
    "fp8", SOURCE, ("-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c++20"), abi_version=ABI_VERSION
)
PATHS = ("scalar", "avx2", "avx512")  # kubeinfer_fp8_set_path's 0, 1, 2
# Rows of x the kernel serves: benchmarks/fp8_rows.py (Zen 4, 2 threads, bf16 activations) measured it 1.40-1.48x
# torch's convert-then-GEMM at 64 rows in SmolLM2's and Llama-3.2-1B's shapes and 0.78-0.89x at 128.
MAX_ROWS = 64


def linear_reference(
    x: Tensor,  # [M, K] fp32
    weight: Tensor,  # [N, K] float8_e4m3fn
    scale: Tensor,  # [N] fp32
    bias: Tensor | None = None,  # [N] fp32
) -> Tensor:  # [M, N] fp32
    """(x @ W^T) * scale (+ bias) in float64 over W's exact values, rounded once to fp32."""
    y = (x.double() @ weight.double().t()) * scale.double()
    return (y if bias is None else y + bias.double()).float()


def check_codes(weight: Tensor) -> None:  # weight: [N, K] float8_e4m3fn
    """Raises ValueError if `weight` holds a NaN code (S.1111.111): the kernel decodes codes as numbers."""
    codes = weight.view(torch.uint8)
    if bool(((codes & 0x7F) == 0x7F).any()):
        raise ValueError(
            "fp8 weight holds NaN codes (0x7f / 0xff): a corrupt checkpoint, or NaN in the weights quantized"
        )


def check_args(
    x: Tensor,  # [M, K] fp32, unit stride along K
    weight: Tensor,  # [N, K] float8_e4m3fn, contiguous
    scale: Tensor,  # [N] fp32, contiguous
    bias: Tensor | None,  # [N] fp32, contiguous
    out: Tensor | None,  # [M, N] fp32, unit stride along N
) -> Tensor:  # out, allocated when None
    """Raises TypeError for a dtype or device, ValueError for a shape or layout the kernel cannot take,
    each naming the argument."""
    for name, t in (("x", x), ("weight", weight), ("scale", scale), ("bias", bias), ("out", out)):
        if t is not None and t.device.type != "cpu":
            raise TypeError(f"{name} must be on the CPU, got {t.device}")
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"weight must be float8_e4m3fn, got {weight.dtype}")
    if weight.dim() != 2 or not weight.is_contiguous() or weight.shape[0] == 0 or weight.shape[1] == 0:
        raise ValueError(f"weight must be a contiguous non-empty [N, K], got {tuple(weight.shape)}")
    n, k = weight.shape
    for name, v in (("scale", scale), ("bias", bias)):
        if v is not None and (v.dtype != torch.float32 or tuple(v.shape) != (n,) or not v.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous float32 [{n}], got {v.dtype} {tuple(v.shape)}")
    if x.dtype != torch.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    if x.stride(1) != 1 or (x.shape[0] > 1 and x.stride(0) < k):
        raise ValueError(
            f"x must have unit stride along K and rows at least K apart, got strides {x.stride()}"
        )
    m = x.shape[0]
    if out is None:
        return torch.empty(m, n, dtype=torch.float32, device="cpu")
    if (
        out.dtype != torch.float32
        or tuple(out.shape) != (m, n)
        or out.stride(1) != 1
        or (m > 1 and out.stride(0) < n)
    ):
        raise ValueError(
            f"out must be float32 [{m}, {n}] with unit stride along N, got {out.dtype} {tuple(out.shape)} "
            f"strides {out.stride()}"
        )
    for name, t in (("x", x), ("weight", weight), ("scale", scale), ("bias", bias)):
        if t is not None and _overlap(out, t):
            raise ValueError(f"out must not overlap {name}: the kernel's threads read it while others write")
    return out


def _overlap(a: Tensor, b: Tensor) -> bool:
    """Whether the byte spans a and b reach (first element to last) intersect: conservative, so two views
    whose rows interleave in one buffer count as overlapping."""
    if a.numel() == 0 or b.numel() == 0:
        return False

    def span(t: Tensor) -> tuple[int, int]:
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


@dataclass(frozen=True)
class Fp8Kernel:
    """The loaded library and the path it runs; `linear` is the checked launcher."""

    lib: ctypes.CDLL
    path: Path
    isa: str  # one of PATHS: the code path running here

    def linear(
        self,
        x: Tensor,  # [M, K] fp32, unit stride along K
        weight: Tensor,  # [N, K] float8_e4m3fn, contiguous, no NaN codes (check_codes)
        scale: Tensor,  # [N] fp32, contiguous
        bias: Tensor | None = None,  # [N] fp32, contiguous
        out: Tensor | None = None,  # [M, N] fp32, unit stride along N
    ) -> Tensor:  # [M, N] fp32: (x @ W^T) * scale (+ bias)
        """Raises TypeError/ValueError for arguments it cannot take (check_args), RuntimeError when the
        kernel refuses them anyway."""
        out = check_args(x, weight, scale, bias, out)
        m, n = out.shape
        if m == 0:
            return out
        rc = self.lib.kubeinfer_fp8_linear(
            weight.data_ptr(),
            scale.data_ptr(),
            n,
            weight.shape[1],
            x.data_ptr(),
            m,
            max(x.stride(0), weight.shape[1]),  # one row: its stride is arbitrary
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            max(out.stride(0), n),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"fp8 kernel returned {rc} for x {tuple(x.shape)}, W {tuple(weight.shape)}")
        return out

    def set_path(self, name: str) -> str:
        """Runs path `name` (lowered to what this build has); returns the path now in use. Process-wide:
        for tests and benchmarks, never while another thread runs the kernel."""
        return PATHS[int(self.lib.kubeinfer_fp8_set_path(PATHS.index(name)))]


@functools.cache
def load_fp8_kernel(cache_dir: Path | None = None) -> Fp8Kernel:
    """Builds (or finds) and loads the kernel, its path set from the usable CPU features; raises
    KernelBuildError if it cannot be built."""
    lib, path = load_library(NATIVE, cache_dir or default_cache_dir())
    i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    lib.kubeinfer_fp8_linear.restype = i32
    lib.kubeinfer_fp8_linear.argtypes = [ptr, ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i32]
    lib.kubeinfer_fp8_set_path.restype = i32
    lib.kubeinfer_fp8_set_path.argtypes = [i32]
    wanted = path_for(usable_cpu_features(cache_dir))
    isa = PATHS[int(lib.kubeinfer_fp8_set_path(PATHS.index(wanted)))]
    return Fp8Kernel(lib, path, isa)


@functools.cache
def try_load_fp8_kernel(cache_dir: Path | None = None) -> Fp8Kernel | None:
    """The kernel, or None (logged once) when it cannot be built: torch's conversion then serves. Cached,
    the failure too: a layer's forward asks it, and a failed build must not be retried per call."""
    try:
        return load_fp8_kernel(cache_dir)
    except (KernelBuildError, OSError) as e:
        _warn_once(str(e))
        return None


@functools.cache
def _warn_once(reason: str) -> None:
    log.warning("fp8 CPU kernel unavailable, fp8 weights are converted per forward: %s", reason)
