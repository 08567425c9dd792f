"""Runs the app under uvicorn: the port opens at once while the model loads on a thread, and SIGTERM
drains (readiness off, new requests 503, admitted requests finish within --drain-timeout, exit 0).
Requests still running at the deadline are cut in their API's shape - a 503 naming the shutdown, or a
stream's final error event (OpenAI's then `data: [DONE]`) - and the process exits 3.
A model that fails to load, or an engine loop that dies later (e.g. a tensor-parallel rank died or
hung), ends the process with exit code 1 at once: uvicorn stops listening, in-flight responses carry
their error (at most `timeout_graceful_shutdown`), and the pod restarts (vLLM does the same)."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType

import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from server.config import ServerConfig

from .app import create_app
from .limits import ConnectionCaps, with_head_timeout
from .state import ServerState

log = logging.getLogger(__name__)

# Exit code when the drain deadline cut requests that were still running (0: every request finished;
# 1: the model failed to load or the engine loop died).
EXIT_REQUESTS_CUT = 3
# How long cut requests get to write their 503 body or final error event before the port closes.
CUT_GRACE_S = 5.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_started = False
        self._drain_task: asyncio.Task[None] | None = None
        self.exit_code = 0
        state.on_load_failed = self._load_failed
        state.on_engine_dead = self._engine_dead

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def _load_failed(self, e: BaseException) -> None:
        log.error("exiting: the model could not be loaded: %s", e)
        self.exit_code = 1
        self.should_exit = True

    def _engine_dead(self, e: BaseException) -> None:
        log.error("exiting: the engine loop died: %s: %s", type(e).__name__, e)
        self.exit_code = 1
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in uvicorn's captured signals: it would re-raise SIGTERM after shutdown, and the
        # process would end by the signal instead of exiting 0.
        if self._drain_started or self._loop is None:
            log.warning("second %s: exiting now", signal.Signals(sig).name)
            self.should_exit = True
            self.force_exit = True
            return
        self._drain_started = True
        self.state.begin_drain()
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        timeout = self.state.config.drain_timeout_s
        ok = await self.state.wait_drained(timeout)
        if ok:
            log.info("drained; shutting down")
        else:
            n = self.state.cut_in_flight(
                f"the server is shutting down: the request was still running at the drain deadline "
                f"(--drain-timeout {timeout:g} s) and was cut"
            )
            log.warning(
                "drain timeout (%g s) with %d request(s) still running; cutting them (503 / a final "
                "error event each); exit code %d",
                timeout,
                n,
                EXIT_REQUESTS_CUT,
            )
            if self.exit_code == 0:
                self.exit_code = EXIT_REQUESTS_CUT
            # the cut requests write their 503 or final event; uvicorn then closes their connections
            await self.state.wait_drained(CUT_GRACE_S)
        self.should_exit = True


def uvicorn_config(app: ASGIApp, config: ServerConfig) -> uvicorn.Config:
    """uvicorn's settings for our app, with the request timeouts and connection caps on its HTTP
    protocol class (one `ConnectionCaps` per call: per server)."""
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_config=None,  # our logging setup (text or JSON) applies to uvicorn's loggers too
        access_log=False,  # the API middleware writes the access line
        timeout_graceful_shutdown=2,
        # Longer than the idle timeout of clients' pools (httpx, hence openai: 5 s) and load balancers
        # (60 s): whoever holds an idle connection drops it first. With uvicorn's 5 s default, a request
        # sent just as the server closed the connection failed with a reset (seen in the soak test).
        timeout_keep_alive=75,
        lifespan="on",
        # httptools when installed, else h11 (uvicorn's "auto"), with our request head and body
        # timeouts and connection caps
        http=with_head_timeout(
            AutoHTTPProtocol,
            config.timeout_request_head_s,
            config.timeout_request_body_s,
            ConnectionCaps(config.limit_concurrency, config.limit_concurrency_per_client),
        ),
    )
    return uv_config


def serve(config: ServerConfig) -> int:
    state = ServerState(config)
    uv_config = uvicorn_config(create_app(state), config)
    server = DrainingServer(uv_config, state)
    log.info(
        "listening on http://%s:%d (model loading in the background; /ready turns 200 when done)",
        config.host,
        config.port,
    )
    server.run()
    return server.exit_code
