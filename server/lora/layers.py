"""A LoRA-aware wrapper around any projection module, serving up to `max_loras` adapters in one batch.

Weight layout (the S-LoRA / punica slots, R = max_lora_rank, n sub-projections of a fused projection):
    lora_a     [L * n * R, in]   slot-major: rows [s*n*R + i*R, ... + r) hold slot s's A of sub-projection i
    lora_b[i]  [L * R, out_i]    one stack per sub-projection: rows [s*R, s*R + r) hold slot s's B^T
                                 (scaling folded in), only sub-projection i's own output columns
Ranks below R are zero-padded (as vLLM pads to max_lora_rank). A fused q/k/v or gate/up projection thus
shrinks once for all its sub-projections and expands each one straight into its slice of the output,
with no block-diagonal zeros.

Per step the manager sets a `LoRAStepPlan` (shared by every wrapped projection) that picks one of:
  dense     (few tokens: decode steps) one shrink over the step's used slots [lo, hi) only,
            h = x @ A[lo:hi]^T [T, S*n*R], a per-token slot mask applied while reordering h sub-major,
            then per sub-projection y[:, cols_i] += h_i [T, S*R] @ B_i[lo:hi]. Three to five BLAS-sized
            ops per projection whatever the number of adapters (on CPU the op count dominates when T is
            small; the wasted products on other slots' columns cost less than a per-slot loop).
  segments  (many tokens: prefill) the step's adapter tokens grouped by slot (a permutation computed
            once per step; none when each slot's tokens are already contiguous), then per slot segment
            h = x_seg @ A_s^T and y_seg[:, cols_i] += h_i @ B_s,i: exactly the adapter's own products.
A row without an adapter gets an exact zero delta in both modes. On CUDA the same layout runs as the
Triton kernels in `kernels/lora.py` (per-token slot gather: one shrink, one expand per sub-projection).
Intermediates live in scratch buffers kept across steps (no allocation per projection call).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

# A step with at most this many adapter tokens per used slot runs the dense path (see module docstring).
# On a 2-core AVX2 EPYC with SmolLM2-135M's shapes and 4 rank-16 adapters (benchmarks/lora.py --micro and
# --decode-steps): at 16 decode rows dense and grouped cost the same single-threaded, dense is far ahead
# with 2 threads on a loaded machine (fewer ops, fewer OpenMP barriers); grouped wins from ~64 tokens.
DENSE_MAX_TOKENS_PER_SLOT = 16


@dataclass(frozen=True)
class LoRASegment:
    slot: int
    start: int  # rows [start, end) of x (segments mode without permutation) or of the gathered rows
    end: int


@dataclass
class LoRAStepPlan:
    """How the wrapped projections add this step's deltas; built once per step by `LoRAStepPlan.build`."""

    max_rank: int
    num_tokens: int
    token_slots: Tensor  # [T] int64, slot of each token's adapter, -1 = base model
    lo: int  # used slots are within [lo, hi)
    hi: int
    dense: bool
    mask: Tensor | None = None  # dense: [T, S, R] 1.0 where column (s, .) is token t's slot
    segments: tuple[LoRASegment, ...] = ()  # segments mode
    perm: Tensor | None = (
        None  # segments mode: [T_lora] int64 row of x of each gathered row; None = no gather
    )
    use_kernels: bool = False
    _work: dict[str, Tensor] = field(default_factory=dict)

    @staticmethod
    def build(
        slots: Sequence[int],  # per token, -1 = base model
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
        use_kernels: bool = False,
        dense_max_tokens_per_slot: int = DENSE_MAX_TOKENS_PER_SLOT,
    ) -> LoRAStepPlan | None:
        """None when no token uses an adapter (the wrappers then skip the delta entirely)."""
        used = sorted({s for s in slots if s >= 0})
        if not used:
            return None
        lo, hi = used[0], used[-1] + 1
        num_tokens = len(slots)
        token_slots = torch.tensor(slots, dtype=torch.int64, device=device)
        lora_tokens = sum(1 for s in slots if s >= 0)
        dense = not use_kernels and lora_tokens <= dense_max_tokens_per_slot * len(used)
        plan = LoRAStepPlan(max_rank, num_tokens, token_slots, lo, hi, dense, use_kernels=use_kernels)
        if use_kernels:
            return plan
        if dense:
            rel = token_slots - lo  # base rows become negative: no column matches them
            cols = torch.arange(hi - lo, device=device)
            plan.mask = (
                (rel[:, None] == cols[None, :]).to(dtype)[:, :, None].expand(-1, -1, max_rank).contiguous()
            )
            return plan
        runs: list[LoRASegment] = []
        for t, s in enumerate(slots):
            if s < 0:
                continue
            if runs and runs[-1].slot == s and runs[-1].end == t:
                runs[-1] = LoRASegment(s, runs[-1].start, t + 1)
            else:
                runs.append(LoRASegment(s, t, t + 1))
        if len(runs) == len(used):  # each slot's tokens already contiguous: index x directly
            plan.segments = tuple(runs)
            return plan
        order = sorted((t for t, s in enumerate(slots) if s >= 0), key=lambda t: slots[t])  # stable
        segs: list[LoRASegment] = []
        for i, t in enumerate(order):
            s = slots[t]
            if segs and segs[-1].slot == s:
                segs[-1] = LoRASegment(s, segs[-1].start, i + 1)
            else:
                segs.append(LoRASegment(s, i, i + 1))
        plan.segments = tuple(segs)
        plan.perm = torch.tensor(order, dtype=torch.int64, device=device)
        return plan

    def work(self, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """A scratch tensor of `shape` reused by every projection of this step (they run one at a time)."""
        numel = 1
        for d in shape:
            numel *= d
        buf = self._work.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype:
            buf = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._work[name] = buf
        return buf[:numel].view(shape)


@dataclass
class LoRAStepState:
    """Holds the current step's plan for every wrapped projection; set by LoRAManager.prepare()."""

    max_rank: int
    use_kernels: bool = False  # CUDA: Triton shrink/expand with the per-token slot index
    dense_max_tokens_per_slot: int = DENSE_MAX_TOKENS_PER_SLOT
    plan: LoRAStepPlan | None = None
    _work: dict[str, Tensor] = field(default_factory=dict)  # scratch buffers kept across steps

    def set(self, slots: Sequence[int] | None, dtype: torch.dtype, device: torch.device) -> None:
        """slots: per token (-1 = base model), or None for a step without adapters."""
        self.plan = (
            None
            if slots is None
            else LoRAStepPlan.build(
                slots, self.max_rank, device, dtype, self.use_kernels, self.dense_max_tokens_per_slot
            )
        )
        if self.plan is not None:
            self.plan._work = self._work


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
        big_r = state.max_rank
        self.cols: tuple[tuple[int, int], ...] = tuple(
            (sum(o for _, o in sub_modules[:i]), sum(o for _, o in sub_modules[: i + 1]))
            for i in range(self.n)
        )
        self.lora_a = torch.zeros(max_loras * self.n * big_r, self.in_features, device=device, dtype=dtype)
        self.lora_b = [torch.zeros(max_loras * big_r, o, device=device, dtype=dtype) for _, o in sub_modules]

    @property
    def slot_nbytes(self) -> int:
        """Bytes one slot takes in this projection."""
        return (self.lora_a.nbytes + sum(b.nbytes for b in self.lora_b)) // self.max_loras

    def set_slot(self, slot: int, per_sub: Sequence[tuple[Tensor, Tensor] | None]) -> None:
        """Load one adapter into `slot`: per sub-module (a: [r, in], b: [out_i, r]) or None (no delta)."""
        big_r = self.state.max_rank
        self.lora_a[slot * self.n * big_r : (slot + 1) * self.n * big_r].zero_()
        for i, ab in enumerate(per_sub):
            b_rows = self.lora_b[i][slot * big_r : (slot + 1) * big_r]
            b_rows.zero_()
            if ab is not None:
                a, b = ab
                r = a.shape[0]
                row = (slot * self.n + i) * big_r
                self.lora_a[row : row + r].copy_(a)
                b_rows[:r].copy_(b.t())

    def forward(self, x: Tensor) -> Tensor:  # x: [T, in_features] -> [T, out_features]
        y = self.base(x)
        p = self.state.plan
        if p is None:
            return y
        if p.use_kernels:
            return self._kernels(x, y, p)
        if p.dense:
            return self._dense(x, y, p)
        return self._segments(x, y, p)

    def _kernels(self, x: Tensor, y: Tensor, p: LoRAStepPlan) -> Tensor:
        from kubeinfer_kernels import lora_expand, lora_shrink

        big_r = p.max_rank
        h = lora_shrink(x, self.lora_a, p.token_slots, self.n, big_r)  # [T, n*R] fp32
        for i, (c0, c1) in enumerate(self.cols):
            h_i = h[:, i * big_r : (i + 1) * big_r].contiguous() if self.n > 1 else h
            lora_expand(h_i, self.lora_b[i], p.token_slots, y[:, c0:c1], 1, big_r)
        return y

    def _dense(self, x: Tensor, y: Tensor, p: LoRAStepPlan) -> Tensor:
        t, n, big_r, s = x.shape[0], self.n, p.max_rank, p.hi - p.lo
        assert p.mask is not None
        a = self.lora_a[p.lo * n * big_r : p.hi * n * big_r]  # [S*n*R, in]
        h = torch.mm(x, a.t(), out=p.work("h", (t, s * n * big_r), x))  # [T, S*n*R]
        # mask other slots' columns and reorder sub-major: hp[t, i, s, j] = h[t, s, i, j] * mask[t, s, j]
        hp = torch.mul(
            h.view(t, s, n, big_r).transpose(1, 2),
            p.mask.view(t, 1, s, big_r),
            out=p.work("hp", (t, n, s, big_r), x),
        )
        for i, (c0, c1) in enumerate(self.cols):
            y[:, c0:c1].addmm_(hp[:, i].reshape(t, s * big_r), self.lora_b[i][p.lo * big_r : p.hi * big_r])
        return y

    def _segments(self, x: Tensor, y: Tensor, p: LoRAStepPlan) -> Tensor:
        n, big_r = self.n, p.max_rank
        if p.perm is None:
            xs, out = x, y  # each slot's rows already contiguous in x: add straight into y
        else:
            t_lora = p.perm.shape[0]
            xs = torch.index_select(x, 0, p.perm, out=p.work("xs", (t_lora, self.in_features), x))
            out = p.work("d", (t_lora, self.out_features), x)
        for seg in p.segments:
            a = self.lora_a[seg.slot * n * big_r : (seg.slot + 1) * n * big_r]  # [n*R, in]
            rows = seg.end - seg.start
            h = torch.mm(
                xs[seg.start : seg.end], a.t(), out=p.work("h", (rows, n * big_r), x)
            )  # [t_seg, n*R]
            for i, (c0, c1) in enumerate(self.cols):
                b = self.lora_b[i][seg.slot * big_r : (seg.slot + 1) * big_r]  # [R, out_i]
                dst = out[seg.start : seg.end, c0:c1]
                if p.perm is None:
                    dst.addmm_(h[:, i * big_r : (i + 1) * big_r], b)
                else:
                    torch.mm(h[:, i * big_r : (i + 1) * big_r], b, out=dst)
        if p.perm is not None:
            y.index_add_(0, p.perm, out)
        return y

    def extra_repr(self) -> str:
        names = "+".join(m for m, _ in self.sub_modules)
        return f"{names}, max_loras={self.max_loras}, max_rank={self.state.max_rank}"
