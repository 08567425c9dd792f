"""store_kv_cache against the torch reference."""

from __future__ import annotations

import pytest
import torch
from kubeinfer_kernels import store_kv_cache
from kubeinfer_kernels.reference import store_kv_cache_ref


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_matches_reference(
    block_size: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> None:
    num_blocks, num_kv_heads, num_tokens = 6, 2, 9
    # k and v as strided views of one fused projection, the way the model slices them.
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim).to(dtype).to(device)
    k, v = fused[:, num_kv_heads : 2 * num_kv_heads], fused[:, 2 * num_kv_heads :]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape).to(dtype).to(device)
    v_cache = torch.randn(shape).to(dtype).to(device)
    # Scattered slots, including the first and last of the cache, and padding (-1) rows.
    last = num_blocks * block_size - 1
    slots = [0, -1, last, 3 * block_size + 5, -1, block_size - 1, 2 * block_size, 4 * block_size + 7, 17]
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_cache_ref(k, v, k_ref, v_ref, slot_mapping)
    store_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    # A copy: bit-exact, and every slot not named (and the -1 rows' data) leaves the cache untouched.
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat_k[last], k[2])
    assert torch.equal(flat_k[17], k[8])


def test_store_empty_batch_is_a_no_op(device: torch.device) -> None:
    cache = torch.randn(2, 16, 1, 64, device=device)
    before = cache.clone()
    empty = torch.empty(0, 1, 64, device=device)
    store_kv_cache(empty, empty, cache, cache, torch.empty(0, dtype=torch.int64, device=device))
    assert torch.equal(cache, before)


def test_store_rejects_bad_arguments(device: torch.device) -> None:
    cache = torch.zeros(2, 16, 2, 64, device=device)
    k = torch.zeros(3, 2, 64, device=device)
    slots = torch.zeros(3, dtype=torch.int64, device=device)
    with pytest.raises(TypeError, match="slot_mapping"):
        store_kv_cache(k, k, cache, cache, slots.int())
    with pytest.raises(TypeError, match="k"):
        store_kv_cache(k.half(), k, cache, cache, slots)
    with pytest.raises(ValueError, match="v"):
        store_kv_cache(k, k[:, :1], cache, cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv_cache(k, k, cache, cache, slots[:2])
