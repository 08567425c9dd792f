"""The attention backend protocol and the factory that picks one (cpu or torch on CPU, Triton on CUDA)."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from server.attention.metadata import AttentionMetadata

log = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: Tensor,  # [T, num_heads, head_dim]
        k: Tensor,  # [T, num_kv_heads, head_dim]
        v: Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        out_dtype: torch.dtype | None = None,
        sliding_window: int | None = None,
        sinks: Tensor | None = None,  # [num_heads] fp32 on q's device
        softcap: float = 0.0,
    ) -> Tensor:  # [T, num_heads, head_dim] in q's dtype, or out_dtype where the backend honours it
        """`out_dtype`: a dtype the caller takes as well (the o projection's bf16 operand), returned as
        is where every row was computed in it (no widening to q's dtype and rounding again); a backend
        may ignore it. `sliding_window`: this layer's window W >= 1, or None (global attention): the query
        at position p attends to keys p - W + 1 .. p (W keys, itself included), transformers'
        `sliding_window_overlay` (kv_idx > q_idx - W) for Mistral, Qwen2, Gemma 2/3 and gpt-oss. Every
        backend honours it; ValueError for W < 1. `sinks`: gpt-oss's attention sinks, one learned logit
        per query head that joins every softmax's denominator with no value row (out = sum_j e^s_j v_j /
        (sum_j e^s_j + e^sink), transformers' GptOss eager attention); every backend honours them, with
        a window too; None: a plain softmax. `softcap`: 0 (none), or the layer's attention logit soft-cap
        cap > 0 (Gemma 2's `attn_logit_softcapping`, vLLM's `logits_soft_cap`): each scaled score s becomes
        cap * tanh(s / cap) before the mask and softmax; every backend honours it, with windows and
        sinks; ValueError for a negative or non-finite cap."""
        ...


def make_attention_backend(
    name: str, block_size: int, device_type: str = "cpu", cache_dir: Path | None = None
) -> AttentionBackend:
    """`name`: "torch" (plain torch ops), "cpu" (torch plus the compiled decode kernel), "triton", or
    "auto": triton on CUDA; on CPU "cpu" when the kernel builds here, else "torch" (logged, with why).
    An explicit "cpu" whose kernel cannot be built raises KernelBuildError. `cache_dir`: where the
    kernel is built and cached (under kernels/); None = the default cache folder."""
    if name == "auto":
        if device_type == "cuda":
            name = "triton"
        else:
            from server.attention.cpu_kernel import KernelBuildError, load_decode_kernel

            try:
                load_decode_kernel(cache_dir)
                name = "cpu"
            except (KernelBuildError, OSError, subprocess.SubprocessError) as e:
                log.warning("CPU decode kernel unavailable, serving with plain torch attention: %s", e)
                name = "torch"
    if name in ("torch", "cpu"):
        if name == "cpu" and device_type != "cpu":
            raise ValueError(f"attention backend 'cpu' runs on CPU only, the device is {device_type}")
        from server.attention.cpu_kernel import load_decode_kernel
        from server.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(block_size, load_decode_kernel(cache_dir) if name == "cpu" else None)
    if name == "triton":
        from server.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; expected 'auto', 'torch', 'cpu' or 'triton'")
