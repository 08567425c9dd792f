"""The process group: one per process, gloo on CPU and NCCL on CUDA, with the configured timeout."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    rank: int
    world_size: int
    init_method: str  # tcp://host:port of rank 0's store
    backend: str  # "gloo" | "nccl"
    timeout_s: float


def free_local_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device_setting: str, rank: int) -> torch.device:
    """The device of `rank`: cuda:<rank> on GPUs (one device per rank), else the CPU."""
    if device_setting == "cpu" or (device_setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", rank)


def init_parallel_state(state: ParallelState) -> None:
    """Joins the default process group; blocks until all `world_size` ranks have joined (or times out)."""
    dist.init_process_group(
        backend=state.backend,
        init_method=state.init_method,
        rank=state.rank,
        world_size=state.world_size,
        timeout=timedelta(seconds=state.timeout_s),
    )


def destroy_parallel_state() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
