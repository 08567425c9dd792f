"""Block-quantized weights and the compiled CPU kernel that multiplies by them (csrc/qlinear.cpp).

One layout, `BlockQuantWeight`, holds every weight-only format the CPU kernel runs, each row n of W[N, K]
(out_features x in_features, nn.Linear's orientation) being quantized values plus a scale (and maybe a
min) per group of `group_size` consecutive k:

    w[n, k] = scale[n, g] * (q[n, k] - zero_point) + min[n, g]        g = k // group_size

    format  bits  group  zero_point  min    scale  source
    q8_0    8     32     0           -      fp16   GGUF (ggml) block_q8_0
    q4_0    4     32     8           -      fp16   GGUF block_q4_0
    q4_1    4     32     0           yes    fp16   GGUF block_q4_1
    int8    8     K      0           -      fp32   our per-output-channel int8 (Int8Linear.quantize)
    int4    4     G      0           yes    fp32   int4 group-wise with zero points (AWQ, GPTQ, RTN)
    q4_k    4     32     0           yes    fp32   GGUF block_q4_K, repacked at load (below)
    q6_k    8     16     0           -      fp32   GGUF block_q6_K, repacked at load (below)
    q4_k/q6_k  6 (KQUANT_BITS): GGUF's own super-blocks as the file holds them, q [N, K / 256 * 144 or
            210] uint8, scales [N, 0]; run by csrc/qk_native.cpp through this kernel's entry points
            (cpu_qk_native.py). The GGUF loader holds Q6_K so where that kernel runs AVX512-VNNI
            (gguf_checkpoint.super_blocks_enabled): 6.56 bits per weight instead of 10.0
    q4_k_x16/q6_k_x16  6 (KQUANT_BITS), group_size X16_GROUP: the super-blocks re-laid in tiles of 16 rows
            (`interleave_x16`; q [N, K / 256 * 148 or 210], N a multiple of 16): how the loader holds
            Q4_K and Q6_K where that kernel runs AVX512-VNNI, 4.625 / 6.56 bits per weight, one copy for
            one row of x and for batches
    q8_0_x16/q5_0_x16/iq4_nl_x16/q5_1_x16  6 (KQUANT_BITS), group_size Q8X_GROUP: 32-value blocks with
            fp16 scales re-laid in tiles of 16 rows (`interleave_q8_x16` from the row-major weight;
            q [N, K / 32 * 34, 22, 18 or 24], N a multiple of 16; csrc/qk_native.cpp's header), at the
            file's bits per weight: Q8_0's 8-bit values (8.5), Q5_0's 5-bit ones (5.5), IQ4_NL's 4-bit
            codebook indices (4.5; looked up in the kernel), Q5_1's 5-bit values with fp16 d and m (6.0);
            one copy for one row of x and for batches (the row-major layouts held Q5_0 / IQ4_NL at 8.5
            bits, Q5_1 at 9.0, and took an int8 packed copy of 10 bits more for batches). How the loader
            holds them where the k-quant tiles are: IQ4_NL and Q5_1 wherever those are, Q8_0 and Q5_0
            on AVX512-VNNI (gguf_checkpoint.q8_tiles_enabled)
    q5_k_x16/iq4_xs_x16/q3_k_x16/q2_k_x16  6 (KQUANT_BITS), group_size X16_GROUP: Q5_K, IQ4_XS, Q3_K and
            Q2_K super-blocks in 16-row tiles (q [N, K / 256 * 180, 138, 114 or 84]; 5.625, 4.3125, 3.5625
            and 2.625 bits per weight, within 1/8 bit of the file's), written and read back only by
            csrc/qk_native.cpp; how the loader holds them where the Q4_K tiles are. Their row-major
            super-blocks (KQUANT_BITS, group_size 256) exist only on the way there
    q5_0 q5_1 q5_k q3_k q2_k iq4_nl iq4_xs: 8-bit, groups of 32 (16: q3_k, q2_k), repacked at load
            from GGUF's blocks (gguf_repack.py, which gives each one's scales, mins and memory): where no
            tiles are held

The k-quants' 256-value super-blocks hold 6-bit (Q4_K) or 8-bit (Q6_K) sub-block scales under one fp16
super-scale: w = d * sc_j * q - dmin * m_j (Q4_K, 32-value sub-blocks), w = d * sc_j * (q - 32) (Q6_K,
16-value sub-blocks). The loader folds them into one fp32 scale (and min) per sub-block: d * sc_j is an
11-bit by 6- or 8-bit product, exact in fp32, so the values are gguf-py's dequantization bit for bit.
The kernels then run them like any other group-wise layout; the price is memory: 6.0 bits per weight
for Q4_K (4.5 in the file) and 10.0 for Q6_K (6.56), still 5.3x and 3.2x under fp32.

4-bit values are packed as GGUF packs them: per 32-block of k, byte j holds k = j (low nibble) and
k = j + 16 (high nibble). The block formats are ggml's (ggml/src/ggml-common.h, gguf-py's quants.py).

`load_qlinear_kernel()` builds the kernel once (server/native.py); `QLinearKernel.linear` and
`.dequantize_rows` are its checked launchers; `dequantize_reference` and `linear_reference` are the
plain-torch references the tests hold the kernel to.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from server.config import default_cache_dir
from server.native import KernelBuildError, NativeSource, load_library, usable_cpu_features
from server.quant import cpu_qk_native as qk_native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "qlinear.cpp"
# 3: KiQWeight.compute (was reserved) asks for the bf16 batched path; 4: kubeinfer_qdequant_bf16
ABI_VERSION = 7  # 5: KiQWeight.packed; 6: bits KQUANT_BITS (k-quant super-blocks, run by csrc/qk_native.cpp);
# 7: KiQWeight.compute COMPUTE_INT8
# No -ffast-math: dequantized values must equal the reference bit for bit (no contraction into FMA
# where a rounding would differ, no flush-to-zero).
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c++20")
NATIVE = NativeSource("qlinear", SOURCE, COMPILE_FLAGS, abi_version=ABI_VERSION)
BLOCK = 32  # values per GGUF block
GEMV_MAX_ROWS = 4  # qlinear.cpp's default gemv_max_rows (benchmarks/cpu_qlinear.py `small_m`)
BF16_GEMV_MAX_ROWS = 3  # its bf16_gemv_max_rows: under bf16 compute the batched path starts at M = 4

# GGUF block layouts: bytes per 32-block, and whether a min follows the scale.
GGUF_BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}
QK_K = 256  # values per k-quant super-block
GGUF_SUPER_BLOCK_BYTES = {"q4_k": 144, "q6_k": 210}  # block_q4_K, block_q6_K (ggml-common.h)
# bytes per row per 256 values of each format held as super-blocks (KQUANT_BITS): the files' blocks, and
# their 16-row tiles (cpu_qk_native.py: Q4_K's 2368 bytes per 16 rows, ...)
SUPER_BLOCK_ROW_BYTES = dict(qk_native.SUPER_BLOCK_BYTES)  # + Q5_K / IQ4_XS / Q3_K / Q2_K and their tiles
# 32-value formats with fp16 scales (as loaded row-major: 8-bit values, Q5_1 with fp16 mins) -> their
# 16-row tiles (csrc/qk_native.cpp's FMT_Q8_0_X16, FMT_Q5_0_X16, FMT_IQ4_NL_X16, FMT_Q5_1_X16)
Q8_TILED = {"q8_0": "q8_0_x16", "q5_0": "q5_0_x16", "iq4_nl": "iq4_nl_x16", "q5_1": "q5_1_x16"}
Q8X_TILE_ROW_BYTES = {
    "q8_0_x16": 34,
    "q5_0_x16": 22,
    "iq4_nl_x16": 18,
    "q5_1_x16": 24,
}  # per row per 32-block
# bytes of one block's values in a tile (16 rows); its fp16 d (and Q5_1's m) make up the rest
Q8X_VALUE_BYTES = {"q8_0_x16": 512, "q5_0_x16": 320, "iq4_nl_x16": 256, "q5_1_x16": 320}
# ggml's kvalues_iq4nl (ggml-common.h): the 16 levels IQ4_NL's and IQ4_XS's 4-bit indices stand for
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
FORMATS = (
    "q4_0",
    "q4_1",
    "q8_0",
    "int8",
    "int4",
    "q4_k",
    "q6_k",
    *qk_native.TILED.values(),
    *Q8_TILED.values(),
)
# group_size of 16-row tiles (csrc/qk_native.cpp tells them from the files' row-major blocks by it)
X16_GROUP = qk_native.X16_ROWS * QK_K
Q8X_GROUP = qk_native.X16_ROWS * BLOCK  # the same for Q8_0's tiles
# `bits` of a weight held as GGUF's own k-quant super-blocks (Q4_K, Q6_K; cpu_qk_native.py): q is the
# blocks, [N, K / 256 * 144 or 210] uint8, scales an empty [N, 0] fp32, no mins, group_size 256.
KQUANT_BITS = 6
# layouts of our own -> the format whose values they hold (what /info and the load log name)
_LAYOUT_OF = {tiled: fmt for fmt, tiled in (qk_native.TILED | Q8_TILED).items()}
_Q8_LAYOUT_OF = {tiled: fmt for fmt, tiled in Q8_TILED.items()}


def file_format(fmt: str) -> str:
    """The quantization format a held layout `fmt` stores (q4_k_x16 -> q4_k, q8_0_x16 -> q8_0, ...; others
    are their own)."""
    return _LAYOUT_OF.get(fmt, fmt)


# GGUF types repacked into 8-bit groups at load (gguf_repack.py)
REPACKED_FORMATS = ("q5_0", "q5_1", "q5_k", "q3_k", "q2_k", "iq4_nl", "iq4_xs")


@dataclass(frozen=True)
class BlockQuantWeight:
    """A [N, K] weight kept quantized (layout in the module docstring)."""

    q: Tensor  # bits 8: [N, K] int8; bits 4: [N, K / 2] uint8
    scales: Tensor  # [N, groups] fp16 (GGUF formats) or fp32
    mins: Tensor | None  # [N, groups], scales' dtype, or None
    fmt: str
    bits: int
    group_size: int
    zero_point: int
    in_features: int  # K
    out_features: int  # N
    # [bytes] uint8: the int8 batched path's copy of W in its own order (cpu_qgemv_q8.pack_weight), or None.
    # Derived from q/scales/mins: not compared, and rows selected or stacked drop it.
    packed: Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        n, k, g = self.out_features, self.in_features, self.group_size
        if self.fmt not in FORMATS + REPACKED_FORMATS:
            raise ValueError(
                f"unknown block format {self.fmt!r}; expected one of {FORMATS + REPACKED_FORMATS}"
            )
        if self.bits == KQUANT_BITS:
            self._check_super_blocks()
            return
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        groups = -(-k // g)
        if self.bits == 4 and (k % BLOCK or (g % BLOCK and g != 16)):
            raise ValueError(
                f"4-bit weights need K ({k}) and group_size ({g}) to be multiples of {BLOCK} (or group_size 16)"
            )
        if self.bits == 8 and groups > 1 and g % 16:
            raise ValueError(f"8-bit weights with several groups need group_size ({g}) a multiple of 16")
        row_bytes = k if self.bits == 8 else k // 2
        q_dtype = torch.int8 if self.bits == 8 else torch.uint8
        if tuple(self.q.shape) != (n, row_bytes) or self.q.dtype != q_dtype:
            raise ValueError(
                f"q must be [{n}, {row_bytes}] {q_dtype}, got {tuple(self.q.shape)} {self.q.dtype}"
            )
        for name, t in (("scales", self.scales), ("mins", self.mins)):
            if t is None:
                continue
            if tuple(t.shape) != (n, groups) or t.dtype not in (torch.float16, torch.float32):
                raise ValueError(
                    f"{name} must be [{n}, {groups}] fp16 or fp32, got {tuple(t.shape)} {t.dtype}"
                )
        if self.mins is not None and self.mins.dtype != self.scales.dtype:
            raise ValueError("mins and scales must share a dtype")
        for name, t in (("q", self.q), ("scales", self.scales), ("mins", self.mins)):
            if t is not None and (t.device.type != "cpu" or not t.is_contiguous()):
                raise ValueError(f"{name} must be a contiguous CPU tensor")

    def _check_super_blocks(self) -> None:
        n, k = self.out_features, self.in_features
        if self.fmt in _Q8_LAYOUT_OF:
            self._check_q8_tiles()
            return
        tiled = self.fmt in _LAYOUT_OF
        if (
            self.fmt not in SUPER_BLOCK_ROW_BYTES
            or k % QK_K
            or self.group_size != (X16_GROUP if tiled else QK_K)
        ):
            raise ValueError(
                f"super-blocks are a GGUF k-quant's ({'/'.join(qk_native.TILED)}, group_size {QK_K}) or "
                f"their tiles (group_size {X16_GROUP}) with K a multiple of {QK_K}"
            )
        if tiled and n % qk_native.X16_ROWS:
            raise ValueError(f"{self.fmt} holds whole tiles of {qk_native.X16_ROWS} rows, N={n}")
        row = k // QK_K * SUPER_BLOCK_ROW_BYTES[self.fmt]
        if tuple(self.q.shape) != (n, row) or self.q.dtype != torch.uint8:
            raise ValueError(
                f"q must be [{n}, {row}] uint8 super-blocks, got {tuple(self.q.shape)} {self.q.dtype}"
            )
        if tuple(self.scales.shape) != (n, 0) or self.mins is not None or self.zero_point:
            raise ValueError("super-blocks carry their own scales: scales [N, 0], no mins, zero_point 0")
        if self.q.device.type != "cpu" or not self.q.is_contiguous():
            raise ValueError("q must be a contiguous CPU tensor")

    def _check_q8_tiles(self) -> None:
        n, k = self.out_features, self.in_features
        if k % BLOCK or self.group_size != Q8X_GROUP or n % qk_native.X16_ROWS:
            raise ValueError(
                f"{self.fmt} holds whole tiles of {qk_native.X16_ROWS} rows of {BLOCK}-value blocks "
                f"(group_size {Q8X_GROUP}), got N={n}, K={k}, group_size {self.group_size}"
            )
        row = k // BLOCK * Q8X_TILE_ROW_BYTES[self.fmt]
        if tuple(self.q.shape) != (n, row) or self.q.dtype != torch.uint8:
            raise ValueError(f"q must be [{n}, {row}] uint8 tiles, got {tuple(self.q.shape)} {self.q.dtype}")
        if tuple(self.scales.shape) != (n, 0) or self.mins is not None or self.zero_point:
            raise ValueError("tiles carry their own scales: scales [N, 0], no mins, zero_point 0")
        if self.q.device.type != "cpu" or not self.q.is_contiguous():
            raise ValueError("q must be a contiguous CPU tensor")

    @property
    def super_blocks(self) -> bool:
        """Whether W is held as GGUF's own k-quant super-blocks (KQUANT_BITS)."""
        return self.bits == KQUANT_BITS

    @property
    def groups(self) -> int:
        return -(-self.in_features // self.group_size)

    def tensors(self) -> list[Tensor]:
        return [t for t in (self.q, self.scales, self.mins) if t is not None]

    def nbytes(self) -> int:
        """Bytes held: q, scales, mins and the packed copy where there is one."""
        held = self.tensors() + ([] if self.packed is None else [self.packed])
        return sum(t.numel() * t.element_size() for t in held)

    def select_rows(self, index: Tensor) -> BlockQuantWeight:
        """Rows `index` ([N'] int64) of W, still quantized (a row permutation or a slice). Tiles give tiles
        again where N' is a multiple of 16 (whole tiles, each one's 16 rows in order, are taken as they
        are), else the rows as the file's own blocks (Q5_K / IQ4_XS / Q3_K / Q2_K, which run only as tiles: repacked,
        gguf_repack.py)."""
        tile = _whole_tiles(self, index)
        if tile is not None:
            per_tile = qk_native.X16_ROWS
            q = self.q.reshape(-1, per_tile * self.q.shape[1]).index_select(0, tile)
            return dataclasses.replace(
                self,
                q=q.reshape(-1, self.q.shape[1]),
                scales=torch.empty(tile.numel() * per_tile, 0),
                out_features=tile.numel() * per_tile,
                packed=None,
            )
        if self.fmt in qk_native.COMPILED_TILES:
            rows_w = deinterleave_x16(self).select_rows(index)
            return (
                interleave_x16(rows_w) if rows_w.out_features % qk_native.X16_ROWS == 0 else _repack(rows_w)
            )
        if self.fmt in _Q8_LAYOUT_OF:
            rows = deinterleave_q8_x16(self).select_rows(index)
            return interleave_q8_x16(rows) if q8_tileable(rows) else rows
        if self.fmt in _LAYOUT_OF:
            rows = deinterleave_x16(self).select_rows(index)
            return interleave_x16(rows) if rows.out_features % qk_native.X16_ROWS == 0 else rows
        return BlockQuantWeight(
            self.q.index_select(0, index).contiguous(),
            self.scales.index_select(0, index).contiguous(),
            None if self.mins is None else self.mins.index_select(0, index).contiguous(),
            self.fmt,
            self.bits,
            self.group_size,
            self.zero_point,
            self.in_features,
            int(index.numel()),
        )

    @staticmethod
    def concat_rows(parts: list[BlockQuantWeight]) -> BlockQuantWeight:
        """The rows of several weights of one format and K, stacked (fused q/k/v, gate/up)."""
        first = parts[0]
        for p in parts:
            if (p.fmt, p.in_features, p.group_size, p.scales.dtype) != (
                first.fmt,
                first.in_features,
                first.group_size,
                first.scales.dtype,
            ):
                raise ValueError("only weights of one format, K, group size and scale dtype concatenate")
        mins = None if first.mins is None else torch.cat([p.mins for p in parts if p.mins is not None])
        return BlockQuantWeight(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scales for p in parts]),
            mins,
            first.fmt,
            first.bits,
            first.group_size,
            first.zero_point,
            first.in_features,
            sum(p.out_features for p in parts),
        )


