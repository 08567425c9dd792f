"""The compiled CPU decode-attention kernel (csrc/paged_decode.cpp): build once, cache, call via ctypes.

Torch ops cannot read the paged KV cache in place: the torch path gathers each sequence's blocks into a
dense copy, runs SDPA over it and scatters the result, so every K/V byte crosses memory three times.
The kernel reads each K/V row once, straight from the block table. It is plain C++ with an extern "C"
entry point (no torch headers, so it builds in ~2 s with any g++/clang++), compiled for this CPU
(-march=native) and cached under the kubeinfer cache folder, keyed by source, flags and CPU features.
Without a compiler, or if the build fails, `load_decode_kernel()` says why and the torch path serves.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from server.attention.int8_kv import is_int8_cache
from server.config import default_cache_dir
from server.native import KernelBuildError, NativeSource, load_library, usable_cpu_features

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
ABI_VERSION = 9  # 3: _set_bf16 / _bf16_enabled; 4: kubeinfer_paged_prefill; 5: _isa; 6: sliding windows;
# 7: attention sinks; 8: attention logit soft-cap (kubeinfer_paged_decode_capped, prefill's softcap);
# 9: int8 caches (cache dtype 3), kubeinfer_kv_store takes Hkv, D and block_size
MAX_HEAD_DIM = 512  # the kernel's merge pass keeps one head's output row on the stack
# -ffast-math lets the compiler vectorize the dot products and exp (libmvec). It only goes on the compile
# step: linking a shared library with it would, on older gcc, pull in crtfastmath.o, which turns on
# flush-to-zero for the whole process when the library loads.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17")
LINK_FLAGS = ("-shared", "-fopenmp")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # q and out
# k/v caches, any q dtype; int8 in int8_kv's layout (each block's values, then their scales)
CACHE_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3}
NATIVE = NativeSource("paged_decode", SOURCE, COMPILE_FLAGS, LINK_FLAGS, abi_version=ABI_VERSION)

__all__ = ["DecodeKernel", "KernelBuildError", "PrefillChunks", "load_decode_kernel"]


@dataclass(frozen=True)
class DecodeKernel:
    """The loaded library; `__call__` checks its arguments, since a wrong pointer crashes the process."""

    lib: ctypes.CDLL
    path: Path
    # The K pass over a bf16 cache takes vdpbf16ps (usable AVX512-BF16 in an AVX-512 build): q split into
    # three bf16 parts that hold it exactly, so only the order of the fp32 sums differs (csrc, scores16_bf16x3).
    bf16: bool = False
    # Usable AMX-BF16: torch's bf16 SDPA (oneDNN's brgemm on AMX tiles) outruns `prefill` 1.6-3x there
    # (benchmarks/cpu_attention.py, Xeon with AMX, 2026-12-02), so the backend hands it the prompt chunks.
    amx_bf16: bool = False
    # The decode passes the build runs (kubeinfer_paged_decode_isa): "avx512" or "avx2" (register-blocked,
    # by the -march level it was built for) or "generic" (plain loops the compiler vectorizes as it can).
    isa: str = "generic"

    def __call__(
        self,
        out: Tensor,  # [T, Hq, D] fp32 or bf16 like q, rows[i] written for each decode sequence i
        q: Tensor,  # [T, Hq, D] fp32 or bf16
        k_cache: Tensor,  # [num_blocks, block_size, Hkv, D] fp32, bf16, fp16 (widened to fp32 rows) or int8 (int8_kv)
        v_cache: Tensor,  # [num_blocks, block_size, Hkv, D] like k_cache
        block_tables: Tensor,  # [num_seqs, max_blocks] int32
        context_lens: Tensor,  # [num_seqs] int32
        seqs: Tensor,  # [Sd] int64, the sequence (row of block_tables) of each decode query
        rows: Tensor,  # [Sd] int64, the row of q/out of each decode query
        scale: float,
        indices_checked: bool = False,
        sliding_window: int | None = None,
        sinks: Tensor | None = None,  # [Hq] fp32 contiguous: attention sinks (check_sinks)
        softcap: float = 0.0,
    ) -> None:
        """`indices_checked=True` skips the bounds checks of `check_decode_indices` (a few reductions),
        for a caller that ran them once for a batch it then sends through every layer. `sliding_window` W:
        each query (position context_len - 1) attends to the last W positions only (`check_window`).
        `sinks`: one logit per query head added to each softmax's denominator (gpt-oss). `softcap`: 0, or
        Gemma 2's attention logit soft-cap, each scaled score s taken as cap * tanh(s / cap) before the
        softmax (`check_softcap`: ValueError for a negative or non-finite cap)."""
        window = check_window(sliding_window)
        cap = check_softcap(softcap)
        check_decode_args(out, q, k_cache, v_cache, block_tables, context_lens, seqs, rows)
        check_sinks(sinks, q.shape[1])
        if not indices_checked:
            check_decode_indices(q.shape[0], k_cache.shape, block_tables, context_lens, seqs, rows)
        _, hq, d = q.shape
        _, block_size, hkv, _ = k_cache.shape
        rc = self.lib.kubeinfer_paged_decode_capped(
            _DTYPE_CODES[q.dtype],
            CACHE_DTYPE_CODES[k_cache.dtype],
            out.data_ptr(),
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            context_lens.data_ptr(),
            seqs.data_ptr(),
            rows.data_ptr(),
            seqs.shape[0],
            q.stride(0),
            out.stride(0),
            block_tables.shape[1],
            hq,
            hkv,
            d,
            block_size,
            float(scale),
            window,
            None if sinks is None else sinks.data_ptr(),
            cap,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"paged decode kernel returned {rc}")

    def prefill(
        self,
        out: Tensor,  # [T, Hq, D] q's dtype, the rows of every chunk written
        q: Tensor,  # [T, Hq, D] fp32 or bf16, each row's heads contiguous (rows may be strided)
        k_cache: Tensor,  # [num_blocks, block_size, Hkv, D] bf16, already holding the chunks' own K/V
        v_cache: Tensor,  # like k_cache
        block_tables: Tensor,  # [num_seqs, max_blocks] int32
        chunks: PrefillChunks,
        scale: float,
        indices_checked: bool = False,
        sliding_window: int | None = None,
        sinks: Tensor | None = None,  # [Hq] fp32 contiguous: attention sinks (check_sinks)
        softcap: float = 0.0,
    ) -> bool:
        """Causal attention of prompt chunks over their whole context in the paged cache, in bf16 products
        with fp32 sums (csrc/paged_decode.cpp, `kubeinfer_paged_prefill`: flash-attention's online softmax,
        q * scale and the probabilities rounded to bf16). Returns False, writing nothing, where this kernel
        has no such path (no usable AVX512-BF16, head_dim not 64, 128 or 256): the caller attends itself.
        `indices_checked=True` skips `check_prefill_chunks` for a caller that ran it once per step.
        A bf16 q (a bf16 model's) is widened to fp32, exactly, and the chunks' rows of `out` (bf16 too)
        are the kernel's fp32 rows rounded to nearest even: the kernel rounds q * scale to bf16 itself.
        `sliding_window` W: the query at position p attends to positions p - W + 1 .. p only. `sinks`:
        one logit per query head added to each softmax's denominator (gpt-oss). `softcap`: 0, or the
        attention logit soft-cap applied to the scaled scores (`check_softcap`)."""
        window = check_window(sliding_window)
        cap = check_softcap(softcap)
        if not self.prefill_supported(q.dtype, k_cache.dtype, q.shape[2]):
            return False
        if q.dtype == torch.bfloat16:
            # The kernel reads and writes fp32 rows. Taking a bf16 model's prompt chunks here instead of
            # torch's bf16 SDPA: a 4,096-token prefill 1.57x faster on a Zen 5 (docs/benchmarks-log.md).
            if out.dtype != torch.bfloat16 or out.shape != q.shape:
                raise TypeError(
                    f"out must be bf16 {tuple(q.shape)} for a bf16 q, got {out.dtype} {tuple(out.shape)}"
                )
            wide = torch.empty(q.shape, dtype=torch.float32)
            done = self.prefill(
                wide,
                q.float(),
                k_cache,
                v_cache,
                block_tables,
                chunks,
                scale,
                indices_checked=indices_checked,
                sliding_window=sliding_window,
                sinks=sinks,
                softcap=softcap,
            )
            for start, n in zip(chunks.q_starts.tolist(), chunks.q_lens.tolist(), strict=True):
                out[start : start + n].copy_(wide[start : start + n])
            return done
        _check_operands(out, q, k_cache, v_cache, block_tables)
        check_sinks(sinks, q.shape[1])
        if block_tables.dim() != 2:
            raise ValueError("block_tables must be [num_seqs, max_blocks]")
        if not indices_checked:
            check_prefill_chunks(q.shape[0], k_cache.shape, block_tables, chunks)
        if chunks.seqs.numel() == 0:
            return True  # nothing to attend; the library's work split divides by the chunk count (SIGFPE)
        _, hq, d = q.shape
        _, block_size, hkv, _ = k_cache.shape
        rc = self.lib.kubeinfer_paged_prefill(
            out.data_ptr(),
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            chunks.seqs.data_ptr(),
            chunks.q_starts.data_ptr(),
            chunks.q_lens.data_ptr(),
            chunks.ctx_lens.data_ptr(),
            chunks.seqs.shape[0],
            q.stride(0),
            out.stride(0),
            block_tables.shape[1],
            hq,
            hkv,
            d,
            block_size,
            float(scale),
            window,
            None if sinks is None else sinks.data_ptr(),
            cap,
            torch.get_num_threads(),
        )
        return rc == 0

    def prefill_supported(self, dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> bool:
        """Whether `prefill` runs for fp32/bf16 q over this cache dtype and head_dim here."""
        return (
            self.bf16
            and dtype in (torch.float32, torch.bfloat16)
            and cache_dtype == torch.bfloat16
            and head_dim in (64, 128, 256)
        )

    def store_kv(
        self,
        k_cache: Tensor,  # [num_blocks, block_size, Hkv, D] fp32, bf16 or fp16 contiguous, or int8 (int8_kv)
        v_cache: Tensor,  # like k_cache
        slots: Tensor,  # [T] int64, each in [0, num_blocks * block_size)
        k: Tensor,  # [T, Hkv, D] fp32, each row's heads contiguous
        v: Tensor,  # [T, Hkv, D] fp32, strided like k
    ) -> None:
        """`kubeinfer_kv_store`, the decode graph's K/V write: rounds to a float cache's dtype to nearest
        even (as `.to()`), quantizes to an int8 cache with a scale per 32 values (int8_kv.quantize). Raises ValueError/TypeError
        for arguments it cannot take."""
        t, hkv, d = k.shape
        if k_cache.dtype not in CACHE_DTYPE_CODES or v_cache.dtype != k_cache.dtype:
            raise TypeError(f"caches: dtypes {k_cache.dtype}, {v_cache.dtype}; expected one cache dtype")
        if k.dtype != torch.float32 or v.dtype != torch.float32 or slots.dtype != torch.int64:
            raise TypeError("k and v must be fp32, slots int64")
        if not (_cache_layout_ok(k_cache) and _cache_layout_ok(v_cache) and slots.is_contiguous()):
            raise ValueError("caches must be contiguous (int8: int8_kv's layout), slots contiguous")
        if v.shape != k.shape or v.stride() != k.stride() or k.stride()[1:] != (d, 1):
            raise ValueError("k and v must be [T, Hkv, D] with the same strides and contiguous rows")
        if k_cache.shape[2:] != (hkv, d) or v_cache.shape != k_cache.shape or slots.shape != (t,):
            raise ValueError("shapes disagree")
        if t and (int(slots.min()) < 0 or int(slots.max()) >= k_cache.shape[0] * k_cache.shape[1]):
            raise ValueError("slots: out of range of the cache")
        rc = self.lib.kubeinfer_kv_store(
            CACHE_DTYPE_CODES[k_cache.dtype],
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            slots.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            k.stride(0),
            t,
            hkv,
            d,
            k_cache.shape[1],
        )
        if rc != 0:
            raise RuntimeError(f"kv store returned {rc}")


def check_window(sliding_window: int | None) -> int:
    """A layer's sliding window as the kernels take it: W >= 1 (the query at position p sees keys
    p - W + 1 .. p, transformers' `sliding_window_overlay`: kv_idx > q_idx - W), or 0 for None (the whole
    context). Raises ValueError for W < 1."""
    if sliding_window is None:
        return 0
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    return sliding_window


def check_softcap(softcap: float) -> float:
    """An attention logit soft-cap as the kernels take it (vLLM's `logits_soft_cap`, Gemma 2's
    `attn_logit_softcapping`): 0 for none, else cap > 0, each scaled score s becoming cap * tanh(s / cap)
    before the mask and softmax. Raises ValueError for a negative, NaN or infinite cap or a non-number."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise ValueError(f"softcap must be a float >= 0 (0: none), got {softcap!r}")
    cap = float(softcap)
    if not math.isfinite(cap) or cap < 0:
        raise ValueError(f"softcap must be a finite float >= 0 (0: none), got {softcap!r}")
    return cap


