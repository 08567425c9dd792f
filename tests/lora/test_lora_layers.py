"""LoRALinear's CPU paths (dense over the step's slots, grouped by slot with and without a gather)
against a per-token plain-torch reference, and the step plan's choices."""

from __future__ import annotations

import pytest
import torch

from server.lora.layers import LoRALinear, LoRAStepPlan, LoRAStepState

SUBS = [("q_proj", 24), ("k_proj", 8), ("v_proj", 8)]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def layer() -> tuple[LoRALinear, LoRAStepState, dict[int, list]]:  # type: ignore[type-arg]
    torch.manual_seed(0)
    base = torch.nn.Linear(32, 40)
    state = LoRAStepState(max_rank=4)
    lin = LoRALinear(base, SUBS, state, 4, CPU, torch.float32)
    weights: dict[int, list] = {}  # type: ignore[type-arg]
    for slot, r in ((0, 4), (1, 2), (3, 3)):  # slot 2 stays empty: a hole in the used range
        subs = [(torch.randn(r, 32), torch.randn(o, r)) for _, o in SUBS]
        if slot == 1:
            subs[1] = None  # type: ignore[call-overload]  # k_proj without a delta
        lin.set_slot(slot, subs)
        weights[slot] = subs
    return lin, state, weights


def reference(lin: LoRALinear, weights: dict[int, list], x: torch.Tensor, slots: list[int]) -> torch.Tensor:  # type: ignore[type-arg]
    y = lin.base(x)
    for t, s in enumerate(slots):
        if s >= 0:
            parts = [
                torch.zeros(o) if ab is None else ab[1] @ (ab[0] @ x[t])
                for (_, o), ab in zip(SUBS, weights[s], strict=True)
            ]
            y[t] += torch.cat(parts)
    return y


@pytest.mark.parametrize(
    "slots",
    [[1, -1, 0, 0, 1], [3, 3, -1, 0, 0], [0] * 5, [-1, 3, -1, 3, 1], [0, 1, 3] * 10 + [-1] * 3, [-1, 3]],
    ids=["mixed", "grouped", "one-slot", "base-rows-between", "round-robin", "high-slot-only"],
)
@pytest.mark.parametrize("mode", ["dense", "segments"])
def test_cpu_paths_match_reference(layer, slots: list[int], mode: str) -> None:  # type: ignore[no-untyped-def]
    lin, state, weights = layer
    state.dense_max_tokens_per_slot = 1 << 30 if mode == "dense" else 0
    state.set(slots, torch.float32, CPU)
    assert state.plan is not None and state.plan.dense == (mode == "dense")
    x = torch.randn(len(slots), 32)
    with torch.no_grad():
        out, ref, base = lin(x), reference(lin, weights, x, slots), lin.base(x)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    for t, s in enumerate(slots):
        if s < 0:
            assert torch.equal(out[t], base[t])  # a base-model row: exactly the base projection


def test_plan_uses_only_the_step_slots_and_groups_once() -> None:
    assert LoRAStepPlan.build([-1, -1], 4, CPU, torch.float32) is None
    p = LoRAStepPlan.build([2, -1, 3, 2], 4, CPU, torch.float32, dense_max_tokens_per_slot=16)
    assert p is not None and p.dense and (p.lo, p.hi) == (2, 4) and p.mask is not None
    assert p.mask.shape == (4, 2, 4) and p.mask[1].sum() == 0
    g = LoRAStepPlan.build([2, 2, -1, 3], 4, CPU, torch.float32, dense_max_tokens_per_slot=0)
    assert g is not None and g.perm is None  # already contiguous: no gather
    assert [(s.slot, s.start, s.end) for s in g.segments] == [(2, 0, 2), (3, 3, 4)]
    r = LoRAStepPlan.build([3, 2, -1, 3, 2], 4, CPU, torch.float32, dense_max_tokens_per_slot=0)
    assert r is not None and r.perm is not None and r.perm.tolist() == [1, 4, 0, 3]
    assert [(s.slot, s.start, s.end) for s in r.segments] == [(2, 0, 2), (3, 2, 4)]


def test_resident_slot_holds_no_block_diagonal_zeros(layer) -> None:  # type: ignore[no-untyped-def]
    lin, _, _ = layer
    r = 4  # max rank: A is [n*R, in] per slot, each sub-projection's B only its own columns
    assert lin.slot_nbytes == (3 * r * 32 + r * (24 + 8 + 8)) * 4
