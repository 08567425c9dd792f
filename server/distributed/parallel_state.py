"""The process group: one per process, gloo on CPU and NCCL on CUDA, with the configured timeout.

Rendezvous goes through a TCPStore on rank 0 (`master_addr:master_port`; port 0 binds a free one on a
single node). Start-up (joining, then every rank reporting whether it built its shard) waits on the
store up to `startup_timeout_s`, so slow starts (a late pod, a big checkpoint) are not cut short by
the collective timeout `timeout_s`, which bounds every step's collectives.

Trust: TCPStore has no authentication, so nothing read from it is unpickled (statuses are JSON). The
per-step `broadcast_object_list` of a pickled `SchedulerOutput` (driver.py -> worker.py) is unpickled
by ranks >= 1 only, from rank 0 over the connections the group formed at rendezvous; what protects
it is who can reach the ports: on one node the ranks are the server's own child processes, across
nodes the operator's NetworkPolicy (operator/kubeinfer_operator/netpol.py) admits the store and the
gloo/NCCL ports from the model's own pods only. A process that reached the store port during
start-up could still take a rank's place (and read the schedules); that is a denial of service and
a data leak within the model's pods, not code run on rank 0.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

STARTUP_TIMEOUT_FLOOR_S = 600.0  # start-up may take this long even with a short collective timeout

_store: dist.Store | None = None


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed to start, died, or stopped answering."""


class TensorParallelConfigError(ValueError):
    """The model's shape cannot be split over the requested number of ranks."""


@dataclass(frozen=True)
class ParallelState:
    """What one process needs to join the group."""

    rank: int  # global rank in [0, world_size)
    world_size: int
    local_rank: int  # index among this node's ranks: the CUDA device index
    master_addr: str  # host of rank 0's TCPStore
    master_port: int  # its port (0 on rank 0: bind a free one)
    backend: str  # "gloo" | "nccl"
    timeout_s: float  # every collective after start-up
    startup_timeout_s: float  # joining and the ready handshake


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device_setting: str, local_rank: int) -> torch.device:
    """The device of a rank: cuda:<local rank> on GPUs (one device per rank), else the CPU."""
    if device_setting == "cpu" or (device_setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def create_store(state: ParallelState) -> dist.TCPStore:
    """Rank 0: the server store (listens on every interface; read `.port` when master_port is 0).
    Others: a client that retries connecting until `startup_timeout_s`."""
    return dist.TCPStore(
        state.master_addr,
        state.master_port,
        world_size=state.world_size,
        is_master=state.rank == 0,
        timeout=timedelta(seconds=state.startup_timeout_s),
        wait_for_workers=False,
    )


def _wait_all(
    store: dist.Store, state: ParallelState, prefix: str, poll: Callable[[], None] | None = None
) -> list[str]:
    """Waits until every rank has set `prefix/<rank>` (up to startup_timeout_s, calling `poll` about
    once a second; it may raise). Returns the keys in rank order. Raises TensorParallelError."""
    keys = [f"{prefix}/{r}" for r in range(state.world_size)]
    deadline = time.monotonic() + state.startup_timeout_s
    while not store.check(keys):  # polled: a blocking wait that times out logs a warning each time
        if poll is not None:
            poll()
        if time.monotonic() > deadline:
            raise TensorParallelError(
                f"tensor-parallel start-up: not every rank of {state.world_size} arrived within "
                f"{state.startup_timeout_s:.0f} s ({prefix})"
            )
        time.sleep(0.2)
    return keys


def init_parallel_state(
    state: ParallelState, store: dist.TCPStore | None = None, poll: Callable[[], None] | None = None
) -> None:
    """Joins the default process group once all `world_size` ranks are at the store (start-up timeout;
    the backend's own rendezvous would use the collective timeout)."""
    global _store
    _store = store if store is not None else create_store(state)
    _store.set(f"kubeinfer/joined/{state.rank}", "1")
    _wait_all(_store, state, "kubeinfer/joined", poll)
    dist.init_process_group(
        backend=state.backend,
        store=_store,
        rank=state.rank,
        world_size=state.world_size,
        timeout=timedelta(seconds=state.timeout_s),
    )


Status = tuple[str, list[int]] | str  # (READY, each KV group's block count), or a rank's error text


def exchange_status(
    state: ParallelState, status: Status, poll: Callable[[], None] | None = None
) -> list[Status]:
    """Publishes this rank's start-up status and returns every rank's, in rank order.

    The store takes writes from anyone who reaches its port before the group forms (no authentication
    in TCPStore), so statuses travel as JSON, never pickle: a forged value is a start-up failure, not
    code run on rank 0. Waits up to `startup_timeout_s`, calling `poll` about once a second (it may
    raise, e.g. when a local worker process died). Raises TensorParallelError on timeout or on a
    status that is not a JSON string or [string, [integer, ...]] pair.
    """
    assert _store is not None, "init_parallel_state first"
    _store.set(f"kubeinfer/status/{state.rank}", json.dumps(status))
    keys = _wait_all(_store, state, "kubeinfer/status", poll)
    return [_decode_status(rank, _store.get(k)) for rank, k in enumerate(keys)]


def _decode_status(rank: int, raw: bytes) -> Status:
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise TensorParallelError(f"rank {rank} published a start-up status that is not JSON") from None
    if isinstance(value, str):
        return value
    if (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], str)
        and isinstance(value[1], list)
        and all(isinstance(n, int) and not isinstance(n, bool) for n in value[1])
    ):
        return (value[0], value[1])
    raise TensorParallelError(f"rank {rank} published a malformed start-up status")


def destroy_parallel_state() -> None:
    global _store
    if dist.is_initialized():
        dist.destroy_process_group()
    _store = None
