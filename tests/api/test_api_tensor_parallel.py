"""`python -m server --tensor-parallel-size 2` as a subprocess on a tiny model: the HTTP API serves the same
greedy text as the single-process engine, and killing a worker process (busy or idle) ends the server
process with exit code 1 within the timeout (/health 503 or refused on the way, never a stall)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from serving import free_port, wait_ready

from server.cli import build_parser, config_from_args
from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.request import SamplingParams

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colours:"]
MAX_NEW = 8


def test_api_cli_tensor_parallel_flags() -> None:
    parser = build_parser({"TENSOR_PARALLEL_SIZE": "4", "KUBEINFER_DISTRIBUTED_TIMEOUT": "12.5"})
    par = config_from_args(parser.parse_args([])).engine.parallel
    assert (par.tensor_parallel_size, par.distributed_timeout_s) == (4, 12.5)
    par = config_from_args(
        build_parser({}).parse_args(["--tensor-parallel-size", "2", "--device", "cpu"])
    ).engine.parallel
    assert (par.tensor_parallel_size, par.distributed_timeout_s) == (2, 300.0)
    with pytest.raises(SystemExit):
        build_parser({}).parse_args(["--tensor-parallel-size", "0"])
    # multi-node: the variables a LeaderWorkerSet injects (docs/design.md's contract)
    lws = {
        "LWS_GROUP_SIZE": "2",
        "LWS_WORKER_INDEX": "1",
        "LWS_LEADER_ADDRESS": "grp-0.grp.ns",
        "MASTER_PORT": "29600",
    }
    par = config_from_args(build_parser(lws).parse_args(["--tensor-parallel-size", "4"])).engine.parallel
    assert (par.nnodes, par.node_rank, par.master_addr, par.rendezvous_port) == (2, 1, "grp-0.grp.ns", 29600)
    assert (par.ranks_per_node, par.is_leader) == (2, False)
    par = config_from_args(
        build_parser({"LWS_GROUP_SIZE": "2"}).parse_args(["--tensor-parallel-size", "2"])
    ).engine.parallel
    assert (par.is_leader, par.rendezvous_port) == (True, 29500)
    assert (
        config_from_args(build_parser({}).parse_args([])).engine.parallel.rendezvous_port == 0
    )  # any free port
    with pytest.raises(ValueError, match="multiple of the number of nodes"):
        config_from_args(build_parser(lws).parse_args(["--tensor-parallel-size", "3"]))
    with pytest.raises(ValueError, match="LWS_WORKER_INDEX"):
        config_from_args(
            build_parser(dict(lws, LWS_WORKER_INDEX="2")).parse_args(["--tensor-parallel-size", "2"])
        )


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"multiprocessing.spawn" in cmdline and b"resource_tracker" not in cmdline:
            out.append(int(entry))
    return out


@dataclass
class ServerProc:
    url: str
    proc: subprocess.Popen
    log_path: Path


def start_server(folder: Path, log_path: Path, *args: str, env: dict[str, str] | None = None) -> ServerProc:
    """`python -m server` on `folder` as a subprocess (float32, 64 KV blocks, one thread per rank)."""
    port = free_port()
    full_env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1")
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO), full_env.get("PYTHONPATH", "")])
    full_env.pop("API_KEY", None)
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port), "--model", str(folder)]
    cmd += ["--dtype", "float32", "--num-kv-blocks", "64", "--num-threads", "1", *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT)
    return ServerProc(f"http://127.0.0.1:{port}", proc, log_path)


def stop(server: ServerProc) -> None:
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait(10)


def wait_exit(server: ServerProc, timeout_s: float) -> set[object]:
    """Polls /health until the process exits (AssertionError after timeout_s); returns what it saw."""
    seen: set[object] = set()
    deadline = time.monotonic() + timeout_s
    while server.proc.poll() is None:
        assert time.monotonic() < deadline, f"server still running after a rank died; /health: {seen}"
        try:
            seen.add(httpx.get(f"{server.url}/health", timeout=2).status_code)
        except httpx.TransportError:
            seen.add("refused")
        time.sleep(0.05)
    return seen


def reference(folder: Path) -> list[list[int]]:
    """TP=1 greedy token ids of PROMPTS, offline."""
    ref_engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(folder), dtype="float32"), cache=CacheConfig(num_kv_blocks=64)
        )
    )
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    return [ref_engine.generate([ref_engine.tokenizer.encode(p)], greedy)[0] for p in PROMPTS]


def served(url: str) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        r = httpx.post(
            f"{url}/generate",
            json={"inputs": prompt, "parameters": {"max_new_tokens": MAX_NEW, "details": True}},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        out.append([t["id"] for t in r.json()["details"]["tokens"]])
    return out


@pytest.fixture(scope="module")
def tp_server(
    tiny_model_factory, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProc, Path]]:  # type: ignore[no-untyped-def]
    folder = tiny_model_factory("llama", tie=False, heads=4, kv_heads=2)
    log_path = tmp_path_factory.mktemp("tp") / "server.log"
    server = start_server(folder, log_path, "--tensor-parallel-size", "2", "--distributed-timeout", "30")
    try:
        wait_ready(server.url, timeout_s=180)
        yield server, folder
    finally:
        stop(server)


@pytest.mark.slow
def test_api_tp2_serves_tp1_output(tp_server) -> None:  # type: ignore[no-untyped-def]
    server, folder = tp_server
    assert served(server.url) == reference(folder)


def lws_env(index: int, master_port: int) -> dict[str, str]:
    """What a LeaderWorkerSet injects into the pods of a group of 2 (the leader's DNS name here 127.0.0.1)."""
    return {
        "LWS_LEADER_ADDRESS": "127.0.0.1",
        "LWS_GROUP_SIZE": "2",
        "LWS_WORKER_INDEX": str(index),
        "MASTER_PORT": str(master_port),
    }


@contextlib.contextmanager
def lws_group(folder: Path, tmp: Path) -> Iterator[tuple[ServerProc, ServerProc]]:
    """Two `python -m server` processes as the two pods of a LeaderWorkerSet group: same command line."""
    args = ("--tensor-parallel-size", "2", "--distributed-timeout", "30")
    master_port = free_port()
    leader = start_server(folder, tmp / "leader.log", *args, env=lws_env(0, master_port))
    worker = start_server(folder, tmp / "worker.log", *args, env=lws_env(1, master_port))
    try:
        yield leader, worker
    finally:
        stop(leader)
        stop(worker)


@pytest.mark.slow
def test_api_multinode_lws_serves_single_process_tp2_output(tp_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Multi-node mode as two local processes with the LWS variables: the leader serves what one
    process with TP=2 serves (and TP=1); the worker answers /health only; a dead worker pod ends the leader."""
    single, folder = tp_server
    want = served(single.url)
    assert want == reference(folder)
    with lws_group(folder, tmp_path) as (leader, worker):
        wait_ready(leader.url, timeout_s=180)
        assert served(leader.url) == want
        assert httpx.get(f"{worker.url}/health", timeout=5).status_code == 200
        assert httpx.get(f"{worker.url}/ready", timeout=5).status_code == 404  # no API on a worker pod
        assert _children(leader.proc.pid) == []  # one rank per pod: rank 1 is the worker pod
        os.kill(worker.proc.pid, signal.SIGKILL)
        seen = wait_exit(leader, 60)  # idle: the heartbeat's collective fails (peer gone)
        assert leader.proc.returncode == 1, seen
        assert "exiting: the engine loop died" in leader.log_path.read_text()


@pytest.mark.slow
def test_api_multinode_worker_exits_when_the_leader_dies(tiny_model_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    folder = tiny_model_factory("llama", tie=False, heads=4, kv_heads=2)
    with lws_group(folder, tmp_path) as (leader, worker):
        wait_ready(leader.url, timeout_s=180)
        assert httpx.get(f"{worker.url}/health", timeout=5).status_code == 200
        os.kill(leader.proc.pid, signal.SIGKILL)
        wait_exit(worker, 60)
        assert worker.proc.returncode == 1
        assert "exiting: tensor-parallel group failed" in worker.log_path.read_text()


@pytest.mark.slow
def test_api_tp2_dies_with_a_busy_worker(tp_server) -> None:  # type: ignore[no-untyped-def]
    server, _ = tp_server
    url, proc = server.url, server.proc
    # a long request in flight when rank 1 is SIGKILLed: its response ends in an error, and the server
    # process exits 1 (engine death ends the process; api/server.py)
    workers = _children(proc.pid)
    assert len(workers) == 1  # rank 1; rank 0 is the server process itself
    box: dict[str, object] = {}

    def long_request() -> None:
        try:
            r = httpx.post(
                f"{url}/generate",
                json={"inputs": "Hello", "parameters": {"max_new_tokens": 400, "details": True}},
                timeout=60,
            )
            box["status"] = r.status_code
        except httpx.TransportError as e:
            box["status"] = type(e).__name__

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(0.5)
    os.kill(workers[0], signal.SIGKILL)
    seen = wait_exit(server, 30)  # the step's collective fails at once (the peer's socket closes)
    assert proc.returncode == 1 and seen & {503, "refused"}, seen  # 200 until the next step notices
    t.join(30)
    assert box["status"] != 200, box  # never a silent success
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)
    assert "exiting: the engine loop died" in server.log_path.read_text()


@pytest.mark.slow
def test_api_tp2_idle_server_exits_when_a_worker_dies(tiny_model_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """No request in flight: the idle loop's check notices the dead rank (no waiting for traffic)."""
    folder = tiny_model_factory("llama", tie=False, heads=4, kv_heads=2)
    server = start_server(
        folder, tmp_path / "server.log", "--tensor-parallel-size", "2", "--distributed-timeout", "30"
    )
    try:
        wait_ready(server.url, timeout_s=180)
        workers = _children(server.proc.pid)
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        wait_exit(server, 30)
        assert server.proc.returncode == 1
        assert "exiting: the engine loop died" in server.log_path.read_text()
    finally:
        stop(server)


@pytest.mark.slow
def test_api_multinode_sigterm_on_the_leader_stops_the_group_cleanly(
    tiny_model_factory, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """A rolling update drains the leader (SIGTERM): it stops the worker pods' ranks, both exit 0."""
    folder = tiny_model_factory("llama", tie=False, heads=4, kv_heads=2)
    with lws_group(folder, tmp_path) as (leader, worker):
        wait_ready(leader.url, timeout_s=180)
        assert served(leader.url)[0] == reference(folder)[0]
        leader.proc.send_signal(signal.SIGTERM)
        assert leader.proc.wait(60) == 0
        assert worker.proc.wait(60) == 0
        assert "the leader stopped the group" in worker.log_path.read_text()
