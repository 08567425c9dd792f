"""MXFP4 weights (gpt-oss's experts) and the compiled CPU kernel that multiplies by them (csrc/mxfp4.cpp).

Layout (OCP Microscaling Formats (MX) v1.0: e2m1 elements, one e8m0 scale per 32; transformers'
integrations/mxfp4.py `convert_moe_packed_tensors` for the nibble order): a weight W[N, K] is
`blocks [N, K / 32, 16]` uint8, 32 e2m1 codes per block, two per byte, the low nibble first (element 2j
in the low nibble of byte j), and `scales [N, K / 32]` uint8, each block's exponent biased by 127:
w = e2m1(code) * 2 ** (scale - 127). gpt-oss ships its experts stacked, `[E, N, K / 32, 16]` and
`[E, N, K / 32]`: expert e's W is the e-th slice of both (server/models/moe/mxfp4.py).

`Mxfp4Kernel.linear` (the checked launcher) computes x @ W^T (+ bias) in fp32 straight from the packed
bytes: every weight is decoded in registers, so a call reads 17 bytes per 32 weights, and the sums are
fp32 (`linear_reference`, the dequantize + float64 product, is what the tests hold it to). Three code
paths, AVX-512, AVX2 + FMA and scalar C++, chosen at run time from `usable_cpu_features()` (what the OS
enabled, less KUBEINFER_CPU_DISABLE: `avx512` off takes AVX2); `set_path` forces a lower one (tests,
benchmarks). Made for the few tokens per expert of a MoE step (GEMV and small-M GEMM: M = 1..64); it
takes any M, at fp32 FMA throughput.
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
from server.cpu_features import fp32_fma_path as path_for  # the path every fp32-FMA kernel shares
from server.native import KernelBuildError, NativeSource, load_library, usable_cpu_features

log = logging.getLogger(__name__)

MXFP4_BLOCK = 32  # values per shared scale
# e2m1: sign, 2 exponent bits (bias 1), 1 mantissa bit; codes 0-7 positive, 8-15 their negatives.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

SOURCE = Path(__file__).with_name("csrc") / "mxfp4.cpp"
ABI_VERSION = 1
# No -ffast-math: the decoded values are exact and the sums plain fp32 (no reassociation beyond the
# kernel's own order).
NATIVE = NativeSource(
    "mxfp4", SOURCE, ("-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c++20"), abi_version=ABI_VERSION
)
PATHS = ("scalar", "avx2", "avx512")  # kubeinfer_mxfp4_set_path's 0, 1, 2


def dequantize_mxfp4(
    blocks: Tensor, scales: Tensor
) -> Tensor:  # [..., G, 16] u8, [..., G] u8 -> [..., G * 32] fp32
    """The exact values (e2m1 times a power of two is exact in fp32). Raises ValueError when the shapes
    or dtypes are not MXFP4's."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != MXFP4_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"blocks {tuple(blocks.shape)} must be scales {tuple(scales.shape)} + [16]")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., G, 16, 2] low nibble first
    values = lut[codes].reshape(*blocks.shape[:-1], MXFP4_BLOCK)
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:-2], -1)


GGUF_BLOCK_BYTES = 17  # ggml's block_mxfp4: the e8m0 byte, then 16 bytes of codes


def from_gguf_mxfp4(
    raw: Tensor,  # GGUF MXFP4 bytes of a [..., N, K] tensor: [..., N, K / 32 * 17] or flat, uint8
    shape: tuple[int, ...],  # [..., N, K]
) -> tuple[Tensor, Tensor]:  # (blocks [..., N, K / 32, 16], scales [..., N, K / 32]) uint8
    """ggml's MXFP4 blocks (ggml-common.h block_mxfp4, gguf-py quants.py MXFP4: per 32 values the
    e8m0 byte, then 16 bytes whose low nibbles are elements 0-15 and high nibbles 16-31) in this
    module's layout (transformers': element 2j in the low nibble of byte j, 2j + 1 in the high one).
    Exact: the same codes and exponents, moved. Raises ValueError when the bytes do not fit `shape`."""
    *lead, k = shape
    if k % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 rows of {k} values are not whole 32-value blocks")
    data = raw.reshape(-1).view(torch.uint8)
    groups = k // MXFP4_BLOCK
    count = 1
    for d in lead:
        count *= d
    if data.numel() != count * groups * GGUF_BLOCK_BYTES:
        raise ValueError(f"{data.numel()} MXFP4 bytes do not hold a {list(shape)} tensor")
    blk = data.reshape(*lead, groups, GGUF_BLOCK_BYTES)
    qs = blk[..., 1:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [..., G, 32]: the elements in order
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), blk[..., 0].contiguous()


def linear_reference(
    x: Tensor,  # [M, K] fp32
    blocks: Tensor,  # [N, K / 32, 16] uint8
    scales: Tensor,  # [N, K / 32] uint8
    bias: Tensor | None = None,  # [N]
) -> Tensor:  # [M, N] fp32
    """x @ W^T (+ bias) in float64 over the dequantized W, rounded once to fp32."""
    y = x.double() @ dequantize_mxfp4(blocks, scales).double().t()
    return (y if bias is None else y + bias.double()).float()


