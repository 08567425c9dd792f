"""`python -m server --tensor-parallel-size 2` as a subprocess on a tiny model: the HTTP API serves the same
greedy text as the single-process engine, and killing a worker process takes /health to 503."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import free_port, wait_ready

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


@pytest.fixture(scope="module")
def tp_server(
    tiny_model_factory, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, subprocess.Popen, Path]]:  # type: ignore[no-untyped-def]
    folder = tiny_model_factory("llama", tie=False, heads=4, kv_heads=2)
    port = free_port()
    log_path = tmp_path_factory.mktemp("tp") / "server.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.pop("API_KEY", None)
    cmd = [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port), "--model", str(folder)]
    cmd += [
        "--dtype",
        "float32",
        "--num-kv-blocks",
        "64",
        "--num-threads",
        "1",
        "--tensor-parallel-size",
        "2",
    ]
    cmd += ["--distributed-timeout", "30"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, timeout_s=180)
        yield url, proc, folder
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.slow
def test_api_tp2_serves_tp1_output_then_dies_with_a_worker(tp_server) -> None:  # type: ignore[no-untyped-def]
    url, proc, folder = tp_server
    ref_engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(folder), dtype="float32"), cache=CacheConfig(num_kv_blocks=64)
        )
    )
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    for prompt in PROMPTS:
        ids = ref_engine.tokenizer.encode(prompt)
        want = ref_engine.generate([ids], greedy)[0]
        r = httpx.post(
            f"{url}/generate",
            json={"inputs": prompt, "parameters": {"max_new_tokens": MAX_NEW, "details": True}},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert [t["id"] for t in r.json()["details"]["tokens"]] == want

    workers = _children(proc.pid)
    assert len(workers) == 1  # rank 1; rank 0 is the server process itself
    os.kill(workers[0], signal.SIGKILL)
    r = httpx.post(
        f"{url}/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 4}}, timeout=60
    )
    assert r.status_code >= 500
    deadline = time.monotonic() + 30
    while httpx.get(f"{url}/health", timeout=5).status_code != 503:
        assert time.monotonic() < deadline, "/health still 200 after a worker died"
        time.sleep(0.2)
