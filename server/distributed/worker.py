"""Ranks 1..N-1: build the same model shard as rank 0, then run every broadcast step's forward pass.

A worker never samples: its `ModelRunner` has `is_driver = False`, so it takes part in every collective
of a step (embedding and row-parallel all-reduces, logits all-gather) and returns. The loop ends on the
stop message, or with an exception when rank 0 goes away or a collective times out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from server.attention import make_attention_backend
from server.config import EngineConfig
from server.core.outputs import SchedulerOutput
from server.distributed.parallel_state import (
    ParallelState,
    destroy_parallel_state,
    init_parallel_state,
    rank_device,
)
from server.distributed.sharding import shard_model
from server.models.loader import load_model, read_hf_config, resolve_dtype, resolve_model
from server.models.serving_weights import prepare_for_serving
from server.worker.model_runner import ModelRunner, kv_bytes_per_block

log = logging.getLogger(__name__)

READY = "ready"


@dataclass(frozen=True)
class StopWorkers:
    """Broadcast by rank 0 on shutdown in place of a SchedulerOutput."""


def build_shard_runner(config: EngineConfig, rank: int, world_size: int) -> tuple[ModelRunner, int]:
    """Loads the model, keeps this rank's shard and builds its runner with the same number of KV blocks
    rank 0 computes (the same formula over the same per-rank shape). Returns (runner, num_blocks)."""
    device = rank_device(config.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    source = resolve_model(config.model.model, config.model.cache_dir)
    dtype = resolve_dtype(config.model.dtype, device)
    max_pos = int(read_hf_config(source.folder).get("max_position_embeddings", 2048))
    max_model_len = config.model.max_model_len or min(max_pos, 8192)
    loaded = load_model(source.folder, dtype, device, max_model_len, config.model.quantize)
    shard_model(loaded.model, rank, world_size)
    if config.model.optimize_weights:
        prepare_for_serving(loaded.model, device, dtype)
    block_size = config.cache.block_size
    backend = make_attention_backend(
        config.attention_backend, block_size, device.type, config.model.cache_dir
    )
    num_blocks = config.cache.num_kv_blocks or max(
        1, config.cache.kv_cache_memory_bytes // kv_bytes_per_block(loaded.model, block_size, dtype)
    )
    runner = ModelRunner(loaded.model, backend, num_blocks, block_size, dtype, device)
    runner.is_driver = False
    return runner, num_blocks


def worker_main(state: ParallelState, config: EngineConfig) -> None:
    """Entry point of a spawned worker process (rank >= 1)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{state.rank} %(levelname)s %(message)s")
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    torch.manual_seed(config.seed)
    init_parallel_state(state)
    try:
        runner: ModelRunner | None = None
        try:
            runner, num_blocks = build_shard_runner(config, state.rank, state.world_size)
            status: object = (READY, num_blocks)
        except Exception as e:
            log.exception("rank %d could not build its shard", state.rank)
            status = f"rank {state.rank}: {type(e).__name__}: {e}"
        statuses: list[object] = [None] * state.world_size
        dist.all_gather_object(statuses, status)
        if runner is None or any(not isinstance(s, tuple) for s in statuses):
            raise SystemExit(1)
        while True:
            box: list[object] = [None]
            dist.broadcast_object_list(box, src=0)
            msg = box[0]
            if isinstance(msg, StopWorkers):
                return
            assert isinstance(msg, SchedulerOutput)
            runner.execute(msg)
    finally:
        destroy_parallel_state()
