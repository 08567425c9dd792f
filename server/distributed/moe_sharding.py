"""Experts under tensor parallelism (vLLM's FusedMoE with TP, Megatron's MLP split per expert): each
rank keeps every expert with its slice [r * I / N, (r + 1) * I / N) of the intermediate dimension:
the gate and up rows of w13 (column-parallel), the same columns of w2 (row-parallel), so each rank's
output is a partial sum and one all-reduce per block completes it. The router is replicated (every rank
routes alike); the down bias is added on rank 0 only; Qwen2-MoE's shared expert splits the same way
(its sigmoid gate is one scalar per token, replicated, so it scales each partial sum alike).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor, nn

from server.distributed.sharding import TensorParallelConfigError
from server.models.moe import ExpertGemms, ExpertWeights, FusedMoE, MoEConfig, SharedExpertWeights


def shard_moe(
    cfg: MoEConfig, w: ExpertWeights, rank: int, world_size: int
) -> tuple[MoEConfig, ExpertWeights]:
    """Rank `rank`'s config and weights. Raises TensorParallelConfigError when N does not divide the
    expert (or shared expert) intermediate size; quantized experts are not sharded here (dense only)."""
    if not 0 <= rank < world_size:
        raise TensorParallelConfigError(f"rank {rank} not in [0, {world_size})")
    inter, shared = cfg.intermediate_size, cfg.shared_expert_intermediate_size
    for name, size in (("intermediate_size", inter), ("shared_expert_intermediate_size", shared)):
        if size % world_size:
            raise TensorParallelConfigError(
                f"{name} ({size}) is not divisible by tensor_parallel_size ({world_size})"
            )
    if w.w13 is None or w.w2 is None:
        raise TensorParallelConfigError("only dense experts are sharded (quantized experts: not yet)")
    part = inter // world_size
    lo, hi = rank * part, (rank + 1) * part
    s = None
    if w.shared is not None:
        sp = shared // world_size
        s_lo, s_hi = rank * sp, (rank + 1) * sp
        s = SharedExpertWeights(
            torch.cat([w.shared.w13[s_lo:s_hi], w.shared.w13[shared + s_lo : shared + s_hi]]),
            w.shared.w2[:, s_lo:s_hi].contiguous(),
            w.shared.gate,
        )
    out = ExpertWeights(
        router=w.router,
        router_bias=w.router_bias,
        w13=torch.cat([w.w13[:, lo:hi], w.w13[:, inter + lo : inter + hi]], 1).contiguous(),  # [E, 2I/N, H]
        w2=w.w2[:, :, lo:hi].contiguous(),  # [E, H, I/N]
        b13=None if w.b13 is None else torch.cat([w.b13[:, lo:hi], w.b13[:, inter + lo : inter + hi]], 1),
        b2=None if w.b2 is None else (w.b2 if rank == 0 else torch.zeros_like(w.b2)),
        shared=s,
    )
    local = dataclasses.replace(
        cfg, intermediate_size=part, shared_expert_intermediate_size=shared // world_size
    )
    return local, out


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