def check_args(
    x: Tensor,  # [M, K] fp32, unit stride along K
    blocks: Tensor,  # [N, K / 32, 16] uint8, contiguous
    scales: Tensor,  # [N, K / 32] uint8, contiguous
    bias: Tensor | None,  # [N] fp32 contiguous
    out: Tensor | None,  # [M, N] fp32, unit stride along N
) -> Tensor:  # out, allocated when None
    """Raises TypeError for a dtype or device, ValueError for a shape or layout the kernel cannot take,
    each naming the argument."""
    for name, t in (("x", x), ("blocks", blocks), ("scales", scales), ("bias", bias), ("out", out)):
        if t is not None and t.device.type != "cpu":
            raise TypeError(f"{name} must be on the CPU, got {t.device}")
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if (
        blocks.dim() != 3
        or blocks.shape[2] != MXFP4_BLOCK // 2
        or tuple(scales.shape) != tuple(blocks.shape[:2])
    ):
        raise ValueError(
            f"blocks must be [N, K / 32, 16] and scales [N, K / 32], got {tuple(blocks.shape)} and "
            f"{tuple(scales.shape)}"
        )
    if not (blocks.is_contiguous() and scales.is_contiguous()):
        raise ValueError("blocks and scales must be contiguous")
    n, groups = blocks.shape[0], blocks.shape[1]
    if x.dtype != torch.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    if x.dim() != 2 or x.shape[1] % MXFP4_BLOCK or x.shape[1] != groups * MXFP4_BLOCK or groups == 0:
        raise ValueError(
            f"x must be [M, K] with K a positive multiple of {MXFP4_BLOCK} equal to the weight's "
            f"{groups * MXFP4_BLOCK}, got {tuple(x.shape)}"
        )
    if x.stride(1) != 1 or (x.shape[0] > 1 and x.stride(0) < x.shape[1]):
        raise ValueError(
            f"x must have unit stride along K and rows at least K apart, got strides {x.stride()}"
        )
    if bias is not None and (
        bias.dtype != torch.float32 or tuple(bias.shape) != (n,) or not bias.is_contiguous()
    ):
        raise ValueError(f"bias must be a contiguous float32 [{n}], got {bias.dtype} {tuple(bias.shape)}")
    m = x.shape[0]
    if out is None:
        return torch.empty(m, n, dtype=torch.float32)
    if out.dtype != torch.float32 or tuple(out.shape) != (m, n) or out.stride(1) != 1 or out.stride(0) < n:
        raise ValueError(
            f"out must be float32 [{m}, {n}] with unit stride along N, got {out.dtype} {tuple(out.shape)} "
            f"strides {out.stride()}"
        )
    return out


@dataclass(frozen=True)
class Mxfp4Kernel:
    """The loaded library and the path it runs; `linear` is the checked launcher."""

    lib: ctypes.CDLL
    path: Path
    isa: str  # one of PATHS: the code path running here

    def linear(
        self,
        x: Tensor,  # [M, K] fp32, unit stride along K
        blocks: Tensor,  # [N, K / 32, 16] uint8, contiguous
        scales: Tensor,  # [N, K / 32] uint8, contiguous
        bias: Tensor | None = None,  # [N] fp32 contiguous
        out: Tensor | None = None,  # [M, N] fp32, unit stride along N
    ) -> Tensor:  # [M, N] fp32: x @ W^T (+ bias)
        """Raises TypeError/ValueError for arguments it cannot take (check_args), RuntimeError when the
        kernel refuses them anyway."""
        out = check_args(x, blocks, scales, bias, out)
        m, n = out.shape
        if m == 0 or n == 0:
            return out
        rc = self.lib.kubeinfer_mxfp4_linear(
            blocks.data_ptr(),
            scales.data_ptr(),
            n,
            x.shape[1],
            x.data_ptr(),
            m,
            max(x.stride(0), x.shape[1]),  # one row: its stride is arbitrary
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"mxfp4 kernel returned {rc} for x {tuple(x.shape)}, W [{n}, {x.shape[1]}]")
        return out

    def set_path(self, name: str) -> str:
        """Runs path `name` (lowered to what the CPU reports); returns the path now in use. Process-wide:
        for tests and benchmarks, never while another thread runs the kernel."""
        return PATHS[int(self.lib.kubeinfer_mxfp4_set_path(PATHS.index(name)))]


@functools.cache
def load_mxfp4_kernel(cache_dir: Path | None = None) -> Mxfp4Kernel:
    """Builds (or finds) and loads the kernel, its path set from the usable CPU features; raises
    KernelBuildError if it cannot be built."""
    lib, path = load_library(NATIVE, cache_dir or default_cache_dir())
    i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    lib.kubeinfer_mxfp4_linear.restype = i32
    lib.kubeinfer_mxfp4_linear.argtypes = [ptr, ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i32]
    lib.kubeinfer_mxfp4_set_path.restype = i32
    lib.kubeinfer_mxfp4_set_path.argtypes = [i32]
    wanted = path_for(usable_cpu_features(cache_dir))
    isa = PATHS[int(lib.kubeinfer_mxfp4_set_path(PATHS.index(wanted)))]
    return Mxfp4Kernel(lib, path, isa)


def try_load_mxfp4_kernel(cache_dir: Path | None = None) -> Mxfp4Kernel | None:
    """The kernel, or None (logged once) when it cannot be built: the dequantize + GEMM path then serves."""
    try:
        return load_mxfp4_kernel(cache_dir)
    except (KernelBuildError, OSError) as e:
        _warn_once(str(e))
        return None


@functools.cache
def _warn_once(reason: str) -> None:
    log.warning("MXFP4 CPU kernel unavailable, MXFP4 experts are dequantized per step: %s", reason)
