"""Argument checks and launch helpers shared by the launchers (private to the package)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """True when the kernels were defined under TRITON_INTERPRET=1 (they then run on CPU tensors)."""
    return bool(triton.knobs.runtime.interpret)


def upcast_loads(dtype: torch.dtype) -> bool:
    """Whether kernels must cast loads to fp32 before any arithmetic.

    The interpreter computes bf16 (and fp16 dots) wrongly, so under it everything runs in fp32; on a GPU
    16-bit operands go to the tensor cores as they are.
    """
    return interpreting() or dtype == torch.float32


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 models get exact fp32 dots; tf32 would cost ~1e-3 relative error and fail the parity tests.
    return "ieee" if dtype == torch.float32 else "tf32"


def check_dtype(name: str, t: Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        raise TypeError(f"{name}: dtype {t.dtype} not in {[str(d) for d in allowed]}")


def check_shape(name: str, t: Tensor, shape: Sequence[int | None]) -> None:
    """`None` in `shape` accepts any size on that dimension."""
    if t.dim() != len(shape) or any(
        want is not None and got != want for got, want in zip(t.shape, shape, strict=True)
    ):
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {tuple(shape)} (None = any)")


def check_last_dim_contiguous(name: str, t: Tensor) -> None:
    # Inner tiles are loaded as contiguous vectors; other strides are passed to the kernels.
    if t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(f"{name}: last dimension must have stride 1, got strides {t.stride()}")


def check_contiguous(name: str, t: Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")


def check_devices(tensors: Iterable[tuple[str, Tensor]]) -> torch.device:
    """All tensors on one device: CUDA normally, CPU only under the interpreter."""
    items = list(tensors)
    device = items[0][1].device
    for name, t in items:
        if t.device != device:
            raise ValueError(f"{name}: on {t.device}, expected {device} like {items[0][0]}")
    if interpreting():
        if device.type != "cpu":
            raise ValueError(f"TRITON_INTERPRET=1 runs kernels on CPU tensors, got {device}")
    elif device.type != "cuda":
        raise ValueError(f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {device}")
    return device


# The kernels' window argument for "no window": wider than any context they are launched for.
NO_WINDOW = 1 << 30


def window_arg(sliding_window: int | None) -> int:
    """A launcher's `sliding_window` (W >= 1, or None for the whole context) as the kernels' int
    argument; raises ValueError for anything else."""
    if sliding_window is None:
        return NO_WINDOW
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    return min(sliding_window, NO_WINDOW)


def next_pow2(n: int) -> int:
    return int(triton.next_power_of_2(max(int(n), 1)))


LOG2E = 1.4426950408889634


def check_paged_attention_args(
    q: Tensor,  # [T, num_heads, head_dim]
    k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: Tensor,  # [num_seqs, max_blocks] int32
    context_lens: Tensor,  # [num_seqs] int32
) -> None:
    """Checks shared by the decode and prefill launchers."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    check_dtype("k_cache", k_cache, FLOAT_DTYPES)
    check_shape("q", q, (None, None, head_dim))
    check_shape("v_cache", v_cache, (num_blocks, block_size, num_kv_heads, head_dim))
    check_shape("block_tables", block_tables, (None, None))
    check_shape("context_lens", context_lens, (block_tables.shape[0],))
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"num_heads {q.shape[1]} must be a multiple of num_kv_heads {num_kv_heads}")
    check_dtype("q", q, (k_cache.dtype,))
    check_dtype("v_cache", v_cache, (k_cache.dtype,))
    check_dtype("block_tables", block_tables, (torch.int32,))
    check_dtype("context_lens", context_lens, (torch.int32,))
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    check_contiguous("block_tables", block_tables)
    check_contiguous("context_lens", context_lens)
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")


def softcap_arg(softcap: float) -> float:
    """A launcher's `softcap` (vLLM's `logits_soft_cap`, Gemma 2's `attn_logit_softcapping`): 0 for none,
    else cap > 0, each scaled score s becoming cap * tanh(s / cap) before the mask and softmax. Returns
    the cap in the kernels' log2 units (cap * log2(e), which caps the log2-scaled scores alike). Raises
    ValueError for a negative, NaN or infinite cap or a non-number."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise ValueError(f"softcap must be a float >= 0 (0: none), got {softcap!r}")
    cap = float(softcap)
    if not math.isfinite(cap) or cap < 0:
        raise ValueError(f"softcap must be a finite float >= 0 (0: none), got {softcap!r}")
    return cap * LOG2E


@triton.jit
def tanh_cap(s, cap):
    """cap * tanh(s / cap) as sign(y) (1 - e) / (1 + e), y = s / cap, e = exp(-2 |y|) <= 1: no overflow
    (Triton's libdevice tanh is not in the interpreter)."""
    y = s / cap
    e = tl.exp(-2.0 * tl.abs(y))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(y < 0.0, -t, t)


def sinks_arg(sinks: Tensor | None, q: Tensor) -> Tensor:
    """A launcher's `sinks` (gpt-oss's attention sinks: [num_heads] fp32 on q's device, one logit per
    query head joining each softmax's denominator) as the kernels' pointer; None -> q, a pointer the
    kernels never read (HAS_SINKS off). Raises ValueError/TypeError naming `sinks`."""
    if sinks is None:
        return q
    if sinks.dtype != torch.float32:
        raise TypeError(f"sinks: expected float32, got {sinks.dtype}")
    if sinks.shape != (q.shape[1],) or not sinks.is_contiguous():
        raise ValueError(f"sinks: expected a contiguous [{q.shape[1]}] tensor, got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks: on {sinks.device}, q on {q.device}")
    return sinks
