"""The int8 KV cache (`--kv-cache-dtype int8`, CPU): K and V stored as int8 with one fp32 scale per 32
values of each head's row, 0.56x a bf16 cache's bytes (D + D / 8 against 2 D per row).

A decode step over long contexts reads more KV bytes than weight bytes (8 users x 2k tokens of
Llama-3.2-1B: 268 MB of bf16 K/V against ~0.8 GB of Q4_K_M weights; the context's share of the step fell
37% from an fp32 to a bf16 cache: docs/benchmarks-log.md, "Would an 8-bit KV cache pay on CPU?"), and
the cache's capacity caps how many users and tokens fit. The format is llama.cpp's q8_0 cache type with
an fp32 scale: per group x of 32 consecutive values of a row, `scale = max|x| / 127` and
`q = round(x * (127 / max|x|))` (ties to even, clamped to +-127; a group of zeros has scale 0), so a
value's error is at most max|x| / 254. Groups rather than one scale per row: K rows carry outlier
channels, and one scale per 64-value row doubled the embedded SmolLM2's largest prompt-logprob error
(0.318 against 0.129 nats for groups of 32, fp32 elsewhere; docs/benchmarks-log.md). head_dim must be a
multiple of 32 (64, 96, 128, 256: the models served here).

Layout, per layer and K or V: one int8 buffer of `num_blocks` blocks, each `block_size * Hkv * D` values
([block_size, Hkv, D] as a float cache's block) followed by their scales, fp32 [block_size, Hkv, D / 32].
The cache tensor handed around is the view [num_blocks, block_size, Hkv, D] of the values (block stride
`block_bytes`, so it is not contiguous; `index_select` over blocks and per-block views work on it), and
`scales()` views the same buffer's scales. The compiled kernels know the layout from the dtype code
(csrc/paged_decode.cpp, int8_block_elems): the decode passes dequantize each 16 (8) values as they load
them, and `kubeinfer_kv_store` quantizes every write (the Python path's too, so both paths store the same
bytes); prompt chunks attend over the rows read back dequantized (`gather_blocks`) with torch's SDPA. Only
CPU: the CUDA kernels read a cache of the model's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

GROUP = 32  # values per scale
SCALE_BYTES = 4  # fp32 scales
_INV_127 = torch.tensor(1 / 127, dtype=torch.float32)  # the compiled store's 1.0f / 127.0f


def block_bytes(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one block of one layer's K (or V): the values and their scales."""
    return block_size * num_kv_heads * (head_dim + SCALE_BYTES * (head_dim // GROUP))


def allocate(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, device: torch.device | str = "cpu"
) -> Tensor:  # [num_blocks, block_size, Hkv, D] int8, a view with the scales after each block
    """A zeroed int8 cache (scales 0: every row reads as zeros until written). Raises ValueError for a
    head_dim that is not a multiple of 32."""
    if head_dim % GROUP:
        raise ValueError(f"an int8 KV cache needs head_dim divisible by {GROUP}, got {head_dim}")
    row = block_bytes(block_size, num_kv_heads, head_dim)
    buf = torch.zeros(num_blocks, row, dtype=torch.int8, device=device)
    # explicit strides: a view would give a one-block cache the values' own block stride (a size-1
    # dimension's stride is free), which is_int8_cache and the kernels' checks refuse
    return buf.as_strided(
        (num_blocks, block_size, num_kv_heads, head_dim), (row, num_kv_heads * head_dim, head_dim, 1)
    )


def is_int8_cache(cache: Tensor) -> bool:
    """Whether `cache` is an int8 cache in this module's layout (`allocate`'s view)."""
    if cache.dtype != torch.int8 or cache.dim() != 4:
        return False
    _, bs, hkv, d = cache.shape
    return (
        d % GROUP == 0
        and cache.stride() == (block_bytes(bs, hkv, d), hkv * d, d, 1)
        and cache.storage_offset() == 0
    )


def scales(cache: Tensor) -> Tensor:  # [num_blocks, block_size, Hkv, D / 32] fp32, a view of the buffer
    """The scales of an `allocate`d cache; writing to it writes the cache."""
    if not is_int8_cache(cache):
        raise ValueError("not an int8 KV cache in int8_kv's layout")
    n, bs, hkv, d = cache.shape
    ng = d // GROUP
    raw = torch.as_strided(
        cache, (n, bs * hkv * ng * SCALE_BYTES), (block_bytes(bs, hkv, d), 1), bs * hkv * d
    )
    return raw.view(torch.float32).view(n, bs, hkv, ng)


def quantize(x: Tensor) -> tuple[Tensor, Tensor]:  # x: [..., D] float -> ([..., D] int8, [..., D / 32] fp32)
    """The reference of the compiled store, bit for bit: per group of 32 values `inv = 127 / max|x|`,
    `round(x * inv)` (ties to even) clamped to +-127, scale `max|x| * fp32(1 / 127)`, all in fp32."""
    xg = x.float().unflatten(-1, (x.shape[-1] // GROUP, GROUP))
    amax = xg.abs().amax(dim=-1)
    # a true division (`127.0 / t` is torch's reciprocal times 127, rounded twice)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    q = torch.round(xg * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.flatten(-2), amax * _INV_127


def dequantize(
    q: Tensor,  # [..., D] int8
    scale: Tensor,  # [..., D / 32] fp32
    dtype: torch.dtype,
) -> Tensor:  # [..., D] in dtype
    """q * scale, computed in fp32 and rounded once to `dtype`."""
    qg = q.float().unflatten(-1, (q.shape[-1] // GROUP, GROUP))
    return (qg * scale[..., None]).flatten(-2).to(dtype)


def gather_blocks(
    cache: Tensor,  # [num_blocks, block_size, Hkv, D] int8 (allocate's view)
    blocks: Tensor,  # [B] int64 block ids
    dtype: torch.dtype,
) -> Tensor:  # [B, block_size, Hkv, D] in dtype
    """Those blocks' rows dequantized (what `index_select(0, blocks).to(dtype)` is for a float cache)."""
    return dequantize(cache.index_select(0, blocks), scales(cache).index_select(0, blocks), dtype)
