"""The KV cache's element type (vLLM's `--kv-cache-dtype`), resolved once at engine start.

The decode step at 16+ users reads more KV-cache bytes than quantized weight bytes (the embedded
SmolLM2 at 16 users x 200 tokens: ~147 MB of fp32 K/V per step against ~96 MB of Q4_1 weights), and the
paged decode kernel is bound by them. A bf16 or fp16 cache halves those bytes and holds twice the
blocks in the same `--kv-cache-memory`. K/V are rounded to the cache type when written (round to nearest
even, as torch's `.to()`), and attention widens them back and computes in the query's type (fp32 for a
quantized GGUF): csrc/paged_decode.cpp for decode rows, torch_backend.py for prompt chunks.

`auto` follows the GEMM decision of server/quant/gemm_dtype.py: bf16 where `--dtype` resolves to bf16
compute (on CPU: AVX512-BF16 or AMX-BF16 usable, loader.cpu_has_native_bf16), else the model's
activation dtype, so an fp32 machine keeps today's fp32 cache. `int8` (CPU only) quantizes K/V with a scale
per 32 values (int8_kv.py): 0.56x a bf16 cache's bytes. vLLM's fp8 names are refused by
CacheConfig. On CUDA the Triton kernels read a cache of the model's dtype only.
"""

from __future__ import annotations

import torch

from server.attention import int8_kv

KV_CACHE_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "int8": torch.int8,  # int8_kv.py's layout: the values, then an fp32 scale per 32 of them
}


def resolve_kv_cache_dtype(
    name: str,  # CacheConfig.cache_dtype: auto, bfloat16, float16 or float32
    model_dtype: torch.dtype,  # the activations' dtype (fp32 for a GGUF served quantized)
    compute_dtype: torch.dtype,  # what --dtype resolves to on this device (loader.resolve_dtype)
    device_type: str,
) -> torch.dtype:
    """The cache's torch dtype. Raises ValueError (naming the flag) for a combination no kernel runs."""
    if name == "auto":
        if device_type == "cpu" and compute_dtype == torch.bfloat16:
            return torch.bfloat16
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype: unknown value {name!r}; expected auto, {', '.join(KV_CACHE_DTYPES)}"
        )
    dtype = KV_CACHE_DTYPES[name]
    if device_type != "cpu" and dtype == torch.int8:
        raise ValueError("--kv-cache-dtype int8: the int8 cache is read by the CPU kernels only; use auto")
    if device_type != "cpu" and dtype != model_dtype:
        raise ValueError(
            f"--kv-cache-dtype {name}: the CUDA (Triton) attention reads a cache of the model's dtype only "
            f"({str(model_dtype).removeprefix('torch.')}); use auto or that dtype"
        )
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_int8_kv_cache(
    dtype: torch.dtype,  # resolve_kv_cache_dtype's
    decode_kernel: object | None,  # TorchAttentionBackend.decode_kernel
    head_dim: int,
    what: str = "this model",
) -> None:
    """Raises ValueError, naming the flag, where an int8 cache cannot be served: no compiled CPU attention
    kernel (every int8 write and decode row goes through it), or a head_dim that is not a multiple of
    int8_kv.GROUP (a scale per 32 values). Nothing for other dtypes."""
    if dtype != torch.int8:
        return
    if decode_kernel is None:
        raise ValueError(
            "--kv-cache-dtype int8 needs the compiled CPU attention kernel (server/attention/cpu_kernel.py), "
            "which this attention backend does not have here; use auto"
        )
    if head_dim % int8_kv.GROUP:
        raise ValueError(
            f"--kv-cache-dtype int8 needs head_dim divisible by {int8_kv.GROUP} (a scale per {int8_kv.GROUP} "
            f"values); {what}'s is {head_dim}: use auto"
        )


def allocate_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,  # resolve_kv_cache_dtype's
    device: torch.device | str,
) -> torch.Tensor:  # [num_blocks, block_size, Hkv, D] zeros: contiguous, or int8_kv's layout for int8
    """One layer's K or V cache of `dtype`."""
    if dtype == torch.int8:
        return int8_kv.allocate(num_blocks, block_size, num_kv_heads, head_dim, device)
    return torch.zeros((num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)
