"""Experts split over 2 gloo ranks (server/distributed/moe_sharding.py) sum to the unsharded block."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hf_blocks import PREFIX, H, checkpoint_tensors, hf_block

from server.distributed.moe_sharding import TensorParallelMoE, shard_moe
from server.distributed.sharding import TensorParallelConfigError
from server.models.moe import FusedMoE, MoEConfig, load_expert_weights

KINDS = ("qwen2_moe", "gpt_oss")  # the shared expert; biases and the clamped SwiGLU
WORLD = 2


def _block(kind: str) -> tuple[MoEConfig, FusedMoE]:
    block, hf_cfg = hf_block(kind)
    cfg = MoEConfig.from_hf_config(hf_cfg)
    return cfg, FusedMoE(
        cfg, load_expert_weights(checkpoint_tensors(kind, block), PREFIX, cfg), gemm_dtype=torch.float32
    )


def _rank(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        x = torch.load(Path(out_dir) / "x.pt")
        for kind in KINDS:
            # The blocks come pickled from the parent: no transformers import in the children.
            cfg, weights = torch.load(Path(out_dir) / f"{kind}.pt", weights_only=False)
            tp = TensorParallelMoE(cfg, weights, rank, WORLD, gemm_dtype=torch.float32)
            with torch.no_grad():
                torch.save(tp(x), Path(out_dir) / f"{kind}-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes importing torch: ~15 s alone, a minute on a loaded machine
def test_two_gloo_ranks_sum_to_the_full_block() -> None:
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(5))
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(x, Path(tmp) / "x.pt")
        blocks = {kind: _block(kind) for kind in KINDS}
        for kind, (cfg, full) in blocks.items():
            torch.save((cfg, full.weights), Path(tmp) / f"{kind}.pt")
        mp.spawn(_rank, args=(str(Path(tmp) / "init"), tmp), nprocs=WORLD, join=True)
        for kind, (_, full) in blocks.items():
            with torch.no_grad():
                want = full(x)
            for rank in range(WORLD):
                got = torch.load(Path(tmp) / f"{kind}-{rank}.pt")
                torch.testing.assert_close(got, want, rtol=0, atol=2e-5 * want.abs().max().item())


def test_shard_keeps_each_experts_slice_and_refuses_uneven_splits() -> None:
    cfg, full = _block("gpt_oss")
    local_cfg, w = shard_moe(cfg, full.weights, 1, 2)
    i = cfg.intermediate_size
    assert full.weights.w13 is not None and w.w13 is not None and w.b2 is not None
    assert local_cfg.intermediate_size == i // 2
    assert torch.equal(w.w13[:, : i // 2], full.weights.w13[:, i // 2 : i])  # gate rows of rank 1
    assert torch.equal(w.w13[:, i // 2 :], full.weights.w13[:, i + i // 2 :])  # its up rows
    assert not w.b2.any()  # the down bias is added on rank 0 only
    with pytest.raises(TensorParallelConfigError, match="intermediate_size"):
        shard_moe(cfg, full.weights, 0, 3)
