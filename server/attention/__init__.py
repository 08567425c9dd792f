"""Attention over the paged KV cache. Layout per layer: k_cache, v_cache each
[num_blocks, block_size, num_kv_heads, head_dim]; slot = block_id * block_size + offset."""

from server.attention.backend import AttentionBackend, make_attention_backend
from server.attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "make_attention_backend"]
