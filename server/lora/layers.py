"""A LoRA-aware wrapper around any projection module, serving up to `max_loras` adapters in one batch.

Each wrapped projection holds its adapters' weights stacked in slots (the S-LoRA / punica layout):
rows `[slot * n * R + i * R, ... + r)` of `lora_a` hold sub-projection i's A (zero-padded to R =
max_lora_rank), and the same rows of `lora_b` hold its B (scaling folded in) in sub-projection i's output
columns. A fused projection (q/k/v or gate/up, n sub-projections) thus gets a block-diagonal B, so its
delta comes out already split to match the fused output.

One step computes, for all tokens at once (x: [T, in]):
    shrink  h = x @ A_stack[: S*n*R].T        [T, S*n*R]   (S = highest slot used this step + 1)
    select  h *= mask                        mask[t, c] = 1 when column c belongs to token t's slot
    expand  y += h @ B_stack[: S*n*R]         [T, out]
Two dense matmuls over the resident slots instead of a per-token gather: on CPU that is what BLAS does
best, and a row without an adapter gets an exact zero delta. On CUDA the same shrink/expand runs as the
Triton kernels in `kernels/lora.py` (per-token slot gather, no mask).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn


@dataclass
class LoRAStepState:
    """Per-step adapter metadata shared by every wrapped projection; set by LoRAManager.prepare()."""

    max_rank: int
    token_slots: Tensor | None = None  # [T] int64, slot of each token's adapter, -1 = base model
    num_slots: int = 0  # highest slot used this step + 1; 0 = no adapter in this step
    use_kernels: bool = False  # CUDA: Triton shrink/expand with the per-token slot index
    _masks: dict[int, Tensor] = field(default_factory=dict)

    def set(self, token_slots: Tensor | None, num_slots: int) -> None:
        self.token_slots, self.num_slots = token_slots, num_slots
        self._masks.clear()

    def mask(self, n: int, dtype: torch.dtype) -> Tensor:  # -> [T, num_slots * n * max_rank]
        m = self._masks.get(n)
        if m is None:
            assert self.token_slots is not None
            width = n * self.max_rank
            col_slot = torch.arange(self.num_slots * width, device=self.token_slots.device) // width
            m = (col_slot[None, :] == self.token_slots[:, None]).to(dtype)
            self._masks[n] = m
        return m


class LoRALinear(nn.Module):
    """Drop-in for a projection (nn.Linear, PackedLinear, a quantized Linear: any module with
    in_features/out_features returning [T, out_features]) that adds the per-token LoRA delta."""

    def __init__(
        self,
        base: nn.Module,
        sub_modules: Sequence[tuple[str, int]],  # (HF module name, out_features) in output order
        state: LoRAStepState,
        max_loras: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.base = base
        self.in_features: int = int(base.in_features)  # type: ignore[arg-type]
        self.out_features: int = int(base.out_features)  # type: ignore[arg-type]
        assert sum(o for _, o in sub_modules) == self.out_features
        self.sub_modules = tuple(sub_modules)
        self.n = len(sub_modules)
        self.state = state
        self.max_loras = max_loras
        rows = max_loras * self.n * state.max_rank
        self.lora_a = torch.zeros(rows, self.in_features, device=device, dtype=dtype)  # [L*n*R, in]
        self.lora_b = torch.zeros(rows, self.out_features, device=device, dtype=dtype)  # [L*n*R, out]

    def set_slot(self, slot: int, per_sub: Sequence[tuple[Tensor, Tensor] | None]) -> None:
        """Load one adapter into `slot`: per sub-module (a: [r, in], b: [out_i, r]) or None (no delta)."""
        big_r = self.state.max_rank
        base_row = slot * self.n * big_r
        self.lora_a[base_row : base_row + self.n * big_r].zero_()
        self.lora_b[base_row : base_row + self.n * big_r].zero_()
        col = 0
        for i, ((_, out_i), ab) in enumerate(zip(self.sub_modules, per_sub, strict=True)):
            if ab is not None:
                a, b = ab
                r = a.shape[0]
                row = base_row + i * big_r
                self.lora_a[row : row + r].copy_(a)
                self.lora_b[row : row + r, col : col + out_i].copy_(b.t())
            col += out_i

    def forward(self, x: Tensor) -> Tensor:  # x: [T, in_features] -> [T, out_features]
        y = self.base(x)
        st = self.state
        if st.num_slots == 0:
            return y
        if st.use_kernels:
            from kernels import lora_expand, lora_shrink

            assert st.token_slots is not None
            h = lora_shrink(x, self.lora_a, st.token_slots, self.n, st.max_rank)  # [T, n*R]
            return lora_expand(h, self.lora_b, st.token_slots, y, self.n, st.max_rank)
        width = st.num_slots * self.n * st.max_rank
        h = torch.nn.functional.linear(x, self.lora_a[:width])  # [T, S*n*R]
        h.mul_(st.mask(self.n, h.dtype))
        return y.addmm_(h, self.lora_b[:width])

    def extra_repr(self) -> str:
        names = "+".join(m for m, _ in self.sub_modules)
        return f"{names}, max_loras={self.max_loras}, max_rank={self.state.max_rank}"
