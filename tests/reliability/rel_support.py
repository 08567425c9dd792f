"""Helpers shared by the reliability tests: a `python -m server` subprocess on a free local port,
Prometheus scraping, resident memory of a process, and prompt markers for the log checks."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from serving import ThreadedServer, free_port, serve_in_thread, wait_ready

REPO = Path(__file__).resolve().parents[2]

API_KEY = "rel-test-key-0123456789"
SERVED_NAME = "rel-tiny"
MAX_INPUT, MAX_TOTAL = 48, 96


def new_marker() -> str:
    """A word no tokenizer output or log line contains by chance (checked against the logs later)."""
    return f"qzmark{secrets.token_hex(6)}"


def parse_metrics(text: str) -> dict[str, float]:
    """Sums each metric's samples over its label sets (`name{...} value` lines)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def http_status_counts(text: str) -> dict[tuple[str, str], float]:
    """kubeinfer_http_requests_total by (route, status)."""
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("kubeinfer_http_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            route = labels.split('route="', 1)[1].split('"', 1)[0]
            status = labels.split('status="', 1)[1].split('"', 1)[0]
            out[(route, status)] = out.get((route, status), 0.0) + float(value)
    return out


def scrape(url: str, timeout: float = 10.0) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=timeout).text)


def rss_bytes(pid: int) -> int:
    """Resident set size from /proc/<pid>/status (VmRSS is in kB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1"
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    for name in (
        "API_KEY",
        "PAYLOAD_LIMIT",
        "MAX_CONCURRENT_REQUESTS",
        "MAX_INPUT_TOKENS",
        "MAX_TOTAL_TOKENS",
    ):
        env.pop(name, None)
    return env


@dataclass
class ServerProcess:
    """`python -m server` running as a child process, its combined stdout/stderr in `log_path`."""

    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def sigterm(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def start_server(model: Path, log_path: Path, *flags: str) -> ServerProcess:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--num-threads",
        "1",
        *flags,
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT)
    srv = ServerProcess(url=f"http://127.0.0.1:{port}", proc=proc, log_path=log_path)
    try:
        wait_ready(srv.url, proc)
    except BaseException:
        srv.stop()
        raise
    return srv


@dataclass
class InProcServer:
    url: str
    state: Any  # server.api.state.ServerState
    llm: Any  # server.engine.LLMEngine
    running: ThreadedServer

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def stop(self) -> None:
        self.running.stop()


def engine_config(model: Path, num_kv_blocks: int = 64) -> Any:
    from server.config import CacheConfig, EngineConfig, ModelConfig

    return EngineConfig(
        model=ModelConfig(model=str(model), dtype="float32", served_model_name=SERVED_NAME),
        cache=CacheConfig(num_kv_blocks=num_kv_blocks),
        max_num_seqs=16,
        num_threads=1,
    )


def serve_in_process(llm: Any, api_key: str | None = API_KEY, **server_kw: Any) -> InProcServer:
    """Serves an already loaded LLMEngine with the real app on a free 127.0.0.1 port."""

    from server.api.app import create_app
    from server.api.state import ServerState
    from server.config import ServerConfig

    port = free_port()
    config = ServerConfig(
        engine=llm.config,
        host="127.0.0.1",
        port=port,
        max_concurrent_requests=32,
        max_input_tokens=MAX_INPUT,
        max_total_tokens=MAX_TOTAL,
        api_key=api_key,
        **server_kw,
    )
    state = ServerState(config, engine_factory=lambda: llm)
    app = create_app(state)
    # generous: the server thread can start late on a loaded machine
    running = serve_in_thread(app, port, name=f"rel-server-{port}", timeout_s=300)
    return InProcServer(url=running.url, state=state, llm=llm, running=running)
