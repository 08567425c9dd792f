"""Rank 0's side: start the worker processes, check they built their shards, broadcast every step.

Workers are started with torch.multiprocessing's spawn context (a fresh interpreter each, as CUDA
requires). A dead worker is noticed before the next broadcast (its exit code is in the error); a hung
one makes the next collective time out after `distributed_timeout_s`. Either way `broadcast` raises,
which ends the engine loop (EngineDeadError: /health 503, the server exits).
"""

from __future__ import annotations

import logging
import multiprocessing.process

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from server.config import EngineConfig
from server.core.outputs import SchedulerOutput
from server.distributed.parallel_state import (
    ParallelState,
    backend_for,
    destroy_parallel_state,
    free_local_port,
    init_parallel_state,
)
from server.distributed.sharding import check_shardable, shard_model
from server.distributed.worker import READY, StopWorkers, worker_main
from server.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed to start, died, or stopped answering."""


class TensorParallelDriver:
    """Owns the worker processes and rank 0's membership in the process group."""

    def __init__(self, config: EngineConfig, device: torch.device, model: LlamaForCausalLM) -> None:
        """Checks the model splits over N ranks, starts ranks 1..N-1, joins the group as rank 0 and
        replaces `model`'s weights by rank 0's shard. Raises TensorParallelConfigError (nothing started)
        or TensorParallelError."""
        n = config.parallel.tensor_parallel_size
        check_shardable(model, n)
        if device.type == "cuda" and torch.cuda.device_count() < n:
            raise TensorParallelError(
                f"tensor_parallel_size {n} needs {n} GPUs (one per rank); {torch.cuda.device_count()} visible"
            )
        self.world_size = n
        init_method = f"tcp://127.0.0.1:{free_local_port()}"
        backend = backend_for(device)
        timeout = config.parallel.distributed_timeout_s
        ctx = mp.get_context("spawn")
        self.procs: list[multiprocessing.process.BaseProcess] = []
        for rank in range(1, n):
            state = ParallelState(rank, n, init_method, backend, timeout)
            p = ctx.Process(target=worker_main, args=(state, config), name=f"tp-worker-{rank}", daemon=True)
            p.start()
            self.procs.append(p)
        self._closed = False
        try:
            init_parallel_state(ParallelState(0, n, init_method, backend, timeout))
            shard_model(model, 0, n)
        except BaseException:
            self._closed = True
            self._kill()
            destroy_parallel_state()
            raise
        log.info("tensor parallelism: %d ranks over %s (%s)", n, backend, init_method)

    def wait_ready(self, num_blocks: int) -> None:
        """Call once rank 0 has its shard: every rank reports whether it built its own."""
        statuses: list[object] = [None] * self.world_size
        try:
            dist.all_gather_object(statuses, (READY, num_blocks))
        except Exception as e:
            self.close()
            raise TensorParallelError(f"tensor-parallel workers did not start: {e}") from e
        errors = [s for s in statuses if not isinstance(s, tuple)]
        mismatched = [s for s in statuses if isinstance(s, tuple) and s != (READY, num_blocks)]
        if errors or mismatched:
            self.close()
            raise TensorParallelError(f"tensor-parallel startup failed: {errors or mismatched}")

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
