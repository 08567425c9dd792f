"""Router fixtures: three `python -m server` processes on a tiny random model (KV events on), and
vllm-router (the real Rust binary from the `vllm-router` wheel) started in front of them per policy."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
from rel_support import ServerProcess, start_server
from serving import free_port

SERVED = "tiny-router"
ROUTER_BIN = Path(sys.executable).with_name("vllm-router")
KV_EVENTS = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}'


@dataclass
class Replica:
    server: ServerProcess
    kv_endpoint: str
    kv_replay: str

    @property
    def url(self) -> str:
        return self.server.url


@dataclass
class Router:
    url: str
    metrics_url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_replicas(model: Path, tmp: Path, n: int) -> list[Replica]:
    """n servers started together (loading overlaps), each reporting its bound KV-event sockets."""
    out: list[ServerProcess | BaseException | None] = [None] * n

    def one(i: int) -> None:
        try:
            out[i] = start_server(
                model,
                tmp / f"replica{i}.log",
                "--served-model-name",
                SERVED,
                "--num-kv-blocks",
                "512",
                "--max-total-tokens",
                "1024",
                "--kv-events-config",
                KV_EVENTS,
                "--drain-timeout",
                "60",
            )
        except BaseException as e:
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [o for o in out if isinstance(o, BaseException)]
    if errors:
        for o in out:
            if isinstance(o, ServerProcess):
                o.stop()
        raise errors[0]
    replicas = []
    for o in out:
        assert isinstance(o, ServerProcess)
        info = httpx.get(f"{o.url}/get_server_info", timeout=10).json()["kv_events_config"]
        replicas.append(Replica(o, info["endpoint"], info["replay_endpoint"]))
    return replicas


def start_router(replicas: list[Replica], policy: str, log_path: Path, *extra: str) -> Router:
    port, prom = free_port(), free_port()
    cmd = [
        str(ROUTER_BIN),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-port",
        str(prom),
        "--policy",
        policy,
        "--worker-urls",
        *[r.url for r in replicas],
        "--health-check-endpoint",
        "/ready",
        "--health-check-interval-secs",
        "1",
        "--health-failure-threshold",
        "1",
        # A killed or draining replica fails its check at once (refused, 503); the 5 s default timeout
        # also dropped a live replica whose /ready answered late on a loaded machine.
        "--health-check-timeout-secs",
        "30",
        "--log-level",
        "info",
        *extra,
    ]
    # kv_aware without static sources: the router asks each worker's /kv_event_sources where to
    # subscribe, as it does for pods it discovers on Kubernetes (the benchmark uses static sources).
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    router = Router(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{prom}", proc, log_path)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm-router exited: {log_path.read_text(errors='replace')[-2000:]}")
        try:
            if httpx.get(f"{router.url}/readiness", timeout=2).status_code == 200:
                return router
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    router.stop()
    raise TimeoutError("vllm-router not ready")


@pytest.fixture(scope="module")
def replicas(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Replica]]:
    reps = start_replicas(tiny_model_factory("llama"), tmp_path_factory.mktemp("replicas"), 3)
    yield reps
    for r in reps:
        r.server.stop()


@pytest.fixture
def router_factory(tmp_path: Path) -> Iterator[Callable[..., Router]]:
    started: list[Router] = []

    def make(replicas: list[Replica], policy: str, *extra: str) -> Router:
        r = start_router(replicas, policy, tmp_path / f"router-{policy}-{len(started)}.log", *extra)
        started.append(r)
        return r

    yield make
    for r in started:
        r.stop()
