"""Experts under tensor parallelism (vLLM's FusedMoE with TP, Megatron's MLP split per expert): each
rank keeps every expert with its slice [r * I / N, (r + 1) * I / N) of the intermediate dimension:
the gate and up rows of w13 (column-parallel), the same columns of w2 (row-parallel), so each rank's
output is a partial sum and one all-reduce per block completes it. The router is replicated (every rank
routes alike); the down bias is added on rank 0 only; Qwen2-MoE's shared expert splits the same way
(its sigmoid gate is one scalar per token, replicated, so it scales each partial sum alike).

MXFP4 experts (gpt-oss) stay packed: w13's rows are independent (one scale per 32 values of a row), so
any row split is exact; w2 splits along its packed input dimension, which is exact only where a rank's
slice starts and ends on a 32-value block boundary, so (I / N) % 32 == 0 is required and anything else
refused. `--quantize int8` experts (per-output-channel int8 BlockQuantExperts) split like dense ones:
w13's rows with their scales, w2's columns with every row's full scale, so each partial product is
exact. Other block-quantized experts (GGUF's 32-value blocks) are refused.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor, nn

from server.distributed.parallel_state import TensorParallelConfigError
from server.models.moe import (
    BlockQuantExperts,
    ExpertGemms,
    ExpertWeights,
    FusedMoE,
    MoEConfig,
    Mxfp4Experts,
    Mxfp4Tensor,
    SharedExpertWeights,
    SparseMoeBlock,
)
from server.models.moe.mxfp4 import MXFP4_BLOCK
from server.quant.block_linear import BlockQuantLinear
from server.quant.cpu_qlinear import from_int8


def validate_moe_split(cfg: MoEConfig, world_size: int, mxfp4: bool = False) -> None:
    """Raises TensorParallelConfigError when N does not divide the expert (or shared expert)
    intermediate size, or (`mxfp4`) a rank's slice of the packed down projection would cut a block."""
    inter, shared = cfg.intermediate_size, cfg.shared_expert_intermediate_size
    for name, size in (("intermediate_size", inter), ("shared_expert_intermediate_size", shared)):
        if size % world_size:
            raise TensorParallelConfigError(
                f"tensor_parallel_size {world_size} must divide the experts' {name} ({size})"
            )
    if mxfp4 and (inter // world_size) % MXFP4_BLOCK:
        raise TensorParallelConfigError(
            f"MXFP4 experts split along their packed blocks of {MXFP4_BLOCK}: the experts' intermediate "
            f"size {inter} over {world_size} ranks gives {inter // world_size} per rank, not a multiple "
            f"of {MXFP4_BLOCK}; use a dense (bf16) checkpoint or another tensor_parallel_size"
        )


def _rows13(t: Tensor, inter: int, lo: int, hi: int) -> Tensor:
    """[E, 2I, ...] gate rows then up rows -> [E, 2 (hi - lo), ...] this rank's gate and up rows."""
    return torch.cat([t[:, lo:hi], t[:, inter + lo : inter + hi]], 1).contiguous()


def shard_moe(
    cfg: MoEConfig, w: ExpertWeights, rank: int, world_size: int
) -> tuple[MoEConfig, ExpertWeights]:
    """Rank `rank`'s config and weights (w13 / w2 None stay None: packed experts are cut by
    `shard_mxfp4_experts`). Raises TensorParallelConfigError when the sizes do not split."""
    if not 0 <= rank < world_size:
        raise TensorParallelConfigError(f"rank {rank} not in [0, {world_size})")
    validate_moe_split(cfg, world_size)
    inter, shared = cfg.intermediate_size, cfg.shared_expert_intermediate_size
    part = inter // world_size
    lo, hi = rank * part, (rank + 1) * part
    s = None
    if w.shared is not None:
        sp = shared // world_size
        s_lo, s_hi = rank * sp, (rank + 1) * sp
        w13, w2 = w.shared.w13, w.shared.w2  # None: held quantized, cut by shard_int8_shared_expert
        s = SharedExpertWeights(
            None if w13 is None else torch.cat([w13[s_lo:s_hi], w13[shared + s_lo : shared + s_hi]]),
            None if w2 is None else w2[:, s_lo:s_hi].contiguous(),
            w.shared.gate,
        )
    out = ExpertWeights(
        router=w.router,
        router_bias=w.router_bias,
        w13=None if w.w13 is None else _rows13(w.w13, inter, lo, hi),  # [E, 2I/N, H]
        w2=None if w.w2 is None else w.w2[:, :, lo:hi].contiguous(),  # [E, H, I/N]
        b13=None if w.b13 is None else _rows13(w.b13, inter, lo, hi),  # [E, 2I/N]
        b2=None if w.b2 is None else (w.b2 if rank == 0 else torch.zeros_like(w.b2)),
        shared=s,
    )
    local = dataclasses.replace(
        cfg, intermediate_size=part, shared_expert_intermediate_size=shared // world_size
    )
    return local, out


def shard_mxfp4_experts(experts: Mxfp4Experts, cfg: MoEConfig, rank: int, world_size: int) -> Mxfp4Experts:
    """Rank `rank`'s packed experts: w13 rows [lo, hi) and [I + lo, I + hi), w2's blocks covering input
    columns [lo, hi), b13 alike, b2 on rank 0 only. Raises TensorParallelConfigError (validate_moe_split)."""
    validate_moe_split(cfg, world_size, mxfp4=True)
    inter = cfg.intermediate_size
    part = inter // world_size
    lo, hi = rank * part, (rank + 1) * part
    g_lo, g_hi = lo // MXFP4_BLOCK, hi // MXFP4_BLOCK
    w13 = Mxfp4Tensor(_rows13(experts.w13.blocks, inter, lo, hi), _rows13(experts.w13.scales, inter, lo, hi))
    w2 = Mxfp4Tensor(
        experts.w2.blocks[:, :, g_lo:g_hi].contiguous(),  # [E, H, I / N / 32, 16]
        experts.w2.scales[:, :, g_lo:g_hi].contiguous(),  # [E, H, I / N / 32]
    )
    b13 = None if experts.b13 is None else _rows13(experts.b13, inter, lo, hi)
    b2 = experts.b2 if experts.b2 is None or rank == 0 else torch.zeros_like(experts.b2)
    return Mxfp4Experts(w13, w2, b13, b2)


def shard_int8_experts(
    experts: BlockQuantExperts, cfg: MoEConfig, rank: int, world_size: int
) -> BlockQuantExperts:
    """Rank `rank`'s per-channel int8 experts: w13 rows [lo, hi) and [I + lo, I + hi) with their scales,
    w2 columns [lo, hi) with each row's whole-row scale, b13 alike, b2 on rank 0 only. Raises
    TensorParallelConfigError for other formats or sizes that do not split."""
    formats = {w.fmt for w in experts.w13 + experts.w2}
    if formats != {"int8"}:
        raise TensorParallelConfigError(
            f"tensor parallelism shards dense, int8 and MXFP4 experts only; these are {sorted(formats)}"
        )
    validate_moe_split(cfg, world_size)
    inter = cfg.intermediate_size
    part = inter // world_size
    lo, hi = rank * part, (rank + 1) * part
    rows = torch.cat([torch.arange(lo, hi), torch.arange(inter + lo, inter + hi)])
    w2 = [from_int8(w.q[:, lo:hi].contiguous(), w.scales[:, 0]) for w in experts.w2]  # [H, I / N] each
    return BlockQuantExperts(
        [w.select_rows(rows) for w in experts.w13],  # [2I / N, H] each
        w2,
        None if experts.b13 is None else _rows13(experts.b13, inter, lo, hi),
        experts.b2 if experts.b2 is None or rank == 0 else torch.zeros_like(experts.b2),
        experts.kernel,
        experts.compute,
    )


def shard_int8_shared_expert(
    gate_up: BlockQuantLinear,  # [2S, H] per-channel int8, gate rows then up rows
    down: BlockQuantLinear,  # [H, S] per-channel int8
    rank: int,
    world_size: int,
) -> tuple[BlockQuantLinear, BlockQuantLinear]:  # [2S / N, H], [H, S / N]
    """Rank `rank`'s slice of a shared expert held as int8 projections, cut as shard_moe cuts a dense
    one: gate and up rows [lo, hi), down's columns [lo, hi) with each row's whole-row scale. Raises
    TensorParallelConfigError for another format or a size that does not split."""
    formats = {gate_up.weight_q.fmt, down.weight_q.fmt}
    if formats != {"int8"}:
        raise TensorParallelConfigError(
            f"tensor parallelism shards a dense or int8 shared expert only; this one is {sorted(formats)}"
        )
    shared = down.in_features
    if shared % world_size:
        raise TensorParallelConfigError(
            f"tensor_parallel_size {world_size} must divide the experts' shared_expert_intermediate_size "
            f"({shared})"
        )
    part = shared // world_size
    lo, hi = rank * part, (rank + 1) * part
    rows = torch.cat([torch.arange(lo, hi), torch.arange(shared + lo, shared + hi)])
    w2 = down.weight_q
    # the whole one's kernel choice, None included (TP's rank_loading: the torch reference, as for the rest)
    return (
        BlockQuantLinear(gate_up.weight_q.select_rows(rows), kernel=gate_up.kernel),
        BlockQuantLinear(from_int8(w2.q[:, lo:hi].contiguous(), w2.scales[:, 0]), kernel=down.kernel),
    )


def check_block_shardable(block: nn.Module, world_size: int, what: str) -> None:
    """Raises TensorParallelConfigError unless `block` is a SparseMoeBlock with dense, MXFP4 or
    per-channel int8 experts (and a dense or int8 shared expert) whose sizes split over `world_size`
    ranks."""
    if not isinstance(block, SparseMoeBlock):
        raise TensorParallelConfigError(
            f"{what}: expected a mixture-of-experts block, got {type(block).__name__}"
        )
    experts = block.experts
    int8 = isinstance(experts, BlockQuantExperts) and {w.fmt for w in experts.w13 + experts.w2} == {"int8"}
    if experts is not None and not isinstance(experts, Mxfp4Experts) and not int8:
        raise TensorParallelConfigError(
            f"tensor parallelism shards dense, int8 and MXFP4 experts only for now; {what}'s experts are "
            f"{type(experts).__name__}"
        )
    shared = [block.shared_gate_up, block.shared_down]
    if shared[0] is not None and not all(
        isinstance(m, BlockQuantLinear) and m.weight_q.fmt == "int8" for m in shared
    ):
        raise TensorParallelConfigError(
            f"tensor parallelism shards a dense or int8 shared expert only; {what}'s is held in "
            f"{sorted({getattr(getattr(m, 'weight_q', None), 'fmt', type(m).__name__) for m in shared})}"
        )
    validate_moe_split(block.cfg, world_size, mxfp4=isinstance(experts, Mxfp4Experts))


class TensorParallelSparseMoeBlock(SparseMoeBlock):
    """A rank's SparseMoeBlock over its shard (`from_block`); forward(x [..., H]) -> [..., H], the sum
    over ranks (one all-reduce on the default process group, in x's dtype)."""

    @classmethod
    def from_block(cls, block: SparseMoeBlock, rank: int, world_size: int) -> TensorParallelSparseMoeBlock:
        """Rank `rank`'s block cut from the whole `block` (which it does not modify). Raises
        TensorParallelConfigError (check_block_shardable)."""
        check_block_shardable(block, world_size, "MoE block")
        local_cfg, w = shard_moe(block.cfg, block.expert_weights(), rank, world_size)
        out = cls(local_cfg, device="meta")
        for name in ("router", "router_bias", "w13", "w2", "b13", "b2"):
            t = getattr(w, name)
            setattr(out, name, None if t is None else nn.Parameter(t, requires_grad=False))
        if w.shared is not None:
            out.shared_gate = nn.Parameter(w.shared.gate, requires_grad=False)
            if w.shared.w13 is not None and w.shared.w2 is not None:
                out.shared_w13 = nn.Parameter(w.shared.w13, requires_grad=False)
                out.shared_w2 = nn.Parameter(w.shared.w2, requires_grad=False)
            else:
                gate_up, down = block.shared_gate_up, block.shared_down
                assert isinstance(gate_up, BlockQuantLinear) and isinstance(down, BlockQuantLinear)
                out.set_shared_expert(*shard_int8_shared_expert(gate_up, down, rank, world_size))
        if isinstance(block.experts, Mxfp4Experts):
            out.set_experts(shard_mxfp4_experts(block.experts, block.cfg, rank, world_size))
        elif isinstance(block.experts, BlockQuantExperts):
            out.set_experts(shard_int8_experts(block.experts, block.cfg, rank, world_size))
        return out

    def forward(self, x: Tensor) -> Tensor:  # x: [..., hidden] -> the same shape, summed over ranks
        y = super().forward(x)
        dist.all_reduce(y)
        return y


class TensorParallelMoE(nn.Module):
    """A rank's FusedMoE over its shard; forward(x [T, H]) -> [T, H], the sum over ranks (one all-reduce
    on the default process group)."""

    def __init__(
        self,
        cfg: MoEConfig,
        weights: ExpertWeights,
        rank: int,
        world_size: int,
        gemm_dtype: torch.dtype | None = None,
        experts: ExpertGemms | None = None,
    ) -> None:
        super().__init__()
        local_cfg, local = shard_moe(cfg, weights, rank, world_size)
        self.moe = FusedMoE(local_cfg, local, experts=experts, gemm_dtype=gemm_dtype)

    def forward(self, x: Tensor) -> Tensor:  # x: [T, H] -> [T, H]
        y = self.moe(x)
        dist.all_reduce(y)
        return y
