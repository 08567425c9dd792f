"""The attention backend protocol and the factory that picks one (torch on CPU, Triton on CUDA)."""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from server.attention.metadata import AttentionMetadata


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
    ) -> Tensor:  # [T, num_heads, head_dim]
        ...


def make_attention_backend(name: str, block_size: int) -> AttentionBackend:
    if name == "torch":
        from server.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(block_size)
    if name == "triton":
        from server.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; expected 'torch' or 'triton'")
