"""Round-to-nearest k-quant writers for tests (gguf-py has no k-quant quantizer): tests/quant/gguf_models.py
and tests/models/gguf_archs.py write GGUF files with them."""

from __future__ import annotations

import numpy as np


def _scale_min_blocks(w: np.ndarray, top: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K's round to nearest: per 32-value sub-block scale (max - min) / top and min <= 0, both as
    6-bit multiples of the super-block's fp16 d and dmin. Returns d, dmin [nb] fp16, the 12 packed scale
    bytes [nb, 12] (as gguf-py's Q4_K.get_scale_min reads them) and q [nb, 8, 32] in 0..top."""
    x = w.astype(np.float32).reshape(-1, 8, 32)  # [nb, sub-block, value]
    lo = np.minimum(x.min(-1), 0.0)
    scale = (x.max(-1) - lo) / float(top)
    d = (scale.max(-1) / 63.0).astype(np.float16)
    dmin = (-lo.min(-1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.where(d32 > 0, np.round(scale / d32), 0), 0, 63).astype(np.uint8)
        mn = np.clip(np.where(dmin32 > 0, np.round(-lo / dmin32), 0), 0, 63).astype(np.uint8)
        step = (d32 * sc)[..., None]
        q = np.where(step > 0, np.round((x + (dmin32 * mn)[..., None]) / step), 0)
    packed = np.concatenate(
        [
            (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
            (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4),
        ],
        axis=1,
    )
    return d, dmin, packed, np.clip(q, 0, top).astype(np.uint8)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """[N, K] float -> [N, K / 256 * 176] uint8 block_q5_K bytes, round to nearest: Q4_K's scales and mins
    with 5-bit values, the low 4 bits as Q4_K's qs, bit 4 of sub-block j's value l at bit j of qh[l]."""
    n, k = w.shape
    d, dmin, packed, q = _scale_min_blocks(w, 31)
    low = (q & 15).reshape(-1, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    qh = (((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8)  # [nb, 32]
    blocks = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, qh, qs], 1
    )
    return np.ascontiguousarray(blocks.reshape(n, k // 256 * 176))


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """[N, K] float -> [N, K / 256 * 144] uint8 block_q4_K bytes, round to nearest (gguf-py has no k-quant
    quantizer). Per 32-value sub-block: scale (max - min) / 15 and min <= 0, both as 6-bit multiples of
    the super-block's fp16 d and dmin; the 12 scale bytes packed as gguf-py's Q4_K.get_scale_min reads."""
    n, k = w.shape
    d, dmin, packed, q4 = _scale_min_blocks(w, 15)
    q = q4.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, qs], 1
    )
    return np.ascontiguousarray(blocks.reshape(n, k // 256 * 144))


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """[N, K] float -> [N, K / 256 * 210] uint8 block_q6_K bytes, round to nearest: per 16-value sub-block
    an int8 multiple of the fp16 d, 6-bit values stored plus 32, split into ql (low 4 bits) and qh (2)."""
    n, k = w.shape
    x = w.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(x).max(-1) / 31.0
    d = (scale.max(-1) / 127.0).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.where(d32 > 0, np.round(scale / d32), 0), -128, 127).astype(np.int8)
        step = (d32 * sc)[..., None]
        q = np.where(step != 0, np.round(x / step), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)  # [nb, half, value]
    ql = (q[:, :, :64] & 15) | ((q[:, :, 64:] & 15) << 4)  # [nb, 2, 64]
    hi = (q >> 4).reshape(-1, 2, 4, 32)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)  # [nb, 2, 32]
    blocks = np.concatenate(
        [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1
    )
    return np.ascontiguousarray(blocks.reshape(n, k // 256 * 210))


K_QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
