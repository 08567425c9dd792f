"""Rank 0's side: start this node's worker processes, check every rank built its shard, broadcast
every step.

Local workers are started with torch.multiprocessing's spawn context (a fresh interpreter each, as
CUDA requires); in multi-node mode the other nodes' ranks join by the leader's address. A dead local
worker is noticed before the next broadcast (its exit code is in the error) and while idle; a dead
remote rank closes its sockets, so the next collective fails; a hung one makes the next collective time
out after `distributed_timeout_s` (while idle, the heartbeat is that collective). Either way the
engine loop ends (EngineDeadError: /health 503, the server exits 1).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.process
import time

import torch
import torch.distributed as dist

from server.config import EngineConfig
from server.core.kv_groups import KVLayout
from server.core.outputs import SchedulerOutput
from server.distributed.parallel_state import (
    STARTUP_TIMEOUT_FLOOR_S,
    ParallelState,
    TensorParallelError,
    backend_for,
    create_store,
    destroy_parallel_state,
    exchange_status,
    init_parallel_state,
)
from server.distributed.sharding import check_shardable, shard_model
from server.distributed.worker import Heartbeat, StopWorkers, ready_status, spawn_local_workers
from server.models.llama import LlamaForCausalLM

__all__ = ["TensorParallelDriver", "TensorParallelError"]

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0  # while idle, one collective this often: a rank that hung between steps is noticed


class TensorParallelDriver:
    """Owns this node's worker processes and rank 0's membership in the process group."""

    def __init__(self, config: EngineConfig, device: torch.device, model: LlamaForCausalLM) -> None:
        """Checks the model splits over N ranks, starts this node's ranks 1..N/nnodes-1, joins the
        group as rank 0 (waiting for the other nodes' ranks in multi-node mode) and replaces `model`'s
        weights by rank 0's shard. Raises TensorParallelConfigError (nothing started) or
        TensorParallelError."""
        par = config.parallel
        n = par.tensor_parallel_size
        check_shardable(model, n)
        if device.type == "cuda" and torch.cuda.device_count() < par.ranks_per_node:
            raise TensorParallelError(
                f"tensor_parallel_size {n} over {par.nnodes} node(s) needs {par.ranks_per_node} GPUs per "
                f"node (one per rank); {torch.cuda.device_count()} visible"
            )
        self.world_size = n
        self.device = device
        addr = par.master_addr if par.nnodes > 1 else "127.0.0.1"
        self.state = ParallelState(
            rank=0,
            world_size=n,
            local_rank=0,
            master_addr=addr,
            master_port=par.rendezvous_port,
            backend=backend_for(device),
            timeout_s=par.distributed_timeout_s,
            startup_timeout_s=max(par.distributed_timeout_s, STARTUP_TIMEOUT_FLOOR_S),
        )
        store = create_store(self.state)  # binds now: a free port is known before the workers start
        self.state = dataclasses.replace(self.state, master_port=store.port)
        self.procs: list[multiprocessing.process.BaseProcess] = spawn_local_workers(self.state, config)
        self._closed = False
        self._last_collective = time.monotonic()
        try:
            init_parallel_state(self.state, store, poll=self.check_workers)
            shard_model(model, 0, n)
        except BaseException:
            self._closed = True
            self._kill()
            destroy_parallel_state()
            raise
        log.info(
            "tensor parallelism: %d ranks on %d node(s) over %s (rendezvous %s:%d)",
            n,
            par.nnodes,
            self.state.backend,
            addr,
            store.port,
        )

    def wait_ready(self, layout: KVLayout) -> None:
        """Call once rank 0 has its shard and KV layout: every rank reports whether it built its own
        (start-up timeout; a local worker that exits meanwhile fails it at once) and with which KV
        groups' block counts, which must be rank 0's."""
        mine = ready_status(layout)
        try:
            statuses = exchange_status(self.state, mine, poll=self.check_workers)
        except TensorParallelError as e:
            self.close(graceful=False)
            raise TensorParallelError(f"tensor-parallel workers did not start: {e}") from e
        errors = [s for s in statuses if not isinstance(s, tuple)]
        mismatched = [s for s in statuses if isinstance(s, tuple) and s != mine]
        if errors or mismatched:
            self.close(graceful=False)
            raise TensorParallelError(f"tensor-parallel startup failed: {errors or mismatched}")
        self._last_collective = time.monotonic()

    def check_workers(self) -> None:
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                raise TensorParallelError(f"tensor-parallel worker rank {rank} exited (code {p.exitcode})")

    def broadcast(self, sched: SchedulerOutput) -> None:
        """Sends this step's schedule to every worker; raises TensorParallelError if one is gone."""
        self.check_workers()
        try:
            dist.broadcast_object_list([sched], src=0)
        except Exception as e:
            raise TensorParallelError(f"step broadcast failed: {type(e).__name__}: {e}") from e
        self._last_collective = time.monotonic()

    def heartbeat(self) -> None:
        """Called by the idle engine loop: checks the local workers at once and, every HEARTBEAT_S,
        runs one all-reduce with every rank (a hung or vanished remote rank makes it raise within
        `distributed_timeout_s`). Raises TensorParallelError."""
        self.check_workers()
        if time.monotonic() - self._last_collective < HEARTBEAT_S:
            return
        try:
            dist.broadcast_object_list([Heartbeat()], src=0)
            dist.all_reduce(torch.zeros(1, device=self.device))
        except Exception as e:
            raise TensorParallelError(f"heartbeat failed: {type(e).__name__}: {e}") from e
        self._last_collective = time.monotonic()

    def close(self, graceful: bool = True) -> None:
        """Stops the workers and leaves the process group. `graceful`: ask them to stop (only valid
        between steps, when every rank waits on the next broadcast); otherwise they are killed."""
        if self._closed:
            return
        self._closed = True
        try:
            if graceful and all(p.is_alive() for p in self.procs):
                dist.broadcast_object_list([StopWorkers()], src=0)
                for p in self.procs:
                    p.join(timeout=10)
        except Exception:
            log.warning("tensor-parallel workers did not stop cleanly", exc_info=True)
        self._kill()
        destroy_parallel_state()

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