def _whole_tiles(w: BlockQuantWeight, index: Tensor) -> Tensor | None:
    """For a weight held in 16-row tiles: the tiles `index` selects whole, each one's 16 rows in order
    ([T'] int64; tiles in any order, repeats allowed), or None where it selects rows of a tile apart (or w
    is not tiles)."""
    rows = qk_native.X16_ROWS
    if not (w.super_blocks and w.group_size in (X16_GROUP, Q8X_GROUP)) or index.numel() % rows:
        return None
    per_tile = index.reshape(-1, rows)
    first = per_tile[:, 0]
    if (first % rows).any() or not torch.equal(per_tile, first[:, None] + torch.arange(rows)):
        return None
    return first // rows


def _repack(w: BlockQuantWeight) -> BlockQuantWeight:
    """A Q5_K / IQ4_XS / Q3_K / Q2_K weight as the file's row-major blocks -> its exact repack into 8-bit
    groups (gguf_repack.py): how rows of such a type that make no whole tile run."""
    from server.quant.gguf_repack import from_gguf_repacked

    return from_gguf_repacked(w.q, qk_native.GGUF_TYPES[w.fmt], w.out_features, w.in_features)


# ------------------------------------------------------------------ constructors


def from_gguf_blocks(raw: np.ndarray | Tensor, fmt: str, n: int, k: int) -> BlockQuantWeight:
    """GGUF tensor data ([N, K / 32 * block_bytes] uint8, rows of ggml blocks) -> a BlockQuantWeight.

    block_q4_0 = {fp16 d; uint8 qs[16]}, block_q4_1 = {fp16 d; fp16 m; uint8 qs[16]},
    block_q8_0 = {fp16 d; int8 qs[32]} (ggml-common.h)."""
    if fmt not in GGUF_BLOCK_BYTES:
        raise ValueError(f"{fmt!r} is not a GGUF block format the kernel runs ({sorted(GGUF_BLOCK_BYTES)})")
    if k % BLOCK:
        raise ValueError(f"GGUF rows must hold whole {BLOCK}-blocks, K={k}")
    size = GGUF_BLOCK_BYTES[fmt]
    with warnings.catch_warnings():  # a read-only memory map: nothing here writes to it
        warnings.simplefilter("ignore", UserWarning)
        data = torch.as_tensor(np.ascontiguousarray(raw)).view(torch.uint8)  # shares raw: copied below
    nb = k // BLOCK
    if data.numel() != n * nb * size:
        raise ValueError(f"{fmt} [{n}, {k}] needs {n * nb * size} bytes, got {data.numel()}")
    blocks = data.reshape(n, nb, size)
    d = blocks[:, :, 0:2].contiguous().view(torch.float16).reshape(n, nb)
    if fmt == "q8_0":
        q = blocks[:, :, 2:].contiguous().view(torch.int8).reshape(n, k)
        return BlockQuantWeight(q, d.contiguous(), None, fmt, 8, BLOCK, 0, k, n)
    if fmt == "q4_0":
        q = blocks[:, :, 2:].reshape(n, k // 2).contiguous()
        return BlockQuantWeight(q, d.contiguous(), None, fmt, 4, BLOCK, 8, k, n)
    m = blocks[:, :, 2:4].contiguous().view(torch.float16).reshape(n, nb)
    q = blocks[:, :, 4:].reshape(n, k // 2).contiguous()
    return BlockQuantWeight(q, d.contiguous(), m.contiguous(), fmt, 4, BLOCK, 0, k, n)


def _as_bytes(raw: np.ndarray | Tensor) -> Tensor:  # any GGUF tensor data -> flat uint8
    with warnings.catch_warnings():  # a read-only memory map: nothing here writes to it
        warnings.simplefilter("ignore", UserWarning)
        return torch.as_tensor(np.ascontiguousarray(raw)).view(torch.uint8).reshape(-1)


def from_gguf_k_blocks(raw: np.ndarray | Tensor, fmt: str, n: int, k: int) -> BlockQuantWeight:
    """GGUF k-quant data ([N, K / 256 * block_bytes] uint8) -> a BlockQuantWeight, repacked (module doc).

    block_q4_K = {fp16 d; fp16 dmin; uint8 scales[12]; uint8 qs[128]}: eight 6-bit scales and mins packed
    in `scales` (gguf-py's Q4_K.get_scale_min), each 64-value run of qs holding values j (low nibbles)
    and 32 + j (high nibbles). block_q6_K = {uint8 ql[128]; uint8 qh[64]; int8 scales[16]; fp16 d}: each
    6-bit q is 4 bits of ql and 2 of qh, stored minus 32 (ggml-common.h; gguf-py's quants.py)."""
    from gguf.quants import Q4_K

    if fmt not in GGUF_SUPER_BLOCK_BYTES:
        raise ValueError(
            f"{fmt!r} is not a k-quant format the kernel runs ({sorted(GGUF_SUPER_BLOCK_BYTES)})"
        )
    if k % QK_K:
        raise ValueError(f"GGUF k-quant rows must hold whole {QK_K}-value super-blocks, K={k}")
    size, nb = GGUF_SUPER_BLOCK_BYTES[fmt], n * (k // QK_K)
    data = _as_bytes(raw)
    if data.numel() != nb * size:
        raise ValueError(f"{fmt} [{n}, {k}] needs {nb * size} bytes, got {data.numel()}")
    blocks = data.reshape(nb, size)
    if fmt == "q4_k":
        d = blocks[:, 0:2].contiguous().view(torch.float16).float()  # [nb, 1]
        dmin = blocks[:, 2:4].contiguous().view(torch.float16).float()
        sc_np, m_np = Q4_K.get_scale_min(blocks[:, 4:16].numpy())
        sc, m = (
            torch.from_numpy(sc_np.astype(np.float32)),
            torch.from_numpy(m_np.astype(np.float32)),
        )  # [nb, 8]
        qs = blocks[:, 16:].reshape(nb, 4, 1, 32)
        values = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, k)  # [N, K] in 0..15, k order
        scales = (d * sc).reshape(n, k // BLOCK).contiguous()
        mins = (-(dmin * m)).reshape(n, k // BLOCK).contiguous()
        return BlockQuantWeight(pack_nibbles(values), scales, mins, fmt, 4, BLOCK, 0, k, n)
    ql = blocks[:, :128].reshape(nb, 2, 1, 64)
    qh = blocks[:, 128:192].reshape(nb, 2, 1, 32)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(nb, 2, 4, 32)  # [nb, half, quarter, 32]
    high = torch.cat([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], dim=2)  # [nb, half, quarter, 32]
    q = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8).reshape(n, k)
    sub = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [nb, 16]
    d = blocks[:, 208:210].contiguous().view(torch.float16).float()  # [nb, 1]
    scales = (d * sub).reshape(n, k // 16).contiguous()
    return BlockQuantWeight(q, scales, None, fmt, 8, 16, 0, k, n)


def interleave_x16(w: BlockQuantWeight) -> BlockQuantWeight:
    """A GGUF k-quant's super-blocks (KQUANT_BITS, a key of cpu_qk_native.TILED) -> the same values as
    16-row tiles (q4_k_x16, ..., cpu_qk_native.py), through the compiled re-lay where it builds, else (Q4_K,
    Q6_K) its torch reference. ValueError unless w is such super-blocks with N a multiple of 16;
    KernelBuildError for Q5_K / IQ4_XS / Q3_K / Q2_K where the library cannot be built."""
    if not (w.super_blocks and w.fmt in qk_native.TILED):
        raise ValueError(
            f"interleaving takes {'/'.join(qk_native.TILED)} super-blocks, got {w.fmt} ({w.bits} bits)"
        )
    kb = qk_native.KQuantBlocks(w.q, w.fmt, w.in_features, w.out_features)
    if w.fmt not in qk_native.ROW_MAJOR_RUNS:
        tiles = qk_native.load_qk_native_kernel().interleave(kb)
    else:
        kernel = qk_native.try_load_qk_native_kernel()
        tiles = kernel.interleave(kb) if kernel is not None else qk_native.interleave_reference(kb)
    n, k = w.out_features, w.in_features
    return BlockQuantWeight(tiles.blocks, torch.empty(n, 0), None, tiles.fmt, KQUANT_BITS, X16_GROUP, 0, k, n)


def q8_tileable(w: BlockQuantWeight) -> bool:
    """Whether `w` can be held as 32-value 16-row tiles (interleave_q8_x16): 8-bit values in 32-value blocks
    with fp16 scales, no zero point, fp16 mins for Q5_1 and none for the others, of a format in Q8_TILED,
    N a multiple of 16."""
    mins_ok = w.mins is not None and w.mins.dtype == torch.float16 if w.fmt == "q5_1" else w.mins is None
    return (
        w.fmt in Q8_TILED
        and w.bits == 8
        and w.group_size == BLOCK
        and w.in_features % BLOCK == 0
        and w.out_features % qk_native.X16_ROWS == 0
        and w.scales.dtype == torch.float16
        and mins_ok
        and w.zero_point == 0
    )


def _values_in(q: Tensor, lo: int, hi: int, what: str) -> None:
    if q.numel() and (int(q.min()) < lo or int(q.max()) > hi):
        raise ValueError(f"{what} values must lie in {lo}..{hi}")


def _five_bit_planes(v: Tensor) -> Tensor:  # [T, r, b, g, i] uint8 0..31 -> [T, b, 320] (Q5_0's tile values)
    t, nb = v.shape[0], v.shape[2]
    nib = (v[:, :, :, :4] & 15) | ((v[:, :, :, 4:] & 15) << 4)  # [T, r, b, g < 4, i]: k and k + 16
    nib = nib.permute(0, 2, 3, 1, 4).reshape(t, nb, 256)
    # the fifth bits as [T, b, g, byte, bit], bit e = 4r + i of g's 64-bit plane
    bit = ((v >> 4) & 1).permute(0, 2, 3, 1, 4).reshape(t, nb, 8, 8, 8)
    qh = (bit << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8).reshape(t, nb, 64)
    return torch.cat([nib, qh], dim=2)


def interleave_q8_x16(w: BlockQuantWeight) -> BlockQuantWeight:
    """32-value blocks (q8_tileable) -> the same values and scales as 16-row tiles at the file's bits per
    weight (layouts in csrc/qk_native.cpp's header): q8_0_x16 (q + 128, 8.5), q5_0_x16 (q + 16 in 5 bits,
    5.5), iq4_nl_x16 (each codebook value's 4-bit index, 4.5), q5_1_x16 (q in 5 bits, fp16 d and m, 6.0).
    Torch, at load (~1 s for Gemma-3's 262,144 x 1,152 table). ValueError unless q8_tileable(w), or for
    values the format cannot hold (a Q5 value past 5 bits, an IQ4_NL value off the codebook)."""
    if not q8_tileable(w):
        raise ValueError(
            f"32-value tiles take {sorted(Q8_TILED)} in 32-blocks with fp16 scales (and Q5_1's fp16 mins) and "
            f"N a multiple of {qk_native.X16_ROWS}, got {w.fmt} ({w.bits} bits, group_size {w.group_size}, "
            f"N={w.out_features})"
        )
    n, k = w.out_features, w.in_features
    t, nb, rows = n // qk_native.X16_ROWS, k // BLOCK, qk_native.X16_ROWS

    def per_block(a: Tensor) -> Tensor:  # [N, nb] fp16 -> [T, b, 32] bytes: fp16 [r] per block
        return a.reshape(t, rows, nb).transpose(1, 2).contiguous().view(torch.uint8)

    scales = per_block(w.scales)
    if w.fmt == "q5_0":
        _values_in(w.q, -16, 15, "q5_0")  # q - 16 of a 5-bit q
        values = _five_bit_planes((w.q + 16).view(torch.uint8).reshape(t, rows, nb, 8, 4))
    elif w.fmt == "q5_1":
        assert w.mins is not None  # q8_tileable
        _values_in(w.q, 0, 31, "q5_1")
        values = _five_bit_planes(w.q.view(torch.uint8).reshape(t, rows, nb, 8, 4))
        scales = torch.cat([scales, per_block(w.mins)], dim=2)  # d[16], then m[16]
    elif w.fmt == "iq4_nl":
        index = torch.full((256,), -1, dtype=torch.int16)
        index[torch.tensor(IQ4_LEVELS) + 128] = torch.arange(16, dtype=torch.int16)
        idx = index[w.q.to(torch.int64) + 128]
        if (idx < 0).any():
            raise ValueError("iq4_nl values must be ggml's kvalues_iq4nl levels")
        v = idx.to(torch.uint8).reshape(t, rows, nb, 8, 4)
        nib = (v[:, :, :, :4] | (v[:, :, :, 4:] << 4)).permute(0, 2, 3, 1, 4)  # [T, b, g < 4, r, i]
        values = nib.reshape(t, nb, 256)
    else:
        values = (w.q.view(torch.uint8) ^ 0x80).reshape(t, rows, nb, 8, 4).permute(0, 2, 3, 1, 4)  # q + 128
    tiles = torch.cat([values.reshape(t, -1), scales.reshape(t, -1)], dim=1)
    fmt = Q8_TILED[w.fmt]
    return BlockQuantWeight(
        tiles.reshape(n, nb * Q8X_TILE_ROW_BYTES[fmt]).contiguous(),
        torch.empty(n, 0),
        None,
        fmt,
        KQUANT_BITS,
        Q8X_GROUP,
        0,
        k,
        n,
    )


def deinterleave_q8_x16(w: BlockQuantWeight) -> BlockQuantWeight:
    """32-value 16-row tiles -> the row-major 8-bit blocks again (interleave_q8_x16's inverse; torch): q8_0,
    q5_0 (q - 16), iq4_nl (the codebook values), q5_1 (q, fp16 mins). ValueError for another format."""
    if w.fmt not in _Q8_LAYOUT_OF:
        raise ValueError(f"de-interleaving takes {sorted(_Q8_LAYOUT_OF)}, got {w.fmt}")
    n, k = w.out_features, w.in_features
    t, nb, rows = n // qk_native.X16_ROWS, k // BLOCK, qk_native.X16_ROWS
    tiles = w.q.reshape(t, nb * Q8X_TILE_ROW_BYTES[w.fmt] * rows)
    vb = Q8X_VALUE_BYTES[w.fmt]
    sb = Q8X_TILE_ROW_BYTES[w.fmt] * rows - vb  # one block's fp16 d (and m)
    per_block = tiles[:, nb * vb :].reshape(t, nb, sb)

    def per_row(a: Tensor) -> Tensor:  # [T, b, 32] bytes of fp16 [r] -> [N, nb] fp16
        return (
            a.contiguous()
            .view(torch.float16)
            .reshape(t, nb, rows)
            .transpose(1, 2)
            .reshape(n, nb)
            .contiguous()
        )

    blocks = tiles[:, : nb * vb].reshape(t, nb, vb)
    mins = None
    if w.fmt in ("q5_0_x16", "q5_1_x16", "iq4_nl_x16"):
        nib = blocks[:, :, :256].reshape(t, nb, 4, rows, 4)  # [T, b, g < 4, r, i]
        v = torch.cat([nib & 15, nib >> 4], dim=2)  # [T, b, g, r, i]
        if w.fmt != "iq4_nl_x16":
            bits = (blocks[:, :, 256:].reshape(t, nb, 8, 8, 1) >> torch.arange(8, dtype=torch.uint8)) & 1
            v = v | (bits.reshape(t, nb, 8, rows, 4) << 4)
        v = v.permute(0, 3, 1, 2, 4).reshape(n, k)
        if w.fmt == "iq4_nl_x16":
            q = torch.tensor(IQ4_LEVELS, dtype=torch.int8)[v.long()]
        else:
            q = (v.to(torch.int16) - (16 if w.fmt == "q5_0_x16" else 0)).to(torch.int8)
        if w.fmt == "q5_1_x16":
            mins = per_row(per_block[:, :, 32:])
    else:
        values = blocks.reshape(t, nb, 8, rows, 4).permute(0, 3, 1, 2, 4)  # [T, r, b, g, i]
        q = (values.reshape(n, k) ^ 0x80).view(torch.int8)  # held as q + 128
    d = per_row(per_block[:, :, :32])
    return BlockQuantWeight(q, d, mins, _Q8_LAYOUT_OF[w.fmt], 8, BLOCK, 0, k, n)


def deinterleave_x16(w: BlockQuantWeight) -> BlockQuantWeight:
    """16-row tiles -> the rows as the file's blocks again (interleave_x16's inverse; torch for Q4_K /
    Q6_K, the compiled library for the others; load time). ValueError for another format."""
    if w.fmt not in qk_native.X16_TILE_BYTES:
        raise ValueError(f"de-interleaving takes {'/'.join(qk_native.X16_TILE_BYTES)}, got {w.fmt}")
    n, k = w.out_features, w.in_features
    if w.fmt in qk_native.COMPILED_TILES:
        kb = qk_native.KQuantBlocks(w.q, w.fmt, k, n)
        return _super_blocks(
            qk_native.load_qk_native_kernel().deinterleave(kb).blocks, qk_native.FILE_OF[w.fmt], n, k
        )
    nb, rows = k // QK_K, qk_native.X16_ROWS
    t = w.q.reshape(n // rows, nb, qk_native.X16_TILE_BYTES[w.fmt])

    def per_row(a: Tensor, *inner: int) -> Tensor:  # [T, nb, ..., r, ...] with r at dim 2 -> [N, nb, ...]
        return a.movedim(2, 1).reshape(n, nb, *inner)

    if w.fmt == "q6_k_x16":
        d6 = t[:, :, 0:32].reshape(-1, nb, rows, 2)
        runs = t[:, :, 32:].reshape(-1, nb, 8, 416)  # per 32-value chunk J: scales, ql, qh
        sc6 = runs[..., 0:32].reshape(-1, nb, 8, rows, 2).permute(0, 1, 3, 2, 4).reshape(-1, nb, rows, 16)
        ql = runs[..., 32:288].reshape(-1, nb, 8, 4, rows, 4)  # [T, nb, J, g, r, i]
        qh = runs[..., 288:].reshape(-1, nb, 8, 2, rows, 4)  # [T, nb, J, h, r, i]
        low = torch.stack([ql & 15, ql >> 4], dim=3)  # [T, nb, J, h, g, r, i]
        high = torch.stack([(qh >> (2 * g)) & 3 for g in range(4)], dim=4)  # [T, nb, J, h, g, r, i]
        v6 = (
            (low | (high << 4)).permute(0, 1, 5, 2, 3, 4, 6).reshape(-1, nb, rows, 2, 4, 32)
        )  # [.., half, q, l]
        # block_q6_K: ql[64h + l] = low bits of q(128h + l) | of q(128h + 64 + l) << 4, ql[64h + 32 + l]
        # likewise for +32 and +96; qh[32h + l] = the four quarters' top 2 bits at bits 0, 2, 4, 6
        file_ql = torch.cat(
            [
                (v6[..., 0, :] & 15) | ((v6[..., 2, :] & 15) << 4),
                (v6[..., 1, :] & 15) | ((v6[..., 3, :] & 15) << 4),
            ],
            dim=-1,
        )  # [T, nb, r, 2, 64]
        file_qh = (
            (v6[..., 0, :] >> 4)
            | ((v6[..., 1, :] >> 4) << 2)
            | ((v6[..., 2, :] >> 4) << 4)
            | ((v6[..., 3, :] >> 4) << 6)
        )  # [T, nb, r, 2, 32]
        blocks6 = torch.cat(
            [file_ql.reshape(-1, nb, rows, 128), file_qh.reshape(-1, nb, rows, 64), sc6, d6], dim=3
        )  # [T, nb, r, 210]
        return _super_blocks(per_row(blocks6, 210).reshape(n, nb * 210).contiguous(), "q6_k", n, k)
    d = t[:, :, 0:32].reshape(-1, nb, rows, 2)
    dmin = t[:, :, 32:64].reshape(-1, nb, rows, 2)
    sc = t[:, :, 64:192].reshape(-1, nb, 8, rows).transpose(2, 3)  # [T, nb, r, j]
    mn = t[:, :, 192:320].reshape(-1, nb, 4, rows, 2).permute(0, 1, 3, 2, 4).reshape(-1, nb, rows, 8)
    # ggml's 12-byte scales (get_scale_min_k4's inverse): bytes 0-3 sc[0:4] | sc[4:8] >> 4 << 6, 4-7 the
    # mins alike, 8-11 sc[4:8] & 15 | (mn[4:8] & 15) << 4
    packed = torch.cat(
        [
            sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
            mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4),
        ],
        dim=3,
    )
    qs = t[:, :, 320:].reshape(-1, nb, 8, 4, rows, 4)  # [T, nb, j, g, r, i]
    v = torch.stack([qs & 15, qs >> 4], dim=3).permute(0, 1, 5, 2, 3, 4, 6)  # [T, nb, r, j, half, g, i]
    v = v.reshape(-1, nb, rows, 4, 2, 32)  # k = 64c + 32 nibble + l
    file_qs = (v[:, :, :, :, 0] | (v[:, :, :, :, 1] << 4)).reshape(-1, nb, rows, 128)
    blocks = torch.cat([d, dmin, packed, file_qs], dim=3)  # [T, nb, r, 144]
    return _super_blocks(per_row(blocks, 144).reshape(n, nb * 144).contiguous(), "q4_k", n, k)


def from_gguf_k_super_blocks(raw: np.ndarray | Tensor, fmt: str, n: int, k: int) -> BlockQuantWeight:
    """GGUF k-quant data (`fmt` a key of cpu_qk_native.GGUF_TYPES) -> a BlockQuantWeight holding a copy of
    the file's super-blocks as they are (KQUANT_BITS; Q4_K / Q6_K run so by csrc/qk_native.cpp through
    qlinear's entry points, the others only once interleave_x16 made them tiles). ValueError as
    cpu_qk_native.from_gguf."""
    return _super_blocks(qk_native.from_gguf(raw, fmt, n, k).blocks, fmt, n, k)


def _super_blocks(blocks: Tensor, fmt: str, n: int, k: int) -> BlockQuantWeight:
    """blocks [N, K / 256 * block bytes] uint8, a GGUF k-quant's blocks per row -> their BlockQuantWeight."""
    return BlockQuantWeight(blocks, torch.empty(n, 0), None, fmt, KQUANT_BITS, QK_K, 0, k, n)


def pack_nibbles(values: Tensor) -> Tensor:
    """[N, K] ints in 0..15 -> [N, K / 2] uint8, GGUF's order: per 32-block, byte j = k_j | k_(j+16) << 4."""
    n, k = values.shape
    v = values.to(torch.uint8).reshape(n, k // BLOCK, 2, BLOCK // 2)
    return (v[:, :, 0] | (v[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_nibbles(q: Tensor) -> Tensor:
    """Inverse of pack_nibbles: [N, K / 2] uint8 -> [N, K] int32."""
    n, half = q.shape
    b = q.reshape(n, half * 2 // BLOCK, BLOCK // 2).to(torch.int32)
    return torch.stack([b & 0x0F, b >> 4], dim=2).reshape(n, half * 2)


def from_int8(qweight: Tensor, scale: Tensor) -> BlockQuantWeight:
    """Per-output-channel int8 (qweight [N, K] int8, scale [N] float): w = q * scale[n]."""
    n, k = qweight.shape
    return BlockQuantWeight(
        qweight.contiguous(), scale.float().reshape(n, 1).contiguous(), None, "int8", 8, k, 0, k, n
    )


def from_int4(intweight: Tensor, zeros: Tensor, scales: Tensor, group_size: int) -> BlockQuantWeight:
    """Group-wise int4 in the x @ W layout of formats.Int4Weights (intweight [K, N] in 0..15, zeros and
    scales [K / G, N], trivial g_idx) -> w[n, k] = scale * q + (-scale * zero)."""
    k, n = intweight.shape
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of group_size={group_size}")
    s = scales.float().t().contiguous()  # [N, K/G]
    mins = (-(zeros.float().t()) * s).contiguous()
    return BlockQuantWeight(pack_nibbles(intweight.t()), s, mins, "int4", 4, group_size, 0, k, n)


def _roundf(x: Tensor) -> Tensor:
    """C's roundf (halves away from zero, as ggml's quantize_row_q8_0_ref rounds), exactly: not
    torch.round, which rounds halves to even (2.5 -> 2, where ggml writes 3)."""
    a = x.abs()
    whole = torch.floor(a)
    return torch.sign(x) * (whole + torch.floor(2 * (a - whole)))


def quantize_block(weight: Tensor, fmt: str) -> BlockQuantWeight:
    """Round-to-nearest quantization of a float [N, K] weight into a GGUF block format, as ggml's
    reference quantizers (quantize_row_q*_ref) do: q8_0 d = amax/127; q4_0 d = max/-8 (signed max);
    q4_1 d = (max - min)/15, m = min."""
    if fmt not in GGUF_BLOCK_BYTES:
        raise ValueError(f"no block quantizer for {fmt!r}")
    w = weight.detach().float()
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"K={k} is not a multiple of {BLOCK}")
    b = w.reshape(n, k // BLOCK, BLOCK)
    if fmt == "q8_0":
        d = b.abs().amax(-1) / 127.0
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q = _roundf(b * inv[..., None]).clamp(-127, 127).to(torch.int8).reshape(n, k)
        return BlockQuantWeight(q, d.half().contiguous(), None, fmt, 8, BLOCK, 0, k, n)
    if fmt == "q4_0":
        idx = b.abs().argmax(-1, keepdim=True)
        signed_max = b.gather(-1, idx).squeeze(-1)
        d = signed_max / -8.0
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = torch.clamp(torch.floor(b * inv[..., None] + 8.5), 0, 15).reshape(n, k)
        return BlockQuantWeight(pack_nibbles(q), d.half().contiguous(), None, fmt, 4, BLOCK, 8, k, n)
    lo, hi = b.amin(-1), b.amax(-1)
    d = (hi - lo) / 15.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.clamp(torch.floor((b - lo[..., None]) * inv[..., None] + 0.5), 0, 15).reshape(n, k)
    return BlockQuantWeight(
        pack_nibbles(q), d.half().contiguous(), lo.half().contiguous(), fmt, 4, BLOCK, 0, k, n
    )


# ------------------------------------------------------------------ torch references


def _values(w: BlockQuantWeight, rows: Tensor | None = None) -> Tensor:  # [R, K] int32
    q = w.q if rows is None else w.q.index_select(0, rows)
    return q.to(torch.int32) if w.bits == 8 else unpack_nibbles(q)


def dequantize_reference(w: BlockQuantWeight, rows: Tensor | None = None) -> Tensor:
    """W (or its rows `rows`, [R] int64) as fp32: [R, K]."""
    if w.fmt in _Q8_LAYOUT_OF:
        return dequantize_reference(deinterleave_q8_x16(w), rows)
    if w.super_blocks and w.fmt in _LAYOUT_OF:  # tiles: whole, then the rows asked for
        kb = qk_native.KQuantBlocks(w.q, w.fmt, w.in_features, w.out_features)
        full = qk_native.dequantize_reference(kb)
        return full if rows is None else full.index_select(0, rows)
    if w.super_blocks:  # gguf-py's own dequantization of the file's blocks
        q = w.q if rows is None else w.q.index_select(0, rows)
        kb = qk_native.KQuantBlocks(q.contiguous(), w.fmt, w.in_features, q.shape[0])
        return qk_native.dequantize_reference(kb)
    q = _values(w, rows)
    scales = w.scales if rows is None else w.scales.index_select(0, rows)
    g = torch.arange(w.in_features) // w.group_size
    out = (q - w.zero_point).float() * scales.float()[:, g]
    if w.mins is not None:
        mins = w.mins if rows is None else w.mins.index_select(0, rows)
        out = out + mins.float()[:, g]
    return out


def linear_reference(x: Tensor, w: BlockQuantWeight, bias: Tensor | None = None) -> Tensor:
    """x [M, K] fp32 -> [M, N] fp32 through the dequantized weight."""
    y = x.float() @ dequantize_reference(w).t()
    return y if bias is None else y + bias.float()


# ------------------------------------------------------------------ the kernel


class KiQWeight(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("mins", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("group_size", ctypes.c_int64),
        ("groups", ctypes.c_int64),
        ("row_bytes", ctypes.c_int64),
        ("bits", ctypes.c_int32),
        ("zero_point", ctypes.c_int32),
        ("scale_is_f16", ctypes.c_int32),
        ("compute", ctypes.c_int32),  # COMPUTE_FP32, COMPUTE_BF16 or COMPUTE_INT8
        ("packed", ctypes.c_void_p),  # BlockQuantWeight.packed: qgemv_q8's copy for its batched path, or null
    ]


COMPUTE_FP32, COMPUTE_BF16, COMPUTE_INT8 = 0, 1, 2  # KiQWeight.compute (csrc/qlinear.cpp's KI_COMPUTE_*)
_COMPUTE_FLAGS = {torch.float32: COMPUTE_FP32, torch.bfloat16: COMPUTE_BF16, torch.int8: COMPUTE_INT8}
# The gemm_dtypes (server/quant/gemm_dtype.py) that let a GEMM take int8 activations where its kernel has them
# (csrc/qgemv_q8.cpp's GEMV and batched path, csrc/qk_native.cpp's tiles); fp32 asks for fp32 activations.
INT8_ACTIVATION_DTYPES = frozenset({torch.bfloat16, torch.int8})


def compute_flag(compute: torch.dtype) -> int:
    """KiQWeight.compute for a layer whose gemm_dtype is `compute` (fp32, bf16 or int8: gemm_dtype.py);
    ValueError otherwise."""
    flag = _COMPUTE_FLAGS.get(compute)
    if flag is None:
        raise ValueError(f"block-quantized kernels compute in float32, bfloat16 or int8, not {compute}")
    return flag


def weight_descriptor(w: BlockQuantWeight, compute: torch.dtype = torch.float32) -> KiQWeight:
    """The kernel's view of `w` (struct KiQWeight in csrc/qlinear.cpp); it holds raw pointers into w's tensors.
    `compute` bf16 lets the batched path (M > BF16_GEMV_MAX_ROWS) run in bf16 where the CPU has AVX512-BF16;
    bf16 and int8 let the int8-activation kernels take the call (compute_flag)."""
    return KiQWeight(
        w.q.data_ptr(),
        w.scales.data_ptr(),
        None if w.mins is None else w.mins.data_ptr(),
        w.out_features,
        w.in_features,
        w.group_size,
        w.groups,
        w.q.shape[1],
        w.bits,
        w.zero_point,
        int(w.scales.dtype == torch.float16),
        compute_flag(compute),
        None if w.packed is None else w.packed.data_ptr(),
    )


@dataclass(frozen=True)
class QLinearKernel:
    """The loaded library. Its launchers check shapes, dtypes and strides: a wrong pointer would crash."""

    lib: ctypes.CDLL
    path: Path
    isa: str  # "avx512" (usable_cpu_features().avx512f), "avx2" or "portable": the path this build runs here
    bf16: bool = False  # the bf16 batched path runs here (usable avx512_bf16): compute=bf16 takes it

    def linear(
        self,
        x: Tensor,  # [M, K] fp32, rows may be strided (unit stride within a row)
        w: BlockQuantWeight,
        bias: Tensor | None = None,  # [N] fp32
        out: Tensor | None = None,  # [M, N] fp32, unit stride within a row
        compute: torch.dtype = torch.float32,  # bf16: M > BF16_GEMV_MAX_ROWS in bf16 where `self.bf16`
    ) -> Tensor:  # [M, N] fp32
        """With compute=torch.bfloat16 and `self.bf16`, M > BF16_GEMV_MAX_ROWS rows compute
        round_bf16(x) @ round_bf16(W)^T in fp32 sums (csrc/qlinear.cpp, "batched path in bf16"); else
        fp32, bit for bit the compute=float32 result. TypeError/ValueError for arguments the kernel
        cannot take (check_linear_args), RuntimeError if it fails."""
        x, out = check_linear_args(x, w, bias, out)
        return call_linear(self.lib.kubeinfer_qlinear, "qlinear", x, w, bias, out, compute)

    def set_gemv_max_rows(self, rows: int, bf16_rows: int = BF16_GEMV_MAX_ROWS) -> None:
        """M up to `rows` takes the GEMV path, larger M the batched one (a benchmark's knob; default
        GEMV_MAX_ROWS; `bf16_rows` the same under bf16 compute). Process-wide: never call it while another
        thread runs the kernel."""
        self.lib.kubeinfer_qlinear_set_gemv_max_rows(max(1, int(rows)), max(1, int(bf16_rows)))

    def dequantize_rows(
        self,
        w: BlockQuantWeight,
        rows: Tensor | None = None,  # [R] int64 row ids, or None for the range [start, start + count)
        start: int = 0,
        count: int | None = None,
        out: Tensor | None = None,  # [R, K] fp32, unit stride along K
    ) -> Tensor:  # [R, K] fp32
        if rows is not None:
            if rows.dtype != torch.int64 or rows.dim() != 1:
                raise TypeError("rows must be a 1-D int64 tensor")
            rows = rows.contiguous()
            r = rows.numel()
            if r and (int(rows.min()) < 0 or int(rows.max()) >= w.out_features):
                raise IndexError(f"row index out of range [0, {w.out_features})")
        else:
            r = w.out_features - start if count is None else count
            if start < 0 or r < 0 or start + r > w.out_features:
                raise IndexError(f"rows [{start}, {start + r}) out of range [0, {w.out_features})")
        k = w.in_features
        if out is None:
            out = torch.empty(r, k, dtype=torch.float32)
        elif out.dtype != torch.float32 or tuple(out.shape) != (r, k) or (k > 1 and out.stride(1) != 1):
            raise ValueError(f"out must be [{r}, {k}] fp32 with unit stride along K")
        if r == 0:
            return out
        desc = weight_descriptor(w)
        rc = self.lib.kubeinfer_qdequant(
            ctypes.byref(desc),
            None if rows is None else rows.data_ptr(),
            start,
            r,
            out.data_ptr(),
            out.stride(0),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"qdequant kernel returned {rc} for {w.fmt} [{w.out_features}, {k}]")
        return out

    def bf16_dequant_supported(self, w: BlockQuantWeight) -> bool:
        """Whether dequantize_rows_bf16 takes W here: the bf16 path usable (`self.bf16`) and W's groups
        whole 32-blocks (the condition kubeinfer_qdequant_bf16 checks)."""
        return self.bf16 and not w.super_blocks and w.in_features % 32 == 0 and w.group_size % 32 == 0

    def dequantize_rows_bf16(
        self,
        w: BlockQuantWeight,
        start: int,
        count: int,
        out: Tensor,  # [count, K] bf16, unit stride along K
    ) -> bool:
        """Rows [start, start + count) of W dequantized straight to bf16 into `out`: the values of
        dequantize_rows rounded to nearest even (bit-identical to `dequantize_rows(...).bfloat16()`),
        without the fp32 copy. False (out untouched) where `bf16_dequant_supported(w)` is not;
        IndexError/ValueError for a bad range or `out`."""
        k = w.in_features
        if start < 0 or count < 0 or start + count > w.out_features:
            raise IndexError(f"rows [{start}, {start + count}) out of range [0, {w.out_features})")
        if out.dtype != torch.bfloat16 or tuple(out.shape) != (count, k) or (k > 1 and out.stride(1) != 1):
            raise ValueError(f"out must be [{count}, {k}] bf16 with unit stride along K")
        if count == 0:
            return True
        rc = self.lib.kubeinfer_qdequant_bf16(
            ctypes.byref(weight_descriptor(w)),
            start,
            count,
            out.data_ptr(),
            out.stride(0),
            torch.get_num_threads(),
        )
        if rc == 2:
            return False
        if rc != 0:
            raise RuntimeError(f"qdequant_bf16 kernel returned {rc} for {w.fmt} [{w.out_features}, {k}]")
        return True


@functools.cache
def load_qlinear_kernel(cache_dir: Path | None = None) -> QLinearKernel:
    """Builds (or finds under `cache_dir`/kernels) and loads the kernel; raises KernelBuildError if it cannot."""
    lib, path = load_library(NATIVE, cache_dir or default_cache_dir())
    i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    lib.kubeinfer_qlinear.restype = i32
    lib.kubeinfer_qlinear.argtypes = [ctypes.POINTER(KiQWeight), ptr, i64, i64, ptr, ptr, i64, i32]
    lib.kubeinfer_qdequant.restype = i32
    lib.kubeinfer_qdequant.argtypes = [ctypes.POINTER(KiQWeight), ptr, i64, i64, ptr, i64, i32]
    lib.kubeinfer_qdequant_bf16.restype = i32
    lib.kubeinfer_qdequant_bf16.argtypes = [ctypes.POINTER(KiQWeight), i64, i64, ptr, i64, i32]
    lib.kubeinfer_qlinear_isa.restype = ctypes.c_char_p
    lib.kubeinfer_qlinear_has_avx512_path.restype = i32
    lib.kubeinfer_qlinear_set_gemv_max_rows.restype = None
    lib.kubeinfer_qlinear_set_gemv_max_rows.argtypes = [i64, i64]
    lib.kubeinfer_qlinear_set_avx512.restype = None
    lib.kubeinfer_qlinear_set_avx512.argtypes = [i32]
    lib.kubeinfer_qlinear_set_bf16.restype = None
    lib.kubeinfer_qlinear_set_bf16.argtypes = [i32]
    lib.kubeinfer_qlinear_set_kquant.restype = None
    lib.kubeinfer_qlinear_set_kquant.argtypes = [ptr, ptr]
    kq = qk_native.try_load_qk_native_kernel(cache_dir)
    if kq is not None:  # the super-block weights' kernel, called through this library's entry points
        lib.kubeinfer_qlinear_set_kquant(
            ctypes.cast(kq.lib.kubeinfer_qk_qlinear, ptr), ctypes.cast(kq.lib.kubeinfer_qk_dequant, ptr)
        )
    lib.kubeinfer_qlinear_has_bf16_path.restype = i32
    lib.kubeinfer_qlinear_bf16_enabled.restype = i32
    # AVX-512 (and its bf16 path) only where the OS enabled its state and KUBEINFER_CPU_DISABLE leaves it
    # on (never cpuinfo or CPUID alone); the AVX2 fp32 path otherwise.
    features = usable_cpu_features(cache_dir)
    lib.kubeinfer_qlinear_set_avx512(int(features.avx512f))
    lib.kubeinfer_qlinear_set_bf16(int(features.avx512_bf16 and features.avx512bw))
    return QLinearKernel(
        lib, path, lib.kubeinfer_qlinear_isa().decode(), bool(lib.kubeinfer_qlinear_bf16_enabled())
    )


def try_load_qlinear_kernel(cache_dir: Path | None = None) -> QLinearKernel | None:
    """The kernel, or None (logged once) when it cannot be built: the torch reference path then serves."""
    try:
        return load_qlinear_kernel(cache_dir)
    except (KernelBuildError, OSError) as e:
        _warn_once(str(e))
        return None


@functools.cache
def _warn_once(reason: str) -> None:
    log.warning("quantized CPU kernel unavailable, using the slower torch path: %s", reason)


def check_linear_args(
    x: Tensor,  # [M, K] fp32, rows may be strided (unit stride within a row)
    w: BlockQuantWeight,
    bias: Tensor | None,  # [N] fp32 contiguous
    out: Tensor | None,  # [M, N] fp32, unit stride within a row
) -> tuple[Tensor, Tensor]:  # (x with unit stride along K, out allocated where None)
    """The argument checks every block-quantized linear launcher makes (qlinear's, the int8 GEMV's);
    raises TypeError for a non-CPU or non-fp32 x, ValueError for a shape or stride the kernels cannot take."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise TypeError(f"x must be a CPU fp32 tensor, got {x.dtype} on {x.device}")
    if x.dim() != 2 or x.shape[1] != w.in_features or (x.shape[0] > 1 and x.stride(1) != 1):
        raise ValueError(f"x must be [M, {w.in_features}] with unit stride along K, got {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, n = x.shape[0], w.out_features
    if bias is not None and (
        bias.dtype != torch.float32 or tuple(bias.shape) != (n,) or not bias.is_contiguous()
    ):
        raise ValueError(f"bias must be a contiguous [{n}] fp32 tensor")
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    elif out.dtype != torch.float32 or tuple(out.shape) != (m, n) or (n > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be [{m}, {n}] fp32 with unit stride along N")
    return x, out


def call_linear(
    fn: Any,  # a C entry point with kubeinfer_qlinear's signature
    name: str,  # for the error message
    x: Tensor,  # [M, K] fp32, checked by check_linear_args
    w: BlockQuantWeight,
    bias: Tensor | None,  # [N] fp32
    out: Tensor,  # [M, N] fp32
    compute: torch.dtype = torch.float32,  # KiQWeight.compute (weight_descriptor)
) -> Tensor:  # out
    """Runs `fn` on checked arguments; raises RuntimeError on a non-zero return code."""
    m, n = out.shape
    if m == 0 or n == 0:
        return out
    desc = weight_descriptor(w, compute)
    rc = fn(
        ctypes.byref(desc),
        x.data_ptr(),
        m,
        x.stride(0),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"{name} kernel returned {rc} for {w.fmt} [{n}, {w.in_features}]")
    return out
