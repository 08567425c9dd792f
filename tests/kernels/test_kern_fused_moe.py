"""fused_moe (grouped expert GEMMs over pairs sorted by expert) against its dense torch twin."""

from __future__ import annotations

import pytest
import torch
from kubeinfer_kernels import fused_moe, moe_align_block_size
from kubeinfer_kernels.reference import fused_moe_ref

E, H, INTER = 4, 32, 16
TOL: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def test_align_pads_each_experts_run_to_the_block() -> None:
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], dtype=torch.int32)
    sorted_ids, tiles = moe_align_block_size(ids, 4, 4)
    pad = 6  # T * top_k
    # expert 0: pairs 1, 4; expert 1: none; expert 2: pairs 0, 2, 5; expert 3: pair 3.
    assert sorted_ids.tolist() == [1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad]
    assert tiles.tolist() == [0, 2, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("activation", "bias"), [("silu", False), ("swigluoai", True)])
@pytest.mark.parametrize("tokens", [1, 11])
def test_fused_moe_matches_reference(
    device: torch.device, dtype: torch.dtype, activation: str, bias: bool, tokens: int
) -> None:
    top_k = 2
    x = torch.randn(tokens, H, device=device).to(dtype)
    w13 = (torch.randn(E, 2 * INTER, H, device=device) * 0.3).to(dtype)
    w2 = (torch.randn(E, H, INTER, device=device) * 0.3).to(dtype)
    logits = torch.randn(tokens, E, device=device)
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, -1)
    b13 = torch.randn(E, 2 * INTER, device=device) if bias else None
    b2 = torch.randn(E, H, device=device) if bias else None
    got = fused_moe(x, w13, w2, weights, ids.to(torch.int32), activation, b13, b2)
    ref = fused_moe_ref(x, w13, w2, weights, ids, activation, b13, b2)
    assert got.dtype == dtype and got.shape == (tokens, H)
    assert (got.float() - ref).abs().max() <= TOL[dtype] * ref.abs().max().clamp_min(1.0)


def test_fused_moe_checks_its_arguments(device: torch.device) -> None:
    x = torch.randn(3, H, device=device)
    w13 = torch.randn(E, 2 * INTER, H, device=device)
    w2 = torch.randn(E, H, INTER, device=device)
    w = torch.rand(3, 2, device=device)
    ids = torch.zeros(3, 2, dtype=torch.int32, device=device)
    empty = torch.zeros(0, 2, dtype=torch.int32, device=device)
    assert fused_moe(x[:0], w13, w2, w[:0], empty).shape == (0, H)
    with pytest.raises(ValueError, match="w2"):
        fused_moe(x, w13, w2[:, :, :-1], w, ids)
    with pytest.raises(TypeError, match="topk_ids"):
        fused_moe(x, w13, w2, w, ids.long())
    with pytest.raises(TypeError, match="w13"):
        fused_moe(x, w13.half(), w2, w, ids)
    with pytest.raises(ValueError, match="activation"):
        fused_moe(x, w13, w2, w, ids, activation="gelu")
    with pytest.raises(ValueError, match="b13"):
        fused_moe(x, w13, w2, w, ids, b13=torch.zeros(E, INTER, device=device))
