"""Tensor-parallel start-up reads only JSON from the TCPStore (issue 45 item 9): the store takes
writes from anyone who reaches its port, so a status there must never be unpickled."""

from __future__ import annotations

import os
import pickle
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, ...]]:
        return (os.mkdir, (str(self.marker),))  # what an attacker's pickle would run on rank 0


def _rank0_with_store(monkeypatch: pytest.MonkeyPatch) -> tuple[object, dist.TCPStore, dist.TCPStore]:
    from server.distributed import parallel_state as ps

    master = dist.TCPStore("127.0.0.1", 0, world_size=2, is_master=True, wait_for_workers=False)
    state = ps.ParallelState(
        rank=0,
        world_size=2,
        local_rank=0,
        master_addr="127.0.0.1",
        master_port=master.port,
        backend="gloo",
        timeout_s=10.0,
        startup_timeout_s=5.0,
    )
    client = dist.TCPStore(
        "127.0.0.1", master.port, world_size=2, is_master=False, timeout=timedelta(seconds=5)
    )
    monkeypatch.setattr(ps, "_store", master)
    return state, master, client


def test_a_pickled_status_in_the_store_is_never_unpickled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from server.distributed.parallel_state import TensorParallelError, exchange_status

    state, _master, client = _rank0_with_store(monkeypatch)
    marker = tmp_path / "pwned"
    client.set("kubeinfer/status/1", pickle.dumps(_Payload(marker)))
    with pytest.raises(TensorParallelError, match="rank 1"):
        exchange_status(state, ("ready", [4]))
    assert not marker.exists()


def test_statuses_round_trip_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    from server.distributed.parallel_state import exchange_status

    state, _master, client = _rank0_with_store(monkeypatch)
    # (READY, each KV layer group's block count): worker.ready_status
    client.set("kubeinfer/status/1", '["ready", [364, 10]]')
    assert exchange_status(state, ("ready", [364, 10])) == [("ready", [364, 10]), ("ready", [364, 10])]
    client.set("kubeinfer/status/1", '"rank 1: OSError: no shard"')
    assert exchange_status(state, ("ready", [364, 10]))[1] == "rank 1: OSError: no shard"
