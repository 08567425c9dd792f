"""Helpers for tests that start a server on this machine (in process under uvicorn, or `python -m
server` as a child): a free local port, waiting for `/ready`, and the app in a thread of the test
process (`serve_in_thread`). One copy for every test folder; import it as `from serving import
free_port, wait_ready` (tests/ is on sys.path: its conftest.py sits there)."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS's pick; another process may take it
    before the caller binds it, which the tests accept)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(
    url: str,
    proc: subprocess.Popen[bytes] | None = None,
    timeout_s: float = 240.0,
    path: str = "/ready",
) -> None:
    """Polls `url + path` until it answers 200. Raises RuntimeError where `proc` (the server's child
    process, if any) exits first, TimeoutError after `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url}{path} not ready after {timeout_s} s")


def wait_listening(url: str, timeout_s: float = 120.0) -> None:
    """Polls `url`/health until the server answers at all (any status: an app that never loads its
    model answers 503). Raises TimeoutError after `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/health", timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.05)
    raise TimeoutError(f"{url} not listening after {timeout_s} s")


@dataclass
class ThreadedServer:
    """An ASGI app under uvicorn in a daemon thread of the test process (`serve_in_thread`)."""

    url: str  # http://127.0.0.1:PORT
    server: Any  # uvicorn.Server
    thread: threading.Thread

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=timeout_s)

    def __enter__(self) -> ThreadedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_in_thread(
    app: Any,
    port: int,
    *,
    make_config: Callable[[Any], Any] | None = None,
    name: str | None = None,
    until: Literal["ready", "listening"] = "ready",
    timeout_s: float = 240.0,
) -> ThreadedServer:
    """Runs `app` (server.api.app.create_app's) on 127.0.0.1:`port` under uvicorn in a daemon thread and
    returns once it is ready (`until="ready"`: /ready answers 200) or answers at all (`"listening"`: an
    app that does not load a model). `make_config(app)` builds the uvicorn.Config instead of the plain
    one (no log config, lifespan on): server.api.app.uvicorn_config's, with the server's own timeouts.
    Raises what the wait raises, the server stopped first."""
    import uvicorn

    config = (
        make_config(app)
        if make_config is not None
        else uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, lifespan="on")
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=name or f"test-server-{port}", daemon=True)
    thread.start()
    running = ThreadedServer(f"http://127.0.0.1:{port}", server, thread)
    try:
        if until == "ready":
            wait_ready(running.url, timeout_s=timeout_s)
        else:
            wait_listening(running.url, timeout_s=timeout_s)
    except BaseException:
        running.stop()
        raise
    return running
