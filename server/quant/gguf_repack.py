"""GGUF's 5-bit, low-bit k-quant and IQ4 blocks repacked exactly into BlockQuantWeight's layouts.

The CPU kernel (csrc/qlinear.cpp) runs int8 values or nibbles with one scale (and maybe one min) per 16-
or 32-value group. Each type below is rewritten into one of those layouts at load so that the kernel's dequantized value
d * q (+ m) is gguf-py's `gguf.quants.dequantize` bit for bit: the products folded into a scale (d * sc,
an fp16 times a 4- to 6-bit integer) need at most 17 significant bits, exact in fp32, and the kernel then
performs the reference's own multiply (and add). Block layouts: ggml/src/ggml-common.h (gguf-py's
quants.py reads them the same way).

    GGUF type  file bits/w  repacked as                                  bits/w  vs file
    Q5_0       5.5          q - 16 int8, fp16 d per 32                   8.5     1.55x
    Q5_1       6.0          q int8, fp16 d and m per 32                  9.0     1.50x
    Q5_K       5.5          q int8, fp32 d*sc and -dmin*m per 32         10.0    1.82x
    Q3_K       3.44         q + 4 nibbles (zero point 4), fp32 d*(sc-32)  6.0     1.75x
                            per 16
    Q2_K       2.63         q nibbles, fp32 d*sc and -dmin*m per 16      8.0     3.05x
    IQ4_NL     4.5          codebook value int8, fp16 d per 32           8.5     1.89x
    IQ4_XS     4.25         codebook value int8, fp32 d*(ls-32) per 32   9.0     2.12x

    Q4_K       4.5          cpu_qlinear: q nibbles, fp32 d*sc, -dmin*m per 32   6.0     1.33x
    Q6_K       6.56         cpu_qlinear: q int8, fp32 d*sc per 16             10.0    1.52x
                            or the file's own super-blocks (AVX512-VNNI:     6.56    1.0x
                            cpu_qk_native.py, gguf_checkpoint.super_blocks_enabled)

All are still 3.2x (Q5_K) to 5.3x (Q3_K) smaller than the fp32 copy they replace. Where the CPU kernel's
16-row tiles run, matrices of whole tiles are held at (or within 1/8 bit of) the file's bits instead, these
repacks only on the way there (Q5_0, Q5_1, IQ4_NL: cpu_qlinear.interleave_q8_x16; gguf_checkpoint.py). Q3_K's and Q2_K's
16-value groups are the low and the high nibbles of each 32-block (the kernel's 4-bit order). IQ4's codebook values
are int8 already (ggml's kvalues_iq4nl), so a lookup at load turns it into Q8_0's arithmetic.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch

from server.quant.cpu_qlinear import IQ4_LEVELS, BlockQuantWeight, pack_nibbles

QK = 32  # values per block of the 32-value formats
QK_K = 256  # values per k-quant super-block
# ggml's kvalues_iq4nl: the 16 non-linear levels of IQ4_NL and IQ4_XS (ggml-common.h)
IQ4_VALUES = np.array(IQ4_LEVELS, np.int8)

# GGUF type name -> (our format name, values per block, bytes per block)
REPACKED: dict[str, tuple[str, int, int]] = {
    "Q5_0": ("q5_0", QK, 22),
    "Q5_1": ("q5_1", QK, 24),
    "Q5_K": ("q5_k", QK_K, 176),
    "Q3_K": ("q3_k", QK_K, 110),
    "Q2_K": ("q2_k", QK_K, 84),
    "IQ4_NL": ("iq4_nl", QK, 18),
    "IQ4_XS": ("iq4_xs", QK_K, 136),
}


def _f16(b: np.ndarray) -> np.ndarray:  # [nb, 2] uint8 -> [nb, 1] fp32
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _u32(b: np.ndarray) -> np.ndarray:  # [nb, 4] uint8 little-endian -> [nb, 1] uint32
    return np.ascontiguousarray(b).view("<u4").astype(np.uint32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:  # [nb, 16] uint8 -> [nb, 32]: low nibbles k 0..15, high 16..31
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _bits(word: np.ndarray, count: int) -> np.ndarray:  # [nb, 1] uint32 -> [nb, count] bit j of each
    return ((word >> np.arange(count, dtype=np.uint32)) & 1).astype(np.uint8)


def _q5_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    q = _nibbles32(b[:, 6:22]) | (_bits(_u32(b[:, 2:6]), 32) << 4)
    return q.astype(np.int8) - 16, _f16(b[:, 0:2]), None


def _q5_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    q = _nibbles32(b[:, 8:24]) | (_bits(_u32(b[:, 4:8]), 32) << 4)
    return q.astype(np.int8), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # [nb, 12] -> [nb, 8] x 2 (6-bit each)
    # Q4_K/Q5_K packing: bytes 0-3 scales 0-3 (low 6 bits), 4-7 mins 0-3, 8-11 the low nibbles of
    # scales/mins 4-7 with their top 2 bits in the top bits of bytes 0-7 (ggml's get_scale_min_k4).
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q5_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    nb = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    qh, qs = b[:, 16:48], b[:, 48:176].reshape(nb, 4, 1, 32)
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(nb, 8, 32)  # sub-block 2i low, 2i+1 high
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # bit j of qh: sub-block j
    q = (low | (high << 4)).astype(np.int8).reshape(nb, QK_K)
    return q, d * sc, -(dmin * mn)


def _q3_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    nb = b.shape[0]
    hmask, qs, s = b[:, 0:32], b[:, 32:96].reshape(nb, 2, 1, 32), b[:, 96:108]
    low = ((qs >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]) & 3).reshape(nb, 16, 16)
    high = ((hmask[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1).reshape(nb, 16, 16)
    # the offset 4 applies where the high bit is clear (ggml's dequantize_row_q3_K)
    q = (low | (high << 2)).reshape(nb, QK_K)  # q + 4 in 0..7: the offset 4 applies where the bit is clear
    lo = (s[:, 0:8, None] >> np.array([0, 4], np.uint8)).transpose(0, 2, 1).reshape(nb, 16) & 15
    hi = (s[:, 8:12, None] >> np.array([0, 2, 4, 6], np.uint8)).transpose(0, 2, 1).reshape(nb, 16) & 3
    sc = (lo | (hi << 4)).astype(np.float32) - 32.0
    return q, _f16(b[:, 108:110]) * sc, None


def _q2_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    nb = b.shape[0]
    s, qs = b[:, 0:16], b[:, 16:80].reshape(nb, 2, 1, 32)
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    q = ((qs >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]) & 3).reshape(nb, QK_K)
    return q, d * (s & 15).astype(np.float32), -(dmin * (s >> 4).astype(np.float32))


def _iq4_nl(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    return IQ4_VALUES[_nibbles32(b[:, 2:18])], _f16(b[:, 0:2]), None


def _iq4_xs(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    nb = b.shape[0]
    d = _f16(b[:, 0:2])
    sh = np.ascontiguousarray(b[:, 2:4]).view("<u2").astype(np.uint32)  # [nb, 1]
    lo = (b[:, 4:8, None] >> np.array([0, 4], np.uint8)).reshape(nb, 8) & 15
    hi = ((sh >> (2 * np.arange(8, dtype=np.uint32))) & 3).astype(np.uint8)
    ls = (lo | (hi << 4)).astype(np.float32) - 32.0
    qs = b[:, 8:136].reshape(nb * 8, 16)
    q = IQ4_VALUES[_nibbles32(qs)].reshape(nb, QK_K)
    return q, d * ls, None


_DECODERS: dict[str, Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray | None]]] = {
    "q5_0": _q5_0,
    "q5_1": _q5_1,
    "q5_k": _q5_k,
    "q3_k": _q3_k,
    "q2_k": _q2_k,
    "iq4_nl": _iq4_nl,
    "iq4_xs": _iq4_xs,
}
_GROUP = {"q5_0": 32, "q5_1": 32, "q5_k": 32, "q3_k": 16, "q2_k": 16, "iq4_nl": 32, "iq4_xs": 32}
# fp16 d (and m) used as they are: the per-block scale is the file's own fp16
_FP16_SCALES = ("q5_0", "q5_1", "iq4_nl")
# 4-bit values, with their zero point (the rest are int8 values, zero point 0)
_NIBBLES = {"q3_k": 4, "q2_k": 0}


def from_gguf_repacked(raw: np.ndarray | torch.Tensor, gguf_type: str, n: int, k: int) -> BlockQuantWeight:
    """GGUF tensor data of `gguf_type` (a key of REPACKED; [N, K / block * bytes] uint8, rows of ggml
    blocks) -> a BlockQuantWeight (8-bit, or 4-bit for Q3_K/Q2_K) whose dequantization equals gguf-py's bit for bit (module doc).
    ValueError for an unknown type, a K that is no whole number of blocks, or the wrong byte count."""
    if gguf_type not in REPACKED:
        raise ValueError(f"{gguf_type!r} is not repacked here ({sorted(REPACKED)})")
    fmt, block, size = REPACKED[gguf_type]
    if k % block:
        raise ValueError(f"GGUF {gguf_type} rows must hold whole {block}-value blocks, K={k}")
    nb = n * (k // block)
    with warnings.catch_warnings():  # a read-only memory map: nothing here writes to it
        warnings.simplefilter("ignore", UserWarning)
        data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if data.size != nb * size:
        raise ValueError(f"{gguf_type} [{n}, {k}] needs {nb * size} bytes, got {data.size}")
    q, scales, mins = _DECODERS[fmt](data.reshape(nb, size))
    group = _GROUP[fmt]
    dtype = np.float16 if fmt in _FP16_SCALES else np.float32

    def per_group(t: np.ndarray) -> torch.Tensor:  # [nb, groups per block] -> [N, K / group]
        return torch.from_numpy(np.ascontiguousarray(t.astype(dtype).reshape(n, k // group)))

    values = torch.from_numpy(np.ascontiguousarray(q.reshape(n, k)))
    bits, zero_point = (4, _NIBBLES[fmt]) if fmt in _NIBBLES else (8, 0)
    return BlockQuantWeight(
        pack_nibbles(values) if bits == 4 else values,
        per_group(scales),
        None if mins is None else per_group(mins),
        fmt,
        bits,
        group,
        zero_point,
        k,
        n,
    )