def check_sinks(sinks: Tensor | None, num_heads: int) -> None:
    """Attention sinks as the kernels read them: None, or a contiguous fp32 CPU tensor [num_heads] (one
    logit per query head). Raises TypeError/ValueError, since the kernel reads num_heads floats."""
    if sinks is None:
        return
    if sinks.dtype != torch.float32 or sinks.device.type != "cpu":
        raise TypeError(f"sinks: expected a float32 CPU tensor, got {sinks.dtype} on {sinks.device}")
    if sinks.shape != (num_heads,) or not sinks.is_contiguous():
        raise ValueError(f"sinks: expected a contiguous [{num_heads}] tensor, got {tuple(sinks.shape)}")


def supports_dtype(dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> bool:
    """Whether the kernel runs q/out of `dtype` over a cache of `cache_dtype` (None: `dtype`)."""
    return dtype in _DTYPE_CODES and (cache_dtype or dtype) in CACHE_DTYPE_CODES


@dataclass(frozen=True)
class PrefillChunks:
    """The prompt chunks of one step for `DecodeKernel.prefill`: chunk c is q's rows [q_starts[c],
    q_starts[c] + q_lens[c]), the last q_lens[c] positions of a context of ctx_lens[c] tokens held by
    block_tables row seqs[c]."""

    seqs: Tensor  # [C] int64
    q_starts: Tensor  # [C] int64
    q_lens: Tensor  # [C] int32
    ctx_lens: Tensor  # [C] int32


def check_prefill_chunks(
    num_rows: int,
    cache_shape: torch.Size,  # [num_blocks, block_size, Hkv, D]
    block_tables: Tensor,  # [num_seqs, max_blocks] int32
    chunks: PrefillChunks,
) -> None:
    """Bounds of every index the prefill kernel follows (a bad one would read or write outside a tensor):
    ValueError/TypeError."""
    for name, t, dtype in (
        ("seqs", chunks.seqs, torch.int64),
        ("q_starts", chunks.q_starts, torch.int64),
        ("q_lens", chunks.q_lens, torch.int32),
        ("ctx_lens", chunks.ctx_lens, torch.int32),
    ):
        if t.dtype != dtype or t.dim() != 1 or t.shape != chunks.seqs.shape or not t.is_contiguous():
            raise TypeError(f"chunks.{name}: expected a contiguous [C] {dtype} tensor")
    if chunks.seqs.numel() == 0:
        return
    num_blocks, block_size = cache_shape[0], cache_shape[1]
    n, ctx = chunks.q_lens.long(), chunks.ctx_lens.long()
    if int(n.min()) < 1 or bool((ctx < n).any()) or int(ctx.max()) > block_tables.shape[1] * block_size:
        raise ValueError("chunks: each needs 1 <= q_len <= ctx_len <= max_blocks * block_size")
    if int(chunks.q_starts.min()) < 0 or int((chunks.q_starts + n).max()) > num_rows:
        raise ValueError("chunks: query rows out of range of q")
    seqs = chunks.seqs
    if int(seqs.min()) < 0 or int(seqs.max()) >= block_tables.shape[0]:
        raise ValueError("chunks.seqs: out of range of block_tables")
    used = block_tables.index_select(0, seqs)[:, : -(-int(ctx.max()) // block_size)]
    nb = (ctx + block_size - 1) // block_size  # [C] blocks each context reads
    cols = torch.arange(used.shape[1])
    ids = used[cols[None, :] < nb[:, None]]
    if int(ids.min()) < 0 or int(ids.max()) >= num_blocks:
        raise ValueError("block_tables: block id out of range of the cache")


def _check_operands(
    out: Tensor, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, **indices: Tensor
) -> None:
    """What both kernels take alike: devices, contiguity, q/out and cache dtypes and shapes (metadata only).
    `indices` (name -> tensor) are checked for device and contiguity too."""
    tensors = {
        "out": out,
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": block_tables,
        **indices,
    }
    for name, t in tensors.items():
        if t.device.type != "cpu":
            raise ValueError(f"{name}: the CPU kernel needs CPU tensors, got {t.device}")
        # q and out only need each row's heads contiguous: q is usually a view into the fused qkv output.
        row_dense = (
            t.dim() == 3
            and t.stride(2) == 1
            and t.stride(1) == t.shape[2]
            and t.stride(0) >= t.shape[1] * t.shape[2]
        )
        if name in ("k_cache", "v_cache"):
            if not _cache_layout_ok(t):
                raise ValueError(
                    f"{name}: must be contiguous (int8: int8_kv's layout), got strides {t.stride()} for "
                    f"{tuple(t.shape)}"
                )
        elif not (t.is_contiguous() or (name in ("q", "out") and row_dense)):
            raise ValueError(f"{name}: must be contiguous, got strides {t.stride()} for {tuple(t.shape)}")
    if q.dtype not in _DTYPE_CODES:
        raise TypeError(f"q: dtype {q.dtype} not supported (float32 or bfloat16)")
    if out.dtype != q.dtype:
        raise TypeError(f"out: dtype {out.dtype}, expected {q.dtype} like q")
    if k_cache.dtype not in CACHE_DTYPE_CODES or v_cache.dtype != k_cache.dtype:
        raise TypeError(
            f"k_cache, v_cache: dtypes {k_cache.dtype}, {v_cache.dtype}; expected one of float32, bfloat16, "
            "float16, int8 for both"
        )
    if block_tables.dtype != torch.int32:
        raise TypeError(f"block_tables: dtype {block_tables.dtype}, expected {torch.int32}")
    if q.dim() != 3 or out.shape != q.shape:
        raise ValueError(f"q and out must both be [T, Hq, D], got {tuple(q.shape)} and {tuple(out.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must be one [num_blocks, block_size, Hkv, D] shape, got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {d} is above the kernel's {MAX_HEAD_DIM}")
    if k_cache.shape[3] != d or hq % hkv:
        raise ValueError(
            f"head shapes disagree: q has {hq} heads of {d}, the cache {hkv} of {k_cache.shape[3]}"
        )


def _cache_layout_ok(cache: Tensor) -> bool:
    """A float cache contiguous, an int8 one in int8_kv's layout (the kernels address blocks by it)."""
    return is_int8_cache(cache) if cache.dtype == torch.int8 else cache.is_contiguous()


def check_decode_args(
    out: Tensor,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    seqs: Tensor,
    rows: Tensor,
) -> None:
    """Devices, dtypes, contiguity and shapes: metadata only, cheap enough for every layer."""
    _check_operands(out, q, k_cache, v_cache, block_tables, context_lens=context_lens, seqs=seqs, rows=rows)
    for name, t, dtype in (
        ("context_lens", context_lens, torch.int32),
        ("seqs", seqs, torch.int64),
        ("rows", rows, torch.int64),
    ):
        if t.dtype != dtype:
            raise TypeError(f"{name}: dtype {t.dtype}, expected {dtype}")
    if block_tables.dim() != 2 or context_lens.shape != (block_tables.shape[0],):
        raise ValueError("block_tables must be [num_seqs, max_blocks] and context_lens [num_seqs]")
    if seqs.dim() != 1 or rows.shape != seqs.shape:
        raise ValueError("seqs and rows must be 1-D and of one length")


def check_decode_indices(
    num_rows: int,
    cache_shape: torch.Size,  # [num_blocks, block_size, Hkv, D]
    block_tables: Tensor,  # [num_seqs, max_blocks] int32
    context_lens: Tensor,  # [num_seqs] int32
    seqs: Tensor,  # [Sd] int64
    rows: Tensor,  # [Sd] int64
) -> None:
    """The bounds the kernel relies on: a bad batch raises here instead of reading stray memory."""
    if not seqs.numel():
        return
    if int(seqs.min()) < 0 or int(seqs.max()) >= block_tables.shape[0]:
        raise ValueError("seqs: index out of range of block_tables")
    if int(rows.min()) < 0 or int(rows.max()) >= num_rows:
        raise ValueError("rows: index out of range of q")
    num_blocks, block_size = cache_shape[0], cache_shape[1]
    ctx = context_lens.index_select(0, seqs)
    if int(ctx.min()) < 1 or int(ctx.max()) > block_tables.shape[1] * block_size:
        raise ValueError("context_lens: each decode context must be in [1, max_blocks * block_size]")
    used = block_tables.index_select(0, seqs)[:, : -(-int(ctx.max()) // block_size)]
    if int(used.min()) < 0 or int(used.max()) >= num_blocks:
        raise ValueError("block_tables: block id out of range of the cache")


@functools.cache
def load_decode_kernel(cache_dir: Path | None = None) -> DecodeKernel:
    """Builds (or finds under `cache_dir`/kernels, default `default_cache_dir()`) and loads the kernel;
    raises KernelBuildError saying why not."""
    lib, path = load_library(NATIVE, cache_dir or default_cache_dir())
    return bind_decode_kernel(lib, path)


def bind_decode_kernel(lib: ctypes.CDLL, path: Path) -> DecodeKernel:
    """Declares the entry points' C signatures on a loaded library (any build of SOURCE)."""
    fn = lib.kubeinfer_paged_decode
    fn.restype = ctypes.c_int32
    i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [i32, i32] + [ptr] * 8 + [i64] * 4 + [i32] * 4 + [ctypes.c_float, i32]
    fw = lib.kubeinfer_paged_decode_window
    fw.restype = ctypes.c_int32
    fw.argtypes = [i32, i32] + [ptr] * 8 + [i64] * 4 + [i32] * 4 + [ctypes.c_float, i32, ptr, i32]
    fc = lib.kubeinfer_paged_decode_capped
    fc.restype = ctypes.c_int32
    f32 = ctypes.c_float
    fc.argtypes = [i32, i32] + [ptr] * 8 + [i64] * 4 + [i32] * 4 + [f32, i32, ptr, f32, i32]
    store = lib.kubeinfer_kv_store
    store.restype = ctypes.c_int32
    store.argtypes = [i32] + [ptr] * 5 + [i64] * 2 + [i32] * 3
    pf = lib.kubeinfer_paged_prefill
    pf.restype = i32
    pf.argtypes = [ptr] * 9 + [i64] * 4 + [i32] * 4 + [ctypes.c_float, i32, ptr, ctypes.c_float, i32]
    lib.kubeinfer_paged_decode_set_bf16.restype = None
    lib.kubeinfer_paged_decode_set_bf16.argtypes = [i32]
    lib.kubeinfer_paged_decode_bf16_enabled.restype = i32
    lib.kubeinfer_paged_decode_isa.restype = i32
    isa = {2: "avx512", 1: "avx2"}.get(lib.kubeinfer_paged_decode_isa(), "generic")
    # Only where the OS enabled the state and KUBEINFER_CPU_DISABLE leaves it on (never cpuinfo alone).
    features = usable_cpu_features()
    lib.kubeinfer_paged_decode_set_bf16(int(features.avx512_bf16 and features.avx512bw))
    return DecodeKernel(lib, path, bool(lib.kubeinfer_paged_decode_bf16_enabled()), features.amx_bf16, isa)
