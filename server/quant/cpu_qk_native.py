"""GGUF Q4_K and Q6_K weights held as the file's own super-blocks, and the kernel that reads them (csrc/qk_native.cpp).

`KQuantBlocks` keeps a [N, K] k-quant weight as GGUF stores it: rows of 256-value super-blocks
(block_q4_K, 144 bytes = 4.5 bits/weight; block_q6_K, 210 bytes = 6.5625 bits/weight; ggml-common.h),
instead of the repacked BlockQuantWeight (6.0 and 10.0 bits/weight, cpu_qlinear.py's table). Both can
also be held as 16-row tiles, `q4_k_x16` (4.625 bits/weight) and `q6_k_x16` (6.5625): the same values
re-laid at load (`interleave`; layouts in qk_native.cpp's header), so that each int8 dot product (one
AVX512-VNNI vector, or two AVX2 halves) serves 16 output rows: the layout batches of rows need (the row-major blocks run 16 rows at 0.5-0.7x of
the int8 packed copy's speed). Q5_K, IQ4_XS, Q3_K and Q2_K run as such tiles only (`q5_k_x16` 5.625,
`iq4_xs_x16` 4.3125, `q3_k_x16` 3.5625, `q2_k_x16` 2.625 bits/weight against the files' 5.5, 4.25, 3.4375,
2.625), written and read back by the compiled library alone (`interleave`, `deinterleave`). The kernel
quantizes each row of x per 256 values to int8 (ggml's q8_K idea: fp32 dx = max|x| / 127, round half to
even, per-16 sums of q for the min and offset terms) and runs the dot products on integers (AVX512-VNNI
`vpdpbusd`; AVX2 `vpmaddubsw` + `vpmaddwd` on the tiles, the same integer sums; else scalar C++, chosen at
run time from `usable_cpu_features()`), one pass over each weight super-block serving up to 8 rows of x
(qk_native.cpp's TILE_M).

Its result is W @ x^ up to fp32 rounding, x^ = dx q the activations as quantized
(`quantize_activations_reference`, `linear_reference`); against fp32 activations the error per output
is at most sum_b (dx_b / 2) sum_{k in b} |w_k| (`activation_error_bound`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from server.config import default_cache_dir
from server.cpu_features import int8_dot_path as path_for  # qgemv_q8's too
from server.native import KernelBuildError, NativeSource, load_library, usable_cpu_features

SOURCE = Path(__file__).with_name("csrc") / "qk_native.cpp"
# 2: kubeinfer_qk_qlinear / kubeinfer_qk_dequant over qlinear's descriptor; 3: Q4_K x16 tiles; 4: Q6_K's;
# 5: Q8_0's (32-value blocks, cpu_qlinear.interleave_q8_x16; run through qlinear's descriptor only); 6: Q5_0's;
# 7: Q5_K, IQ4_XS, Q3_K and Q2_K tiles (kubeinfer_qk_deinterleave); 8: the avx2 path (kubeinfer_qk_set_path 1);
# 9: IQ4_NL's tiles at 4 bits (its 8-bit ones gone) and Q5_1's; 10: the amx path (kubeinfer_qk_set_amx,
# kubeinfer_qk_linear_bf16)
ABI_VERSION = 10
# No -ffast-math: the quantized activations must equal the torch reference's bit for bit; no FMA contraction:
# the dequantized values must equal gguf-py's (each product rounded).
NATIVE = NativeSource(
    "qk_native",
    SOURCE,
    ("-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c++20", "-ffp-contract=off"),
    abi_version=ABI_VERSION,
)
QK_K = 256  # values per super-block
# bytes per row per 256 values: sizeof(block_q4_K), sizeof(block_q6_K), and a 16-row x16 tile's 2368 / 16
# (block_q4_K, block_q6_K, block_q5_K, block_iq4_xs, block_q3_K, block_q2_K: ggml-common.h)
SUPER_BLOCK_BYTES = {
    "q4_k": 144,
    "q6_k": 210,
    "q5_k": 176,
    "iq4_xs": 136,
    "q3_k": 110,
    "q2_k": 84,
    "q4_k_x16": 148,
    "q6_k_x16": 210,
    "q5_k_x16": 180,
    "iq4_xs_x16": 138,
    "q3_k_x16": 114,
    "q2_k_x16": 84,
}
# qk_native.cpp's FMT_*: what kubeinfer_qk_linear runs (the row-major q5_k .. q2_k codes only feed its re-lay)
FORMAT_CODES = {
    "q4_k": 0,
    "q6_k": 1,
    "q4_k_x16": 2,
    "q6_k_x16": 3,
    "q5_k_x16": 6,
    "iq4_xs_x16": 7,
    "q3_k_x16": 8,
    "q2_k_x16": 9,
    "q5_k": 10,
    "iq4_xs": 11,
    "q3_k": 12,
    "q2_k": 13,
}
ROW_MAJOR_RUNS = ("q4_k", "q6_k")  # the file formats the kernel also runs row-major (the others: tiles only)
# a file's format -> its 16-row tiles
TILED = {
    "q4_k": "q4_k_x16",
    "q6_k": "q6_k_x16",
    "q5_k": "q5_k_x16",
    "iq4_xs": "iq4_xs_x16",
    "q3_k": "q3_k_x16",
    "q2_k": "q2_k_x16",
}
X16_ROWS = 16  # weight rows per tile
X16_TILE_BYTES = {t: 16 * SUPER_BLOCK_BYTES[t] for t in TILED.values()}  # 2368, 3360, 2880, 2208, 1824, 1344
# tiles whose layout only the compiled library writes and reads back (no torch twin of the re-lay)
COMPILED_TILES = ("q5_k_x16", "iq4_xs_x16", "q3_k_x16", "q2_k_x16")
GGUF_TYPES = {
    "q4_k": "Q4_K",
    "q6_k": "Q6_K",
    "q5_k": "Q5_K",
    "iq4_xs": "IQ4_XS",
    "q3_k": "Q3_K",
    "q2_k": "Q2_K",
}
# kubeinfer_qk_set_path's codes; avx2 runs the tiles (every format) as vnni does, the row-major q4_k / q6_k
# blocks scalar
PATHS = {"scalar": 0, "avx2": 1, "vnni": 2}
PATH_NAMES = {code: name for name, code in PATHS.items()}
# The amx path (qk_native.cpp, "amx path"): bf16 layers' batches over Q4_K / Q6_K x16 tiles from this many
# rows where AMX-BF16 is usable, as round_bf16(x) @ round_bf16(W)^T with fp32 sums on AMX tiles (the numerics
# of the dequantize + bf16 GEMM those layers take from 256 rows). KUBEINFER_QK_AMX: unset the default, `0`
# off, a positive integer the fewest rows.
AMX_ENV = "KUBEINFER_QK_AMX"
AMX_TILED = ("q4_k_x16", "q6_k_x16")
AMX_MIN_ROWS = 32


@dataclass(frozen=True)
class KQuantBlocks:
    """A [N, K] weight as GGUF k-quant super-blocks, row-major: row n is K / 256 blocks of `fmt`."""

    blocks: Tensor  # [N, K / 256 * SUPER_BLOCK_BYTES[fmt]] uint8, contiguous, CPU
    fmt: str  # a key of SUPER_BLOCK_BYTES: a file's row-major blocks or their 16-row tiles
    in_features: int  # K, a multiple of 256
    out_features: int  # N

    def __post_init__(self) -> None:
        if self.fmt not in SUPER_BLOCK_BYTES:
            raise ValueError(
                f"unknown k-quant format {self.fmt!r}; expected one of {sorted(SUPER_BLOCK_BYTES)}"
            )
        n, k = self.out_features, self.in_features
        if k <= 0 or k % QK_K:
            raise ValueError(f"K ({k}) must be a positive multiple of {QK_K}")
        if self.fmt in X16_TILE_BYTES and n % X16_ROWS:
            raise ValueError(f"{self.fmt} holds whole tiles of {X16_ROWS} rows, N={n}")
        row = k // QK_K * SUPER_BLOCK_BYTES[self.fmt]
        b = self.blocks
        if tuple(b.shape) != (n, row) or b.dtype != torch.uint8:
            raise ValueError(f"blocks must be [{n}, {row}] uint8, got {tuple(b.shape)} {b.dtype}")
        if b.device.type != "cpu" or not b.is_contiguous():
            raise ValueError("blocks must be a contiguous CPU tensor")

    def nbytes(self) -> int:
        return self.blocks.numel()

    def bits_per_weight(self) -> float:
        return 8.0 * SUPER_BLOCK_BYTES[self.fmt] / QK_K


def from_gguf(raw: np.ndarray | Tensor, fmt: str, n: int, k: int) -> KQuantBlocks:
    """GGUF tensor data of a k-quant type (`fmt` a key of GGUF_TYPES; any shape holding n * k / 256 blocks)
    -> KQuantBlocks holding a copy of its bytes (a memory map stays read-only and unreferenced).
    ValueError for an unknown format, a K that is no whole number of blocks, or the wrong byte count."""
    if fmt not in GGUF_TYPES:
        raise ValueError(f"unknown k-quant format {fmt!r}; expected one of {sorted(SUPER_BLOCK_BYTES)}")
    if k <= 0 or k % QK_K:
        raise ValueError(f"GGUF k-quant rows must hold whole {QK_K}-value super-blocks, K={k}")
    with warnings.catch_warnings():  # a read-only memory map: nothing here writes to it
        warnings.simplefilter("ignore", UserWarning)
        data = torch.as_tensor(np.ascontiguousarray(raw)).view(torch.uint8).reshape(-1)
    row = k // QK_K * SUPER_BLOCK_BYTES[fmt]
    if data.numel() != n * row:
        raise ValueError(f"{fmt} [{n}, {k}] needs {n * row} bytes, got {data.numel()}")
    return KQuantBlocks(data.reshape(n, row).clone(), fmt, k, n)


def _rows(a: Tensor, n: int) -> Tensor:  # [T, nb, ..., 16] per tile -> [N, nb, ...] per row
    return a.movedim(-1, 1).reshape(n, a.shape[1], *a.shape[2:-1])


def _q6x_fields(blocks: Tensor, n: int, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """A q6_k_x16 tensor's fields in row order: d [N, nb] fp32, sc [N, nb, 16] int64 (signed) and the
    six-bit values [N, nb, 256] int64 (0..63, before the -32 offset) in k order."""
    nb = k // QK_K
    t = blocks.reshape(n // X16_ROWS, nb, X16_TILE_BYTES["q6_k_x16"])
    d = t[:, :, 0:32].contiguous().view(torch.float16).float()  # [T, nb, 16]
    runs = t[:, :, 32:].reshape(-1, nb, 8, 416)  # one run per 32-value chunk J: scales, ql, qh
    sc = runs[..., 0:32].contiguous().view(torch.int8).long().reshape(-1, nb, 8, 16, 2)  # [T, nb, J, r, h]
    sc = sc.permute(0, 1, 2, 4, 3).reshape(-1, nb, 16, 16)  # [T, nb, j, r]
    ql = runs[..., 32:288].reshape(-1, nb, 8, 4, 16, 4).long()  # [T, nb, J, g, r, i]
    qh = runs[..., 288:].reshape(-1, nb, 8, 2, 16, 4).long()  # [T, nb, J, h, r, i]
    low = torch.stack([ql & 15, ql >> 4], dim=3)  # [T, nb, J, h, g, r, i]
    high = torch.stack([(qh >> (2 * g)) & 3 for g in range(4)], dim=4)  # [T, nb, J, h, g, r, i]
    v = (low | (high << 4)).permute(0, 5, 1, 2, 3, 4, 6).reshape(n, nb, QK_K)  # k = 32J + 16h + 4g + i
    return _rows(d, n), _rows(sc, n), v


def _x16_fields(blocks: Tensor, n: int, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """A q4_k_x16 tensor's fields in row order: d, dmin [N, nb] fp32, sc, mn [N, nb, 8] int64 and the
    values [N, nb, 256] int64 in k order."""
    nb = k // QK_K
    t = blocks.reshape(n // X16_ROWS, nb, X16_TILE_BYTES["q4_k_x16"])  # [T, nb, 2368]
    d = t[:, :, 0:32].contiguous().view(torch.float16).float()  # [T, nb, 16]
    dmin = t[:, :, 32:64].contiguous().view(torch.float16).float()
    sc = t[:, :, 64:192].reshape(-1, nb, 8, 16).long()  # [T, nb, j, r]
    mn = t[:, :, 192:320].reshape(-1, nb, 4, 16, 2).long().permute(0, 1, 2, 4, 3).reshape(-1, nb, 8, 16)
    qs = t[:, :, 320:].reshape(-1, nb, 8, 4, 16, 4).long()  # [T, nb, j, g, r, i]
    v = torch.stack([qs & 15, qs >> 4], dim=3)  # [T, nb, j, half, g, r, i]: k = 32j + 16 half + 4g + i
    v = v.permute(0, 5, 1, 2, 3, 4, 6).reshape(n, nb, QK_K)  # [N, nb, 256]
    return _rows(d, n), _rows(dmin, n), _rows(sc, n), _rows(mn, n), v


def _interleave_q6k(w: KQuantBlocks) -> KQuantBlocks:
    n, k = w.out_features, w.in_features
    nb, tiles = k // QK_K, n // X16_ROWS
    blocks = w.blocks.reshape(tiles, X16_ROWS, nb, 210).transpose(1, 2)  # [T, nb, r, 210]
    ql = blocks[..., :128].reshape(tiles, nb, X16_ROWS, 2, 1, 64)
    qh = blocks[..., 128:192].reshape(tiles, nb, X16_ROWS, 2, 1, 32)
    low = torch.cat([ql & 15, ql >> 4], dim=4).reshape(
        tiles, nb, X16_ROWS, 2, 4, 32
    )  # [.., half, quarter, l]
    high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=4)  # [.., half, quarter, l]
    v = (low | (high << 4)).reshape(tiles, nb, X16_ROWS, 8, 2, 4, 4)  # k = 32J + 16h + 4g + i
    lo = v & 15
    packed = lo[..., 0, :, :] | (lo[..., 1, :, :] << 4)  # [T, nb, r, J, g, i]
    hi = (v >> 4).to(torch.int32)  # [T, nb, r, J, h, g, i]
    hbits = sum(hi[..., g, :] << (2 * g) for g in range(4))  # [T, nb, r, J, h, i]
    assert isinstance(hbits, Tensor)
    sc = blocks[..., 192:208].reshape(tiles, nb, X16_ROWS, 8, 2)  # [T, nb, r, p, h] (int8 bytes)
    runs = torch.cat(
        [
            sc.permute(0, 1, 3, 2, 4).reshape(tiles, nb, 8, 32),  # [J][r, h]
            packed.permute(0, 1, 3, 4, 2, 5).reshape(tiles, nb, 8, 256),  # [J][g, r, i]
            hbits.to(torch.uint8).permute(0, 1, 3, 4, 2, 5).reshape(tiles, nb, 8, 128),  # [J][h, r, i]
        ],
        dim=3,
    )
    out = torch.cat([blocks[..., 208:210].reshape(tiles, nb, 32), runs.reshape(tiles, nb, 3328)], dim=2)
    return KQuantBlocks(out.reshape(n, nb * 210).contiguous(), "q6_k_x16", k, n)


def interleave_reference(w: KQuantBlocks) -> KQuantBlocks:
    """Q4_K / Q6_K rows -> their 16-row tiles in torch (qk_native.cpp's header gives the layouts): what
    QKNativeKernel.interleave writes, byte for byte. ValueError unless w is q4_k or q6_k with N a multiple
    of 16."""
    n, k = w.out_features, w.in_features
    if w.fmt not in ROW_MAJOR_RUNS or n % X16_ROWS:
        raise ValueError(
            f"interleaving takes q4_k or q6_k with N a multiple of {X16_ROWS}, got {w.fmt} N={n}"
        )
    if w.fmt == "q6_k":
        return _interleave_q6k(w)
    from gguf.quants import Q4_K

    nb, tiles = k // QK_K, n // X16_ROWS
    blocks = w.blocks.reshape(tiles, X16_ROWS, nb, 144).transpose(1, 2)  # [T, nb, r, 144]
    sc_np, m_np = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12).numpy())
    sc = torch.from_numpy(sc_np.astype(np.uint8)).reshape(tiles, nb, X16_ROWS, 8)
    mn = torch.from_numpy(m_np.astype(np.uint8)).reshape(tiles, nb, X16_ROWS, 8)
    qs = blocks[..., 16:].reshape(tiles, nb, X16_ROWS, 4, 32)
    v = torch.stack([qs & 15, qs >> 4], dim=4).reshape(tiles, nb, X16_ROWS, 8, 2, 4, 4)  # [.., j, half, g, i]
    packed = v[..., 0, :, :] | (v[..., 1, :, :] << 4)  # [T, nb, r, j, g, i]
    out = torch.cat(
        [
            blocks[..., 0:2].reshape(tiles, nb, 32),
            blocks[..., 2:4].reshape(tiles, nb, 32),
            sc.transpose(2, 3).reshape(tiles, nb, 128),  # [j, r]
            mn.reshape(tiles, nb, X16_ROWS, 4, 2).permute(0, 1, 3, 2, 4).reshape(tiles, nb, 128),  # [p, r, 2]
            packed.permute(0, 1, 3, 4, 2, 5).reshape(tiles, nb, 2048),  # [j, g, r, i]
        ],
        dim=2,
    )
    return KQuantBlocks(out.reshape(n, nb * SUPER_BLOCK_BYTES["q4_k_x16"]).contiguous(), "q4_k_x16", k, n)


def dequantize_reference(w: KQuantBlocks) -> Tensor:  # -> [N, K] fp32
    """gguf-py's dequantization of the blocks (`gguf.quants.dequantize`): the values the kernel multiplies.
    COMPILED_TILES: gguf-py's dequantization of the file blocks they hold (QKNativeKernel.deinterleave). Other
    tiles: gguf-py's formulas, (d * sc) * q - dmin * m (Q4_K) and (d * sc) * (q - 32) (Q6_K) in fp32, over
    the tiles' fields."""
    if w.fmt in COMPILED_TILES:  # the file's blocks back (byte for byte), then gguf-py's dequantization
        return dequantize_reference(load_qk_native_kernel().deinterleave(w))
    if w.fmt == "q6_k_x16":
        d6, sc6, v6 = _q6x_fields(w.blocks, w.out_features, w.in_features)
        j16 = torch.arange(QK_K) // 16
        dense6 = (d6[..., None] * sc6[..., j16].float()) * (v6 - 32).float()
        return dense6.reshape(w.out_features, w.in_features)
    if w.fmt == "q4_k_x16":
        d, dmin, sc, mn, v = _x16_fields(w.blocks, w.out_features, w.in_features)
        j = torch.arange(QK_K) // 32
        dense = (d[..., None] * sc[..., j].float()) * v.float() - dmin[..., None] * mn[..., j].float()
        return dense.reshape(w.out_features, w.in_features)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = getattr(GGMLQuantizationType, GGUF_TYPES[w.fmt])
    values = dequantize(w.blocks.numpy(), qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(
        w.out_features, w.in_features
    )


def quantize_activations_reference(x: Tensor) -> Tensor:  # x: [M, K] fp32 -> [M, K] fp32 x^ = dx * q
    """x as the kernel quantizes it: per 256 values dx = max|x| / 127, q = round-half-even(x * (1 / dx))."""
    m, k = x.shape
    xb = x.float().reshape(m, k // QK_K, QK_K)
    d = xb.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(xb * inv) * d).reshape(m, k)


def linear_reference(x: Tensor, w: KQuantBlocks) -> Tensor:  # x: [M, K] fp32 -> [M, N] fp32
    """W @ x^ in fp64, rounded to fp32: what the kernel computes, up to its fp32 summation order."""
    return (quantize_activations_reference(x).double() @ dequantize_reference(w).double().t()).float()


def linear_bf16_reference(x: Tensor, w: KQuantBlocks) -> Tensor:  # x: [M, K] fp32 -> [M, N] fp32
    """round_bf16(x) @ round_bf16(W)^T in fp64, rounded to fp32: what the amx path computes, up to its fp32
    summation order (W as dequantize_reference gives it, then rounded to nearest even)."""
    xb = x.float().bfloat16().double()
    wb = dequantize_reference(w).bfloat16().double()
    return (xb @ wb.t()).float()


def activation_error_bound(x: Tensor, w: KQuantBlocks) -> Tensor:  # x: [M, K] -> [M, N] fp32
    """Per output, the most the int8 activations can move W @ x: sum_b (dx_b / 2) sum_{k in b} |w_k|."""
    m, k = x.shape
    dx = x.float().reshape(m, k // QK_K, QK_K).abs().amax(-1) / 127.0  # [M, K / 256]
    wabs = dequantize_reference(w).abs().reshape(w.out_features, k // QK_K, QK_K).sum(-1)  # [N, K / 256]
    return (dx / 2) @ wabs.t()


@dataclass(frozen=True)
class QKNativeKernel:
    """The loaded library; `linear` checks its arguments (a wrong pointer would crash)."""

    lib: ctypes.CDLL
    path: Path
    isa: str  # "vnni", "avx2" or "scalar": the path in use

    @property
    def amx_min_rows(self) -> int:
        """The fewest rows of a bf16 layer's batch that take the amx path now; 0 off (the library's state,
        process-wide: every QKNativeKernel over it reads the same)."""
        return int(self.lib.kubeinfer_qk_amx_min_rows())

    def set_amx(self, min_rows: int) -> int:
        """Sends bf16 layers' batches of at least `min_rows` rows over Q4_K / Q6_K x16 tiles to the amx path
        (0: off) where AMX-BF16 is usable and Linux grants the tile data; returns the value in use (0 where
        it cannot run). Process-wide: never while another thread runs the kernel."""
        if min_rows < 0:
            raise ValueError(f"min_rows must be >= 0, got {min_rows}")
        return int(self.lib.kubeinfer_qk_set_amx(min_rows))

    def set_path(self, name: str) -> str:
        """Runs `name` ("vnni", "avx2", "scalar") from now on where this CPU can (tests, benchmarks; a path
        this CPU lacks falls to the best below it); returns the path in use. Process-wide: never while
        another thread runs the kernel."""
        if name not in PATHS:
            raise ValueError(f"unknown path {name!r}; expected one of {sorted(PATHS)}")
        got = int(self.lib.kubeinfer_qk_set_path(PATHS[name]))
        object.__setattr__(self, "isa", PATH_NAMES[got])
        return self.isa

    def linear(
        self,
        x: Tensor,  # [M, K] fp32, unit stride along K
        w: KQuantBlocks,
        out: Tensor | None = None,  # [M, N] fp32, unit stride along N
    ) -> Tensor:  # [M, N] fp32
        """W @ x^ (module docstring). TypeError for a non-CPU or non-fp32 x, ValueError for a shape or
        stride the kernel cannot take, RuntimeError if the kernel refuses its arguments."""
        if w.fmt not in ROW_MAJOR_RUNS and w.fmt not in X16_TILE_BYTES:
            raise ValueError(f"{w.fmt} runs as its 16-row tiles ({TILED[w.fmt]}: interleave), not row-major")
        out, rc = self._call(self.lib.kubeinfer_qk_linear, x, w, out)
        if rc != 0:
            raise RuntimeError(
                f"qk_native kernel returned {rc} for {w.fmt} [{w.out_features}, {w.in_features}]"
            )
        return out

    def linear_bf16(
        self,
        x: Tensor,  # [M, K] fp32, unit stride along K
        w: KQuantBlocks,  # q4_k_x16 or q6_k_x16
        out: Tensor | None = None,  # [M, N] fp32, unit stride along N
    ) -> Tensor:  # [M, N] fp32
        """round_bf16(x) @ round_bf16(W)^T on the amx path at any M (`linear_bf16_reference`). TypeError for
        a non-CPU or non-fp32 x, ValueError for another format or a shape the kernel cannot take,
        RuntimeError where the amx path is off (`set_amx`)."""
        if w.fmt not in AMX_TILED:
            raise ValueError(f"the amx path takes {'/'.join(AMX_TILED)}, got {w.fmt}")
        out, rc = self._call(self.lib.kubeinfer_qk_linear_bf16, x, w, out)
        if rc == 2:
            raise RuntimeError("the amx path is off (no usable AMX-BF16, or turned off: set_amx)")
        if rc != 0:
            raise RuntimeError(
                f"qk_native amx kernel returned {rc} for {w.fmt} [{w.out_features}, {w.in_features}]"
            )
        return out

    def _call(self, fn: Any, x: Tensor, w: KQuantBlocks, out: Tensor | None) -> tuple[Tensor, int]:
        """`fn` (kubeinfer_qk_linear or _linear_bf16: the same signature) on x [M, K] into out [M, N] (made,
        or checked); returns out and the kernel's code (0 for an empty product, which is not called).
        TypeError for a non-CPU or non-fp32 x, ValueError for a shape or stride the kernel cannot take."""
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise TypeError(f"x must be a CPU fp32 tensor, got {x.dtype} on {x.device}")
        if x.dim() != 2 or x.shape[1] != w.in_features:
            raise ValueError(f"x must be [M, {w.in_features}], got {tuple(x.shape)}")
        if x.stride(1) != 1:
            x = x.contiguous()
        m, n = x.shape[0], w.out_features
        if out is None:
            out = torch.empty(m, n, dtype=torch.float32)
        elif out.dtype != torch.float32 or tuple(out.shape) != (m, n) or (n > 1 and out.stride(1) != 1):
            raise ValueError(f"out must be [{m}, {n}] fp32 with unit stride along N")
        if m == 0 or n == 0:
            return out, 0
        rc = fn(
            FORMAT_CODES[w.fmt],
            w.blocks.data_ptr(),
            n,
            w.in_features,
            x.data_ptr(),
            m,
            x.stride(0),
            out.data_ptr(),
            out.stride(0),
            torch.get_num_threads(),
        )
        return out, int(rc)

    def interleave(self, w: KQuantBlocks) -> KQuantBlocks:
        """A file's k-quant rows (a key of TILED) -> their 16-row tiles (for q4_k / q6_k
        interleave_reference's bytes). ValueError unless w is such rows with N a multiple of 16."""
        n = w.out_features
        if w.fmt not in TILED or n % X16_ROWS:
            raise ValueError(
                f"interleaving takes {'/'.join(TILED)} rows with N a multiple of {X16_ROWS}, got {w.fmt} N={n}"
            )
        return self._relay(self.lib.kubeinfer_qk_interleave, w, TILED[w.fmt])

    def deinterleave(self, w: KQuantBlocks) -> KQuantBlocks:
        """COMPILED_TILES -> the file's rows they were made from, byte for byte (interleave's inverse).
        ValueError for another format."""
        if w.fmt not in COMPILED_TILES:
            raise ValueError(f"the compiled de-interleave takes {'/'.join(COMPILED_TILES)}, got {w.fmt}")
        return self._relay(self.lib.kubeinfer_qk_deinterleave, w, FILE_OF[w.fmt])

    @staticmethod
    def _relay(fn: Any, w: KQuantBlocks, to: str) -> KQuantBlocks:
        """`fn` (kubeinfer_qk_interleave or _deinterleave, arguments checked by the caller) writing w's
        values as format `to`; RuntimeError if the library refuses them."""
        n, k = w.out_features, w.in_features
        out = torch.empty(n, k // QK_K * SUPER_BLOCK_BYTES[to], dtype=torch.uint8)
        rc = fn(FORMAT_CODES[w.fmt], w.blocks.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"qk_native {fn.__name__} returned {rc} for {w.fmt} [{n}, {k}]")
        return KQuantBlocks(out, to, k, n)


FILE_OF = {tiled: fmt for fmt, tiled in TILED.items()}  # 16-row tiles -> the file format they hold


def usable_path(cache_dir: Path | None = None) -> str:
    """The path that may run here now (`path_for` of `usable_cpu_features`, minus KUBEINFER_CPU_DISABLE,
    read on every call; the loaded kernel keeps the path it was loaded with)."""
    return path_for(usable_cpu_features(cache_dir))


def vnni_usable(cache_dir: Path | None = None) -> bool:
    """Whether the vnni path may run here now (`usable_path`)."""
    return usable_path(cache_dir) == "vnni"


def load_qk_native_kernel(cache_dir: Path | None = None) -> QKNativeKernel:
    """Builds (or finds) and loads the kernel with the best path the usable CPU features allow
    (`usable_path`: vnni, avx2, scalar); raises KernelBuildError if it cannot be built."""
    # one load per library: a second first-load (None beside the default folder named) would set the
    # process-wide path and amx rows back to their defaults under a caller that had changed them
    return _load_qk_native_kernel(cache_dir or default_cache_dir())


@functools.cache
def _load_qk_native_kernel(cache_dir: Path, source: NativeSource = NATIVE) -> QKNativeKernel:
    """`source`: another version of the library's source (benchmarks/qk_native.py --against-source)."""
    lib, path = load_library(source, cache_dir)
    i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    lib.kubeinfer_qk_linear.restype = i32
    lib.kubeinfer_qk_linear.argtypes = [i32, ptr, i64, i64, ptr, i64, i64, ptr, i64, i32]
    lib.kubeinfer_qk_set_path.restype = i32
    lib.kubeinfer_qk_set_path.argtypes = [i32]
    lib.kubeinfer_qk_interleave.restype = i32
    lib.kubeinfer_qk_interleave.argtypes = [i32, ptr, i64, i64, ptr, i32]
    lib.kubeinfer_qk_deinterleave.restype = i32
    lib.kubeinfer_qk_deinterleave.argtypes = [i32, ptr, i64, i64, ptr, i32]
    lib.kubeinfer_qk_linear_bf16.restype = i32
    lib.kubeinfer_qk_linear_bf16.argtypes = [i32, ptr, i64, i64, ptr, i64, i64, ptr, i64, i32]
    lib.kubeinfer_qk_set_amx.restype = i64
    lib.kubeinfer_qk_set_amx.argtypes = [i64]
    lib.kubeinfer_qk_amx_min_rows.restype = i64
    lib.kubeinfer_qk_amx_min_rows.argtypes = []
    got = int(lib.kubeinfer_qk_set_path(PATHS[usable_path(cache_dir)]))
    kernel = QKNativeKernel(lib, path, PATH_NAMES[got])
    kernel.set_amx(default_amx_min_rows(cache_dir))
    return kernel


def amx_tiles_text(cache_dir: Path | None = None) -> str:
    """For the start-up log: the rows the amx path takes ("" where it is off or the kernel cannot load)."""
    kernel = try_load_qk_native_kernel(cache_dir)
    if kernel is None or kernel.amx_min_rows == 0:
        return ""
    return (
        f"Q4_K / Q6_K tiles: bf16 batches of {kernel.amx_min_rows}+ rows below the dequantize + GEMM's on AMX "
        f"tiles ({AMX_ENV}=0 keeps the int8 kernels)"
    )


def default_amx_min_rows(cache_dir: Path | None = None) -> int:
    """The amx path's fewest rows at load: KUBEINFER_QK_AMX's (`0` off, a positive integer), else
    AMX_MIN_ROWS where AMX-BF16 is usable (`usable_cpu_features`, less KUBEINFER_CPU_DISABLE), else 0.
    ValueError for another value of the variable."""
    text = os.environ.get(AMX_ENV, "").strip()
    if text and not (text.isascii() and text.isdigit()):
        raise ValueError(f"{AMX_ENV} must be 0 (off) or a positive number of rows, got {text!r}")
    rows = int(text) if text else AMX_MIN_ROWS
    return rows if rows and usable_cpu_features(cache_dir).amx_bf16 else 0


def try_load_qk_native_kernel(cache_dir: Path | None = None) -> QKNativeKernel | None:
    """The kernel, or None when it cannot be built (no compiler)."""
    try:
        return load_qk_native_kernel(cache_dir)
    except (KernelBuildError, OSError):
        return None
