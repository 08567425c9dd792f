"""LoRA shrink/expand kernels against the torch reference and against the CPU masked-matmul path."""

from __future__ import annotations

import pytest
import torch
from kubeinfer_kernels import lora_expand, lora_shrink
from kubeinfer_kernels.reference import lora_expand_ref, lora_shrink_ref

TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
@pytest.mark.parametrize(
    ("n", "max_rank", "in_f", "out_f"), [(1, 8, 64, 48), (3, 16, 96, 160), (2, 4, 200, 130)]
)
def test_shrink_expand_match_reference(
    n: int, max_rank: int, in_f: int, out_f: int, dtype: torch.dtype, device: torch.device
) -> None:
    num_slots, num_tokens = 3, 7
    rows = num_slots * n * max_rank
    x = torch.randn(num_tokens, in_f).to(dtype).to(device)
    a = (torch.randn(rows, in_f) * 0.1).to(dtype).to(device)
    b = (torch.randn(rows, out_f) * 0.1).to(dtype).to(device)
    y = torch.randn(num_tokens, out_f).to(dtype).to(device)
    # mixed: every slot, and base-model rows (-1)
    slots = torch.tensor([0, -1, 2, 1, 1, -1, 0], dtype=torch.int64, device=device)
    h = lora_shrink(x, a, slots, n, max_rank)
    h_ref = lora_shrink_ref(x, a, slots, n, max_rank)
    torch.testing.assert_close(h, h_ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(h[1], torch.zeros_like(h[1]))
    y_ref = lora_expand_ref(h_ref, b, slots, y, n, max_rank)
    y_before = y.clone()
    out = lora_expand(h, b, slots, y, n, max_rank)
    assert out.data_ptr() == y.data_ptr()  # in place
    torch.testing.assert_close(y, y_ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(y[1], y_before[1]) and torch.equal(y[5], y_before[5])  # base rows untouched


def test_kernels_match_the_cpu_paths(device: torch.device) -> None:
    """The CUDA path (kernels) and both CPU paths of LoRALinear (dense with a slot mask, grouped by
    slot) agree."""
    from server.lora.layers import LoRALinear, LoRAStepState

    torch.manual_seed(1)
    base = torch.nn.Linear(32, 24 + 8 + 8).to(device)
    state = LoRAStepState(max_rank=4)
    lin = LoRALinear(base, [("q_proj", 24), ("k_proj", 8), ("v_proj", 8)], state, 2, device, torch.float32)
    for slot, r in ((0, 4), (1, 2)):
        subs = [(torch.randn(r, 32, device=device), torch.randn(o, r, device=device)) for o in (24, 8, 8)]
        subs[1] = None  # type: ignore[call-overload]  # k_proj without a delta
        lin.set_slot(slot, subs)
    x = torch.randn(5, 32, device=device)
    slots = [1, -1, 0, 0, 1]
    outs = []
    for use_kernels, dense_max in ((False, 1 << 30), (False, 0), (True, 0)):
        state.use_kernels, state.dense_max_tokens_per_slot = use_kernels, dense_max
        state.set(slots, torch.float32, device)
        assert state.plan is not None and state.plan.dense == (dense_max > 0)
        outs.append(lin(x))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[2], outs[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[0][1], base(x)[1])


def test_lora_launchers_reject_bad_arguments(device: torch.device) -> None:
    x = torch.randn(3, 16, device=device)
    a = torch.randn(2 * 8, 16, device=device)
    slots = torch.zeros(3, dtype=torch.int64, device=device)
    with pytest.raises(TypeError, match="token_slots"):
        lora_shrink(x, a, slots.int(), 1, 8)
    with pytest.raises(ValueError, match="multiple of n"):
        lora_shrink(x, a, slots, 3, 8)
    with pytest.raises(ValueError, match="lora_a"):
        lora_shrink(x, a[:, :8], slots, 1, 8)
    with pytest.raises(TypeError, match="lora_a"):
        lora_shrink(x, a.half(), slots, 1, 8)
    h = torch.zeros(3, 8, device=device)
    with pytest.raises(TypeError, match="h"):
        lora_expand(
            h.half(), torch.randn(16, 4, device=device), slots, torch.zeros(3, 4, device=device), 1, 8
        )
    with pytest.raises(ValueError, match="y"):
        lora_expand(
            h,
            torch.randn(16, 4, device=device),
            slots,
            torch.zeros(3, 4, device=device).t().contiguous().t(),
            1,
            8,
        )
