"""Ranks 1..N-1: build this rank's model shard, then run every broadcast step's forward pass.

A worker never samples: its `ModelRunner` has `is_driver = False`, so it takes part in every collective
of a step (embedding and row-parallel all-reduces, logits all-gather) and returns. The loop ends on the
stop message, or with an exception when rank 0 goes away or a collective times out.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.process
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from server.attention import make_attention_backend
from server.attention.kv_cache_dtype import check_int8_kv_cache, resolve_kv_cache_dtype
from server.config import EngineConfig
from server.core.kv_groups import KVLayout, plan_engine_kv
from server.core.outputs import SchedulerOutput
from server.distributed.parallel_state import (
    ParallelState,
    Status,
    TensorParallelError,
    destroy_parallel_state,
    exchange_status,
    init_parallel_state,
    rank_device,
)
from server.distributed.sharding import rank_loading, rank_loading_slicer, shard_model
from server.models.loader import load_model, read_hf_config, resolve_dtype, resolve_model
from server.models.serving_weights import prepare_for_serving
from server.worker.model_runner import ModelRunner, kv_bytes_per_block

log = logging.getLogger(__name__)

READY = "ready"


@dataclass(frozen=True)
class StopWorkers:
    """Broadcast by rank 0 on shutdown in place of a SchedulerOutput."""


@dataclass(frozen=True)
class Heartbeat:
    """Broadcast by rank 0 while idle in place of a SchedulerOutput; followed by one all-reduce."""


def spawn_local_workers(
    first: ParallelState, config: EngineConfig
) -> list[multiprocessing.process.BaseProcess]:
    """Starts this node's other ranks (first.rank + 1 .. + ranks_per_node - 1) as spawned processes
    (a fresh interpreter each, as CUDA requires); `first` is the rank of the calling process."""
    ctx = mp.get_context("spawn")
    procs: list[multiprocessing.process.BaseProcess] = []
    for local in range(1, config.parallel.ranks_per_node):
        state = dataclasses.replace(first, rank=first.rank + local, local_rank=first.local_rank + local)
        p = ctx.Process(
            target=spawned_worker_main, args=(state, config), name=f"tp-worker-{state.rank}", daemon=True
        )
        p.start()
        procs.append(p)
    return procs


def ready_status(layout: KVLayout) -> Status:
    """What a rank publishes once its shard is built: READY and its KV groups' block counts, which every
    rank must share (one scheduler's block ids index every rank's caches)."""
    return (READY, [g.num_blocks for g in layout.groups])


def build_shard_runner(config: EngineConfig, state: ParallelState) -> ModelRunner:
    """Loads the model, keeps this rank's shard and builds its runner with the KV cache rank 0 plans
    (`kv_groups.plan_engine_kv` over the same per-rank shapes: block count, and the groups of a model
    that interleaves sliding-window layers with global ones). The runner's
    `layout` is what this rank reports (`ready_status`)."""
    device = rank_device(config.device, state.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    source = resolve_model(config.model.model, config.model.cache_dir)
    dtype = resolve_dtype(config.model.dtype, device)
    max_pos = int(read_hf_config(source.folder).get("max_position_embeddings", 2048))
    max_model_len = config.model.max_model_len or min(max_pos, 8192)
    slicer = rank_loading_slicer(source.folder, config.model.quantize, state.rank, state.world_size)
    with rank_loading(state.world_size):
        loaded = load_model(source.folder, dtype, device, max_model_len, config.model.quantize, slicer)
    shard_model(loaded.model, state.rank, state.world_size)
    if config.model.optimize_weights:
        prepare_for_serving(loaded.model, device, dtype, config.model.cache_dir)
    block_size = config.cache.block_size
    backend = make_attention_backend(
        config.attention_backend, block_size, device.type, config.model.cache_dir
    )
    # the same cache dtype as rank 0's (engine.py): tensor parallelism loads dense weights (no GGUF)
    kv_dtype = resolve_kv_cache_dtype(config.cache.cache_dtype, dtype, dtype, device.type)
    check_int8_kv_cache(kv_dtype, getattr(backend, "decode_kernel", None), loaded.model.config.head_dim)
    plan = plan_engine_kv(
        [spec.sliding_window for spec in loaded.arch.layers],
        kv_bytes_per_block(loaded.model, block_size, kv_dtype),
        config.cache.num_kv_blocks,
        config.cache.kv_cache_memory_bytes,
        block_size,
        config.max_num_seqs,
        config.max_num_batched_tokens,
        max_model_len,
    )
    runner = ModelRunner(
        loaded.model, backend, plan.num_blocks, block_size, kv_dtype, device, layout=plan.layout
    )
    runner.is_driver = False
    return runner


def worker_main(
    state: ParallelState, config: EngineConfig, on_ready: Callable[[], None] | None = None
) -> None:
    """A rank >= 1: join, build the shard, report, then run every broadcast step until rank 0 says stop
    (returns) or goes away (raises). `on_ready` is called once every rank has reported success."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    torch.manual_seed(config.seed)
    init_parallel_state(state)
    try:
        runner: ModelRunner | None = None
        try:
            runner = build_shard_runner(config, state)
            assert runner.layout is not None
            status: Status = ready_status(runner.layout)
        except Exception as e:
            log.exception("rank %d could not build its shard", state.rank)
            status = f"rank {state.rank}: {type(e).__name__}: {e}"
        statuses = exchange_status(state, status)
        if runner is None or any(not isinstance(s, tuple) for s in statuses):
            raise TensorParallelError(f"start-up failed: {statuses}")
        if on_ready is not None:
            on_ready()
        while True:
            box: list[object] = [None]
            dist.broadcast_object_list(box, src=0)
            msg = box[0]
            if isinstance(msg, StopWorkers):
                return
            if isinstance(msg, Heartbeat):
                dist.all_reduce(torch.zeros(1, device=runner.device))
                continue
            assert isinstance(msg, SchedulerOutput)
            runner.execute(msg)
    finally:
        destroy_parallel_state()


def spawned_worker_main(state: ParallelState, config: EngineConfig) -> None:
    """Entry point of a spawned process: logging, then worker_main."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{state.rank} %(levelname)s %(message)s")
    worker_main(state, config)
