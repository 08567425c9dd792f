"""The activator's HTTP side (aiohttp): every path is forwarded to the model's Service (or its router)
through the gate, streaming the response as it comes (SSE included). `/activator/metrics` and
`/activator/healthz` are its own. A refusal is a 503 with Retry-After and vLLM's error body
(`{"object": "error", "message", "type", "param", "code"}`, which OpenAI clients read as well). A
request body over --max-payload-bytes (the server's flag and default) is refused with 413 as soon as
its declared or received length passes the limit, so a held request buffers at most that much.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from .controller import Controller
from .gate import Gate, Refused
from .metrics import ActivatorMetrics

# RFC 9110 7.6.1 hop-by-hop fields, plus those aiohttp sets itself for the new message.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
METRICS_PATH = "/activator/metrics"
WHOLE_BODY_LIMIT = 8 * 1024 * 1024  # sized answers up to this are read whole, larger ones streamed
HEALTH_PATH = "/activator/healthz"


# The server's --max-payload-bytes default (server/config.py): a body the model would refuse is
# refused here, before it is held in memory for as long as the model takes to wake.
DEFAULT_MAX_PAYLOAD_BYTES = 2_000_000


@dataclass(frozen=True)
class ProxyConfig:
    upstream: str  # http://<service>.<namespace>:<port>, no trailing slash
    connect_timeout: float = 10.0
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES  # request bodies, bytes

    def __post_init__(self) -> None:
        if self.max_payload_bytes < 1024:
            raise ValueError(f"max_payload_bytes must be >= 1024, got {self.max_payload_bytes}")


def error_body(message: str, status: int, error_type: str = "ServiceUnavailableError") -> bytes:
    return json.dumps(
        {
            "object": "error",
            "message": message,
            "type": error_type,
            "param": None,
            "code": status,
        }
    ).encode()


class _TooLarge(Exception):
    pass


class Activator:
    def __init__(
        self, config: ProxyConfig, gate: Gate, controller: Controller, metrics: ActivatorMetrics
    ) -> None:
        self.config = config
        self.gate = gate
        self.controller = controller
        self.metrics = metrics
        self._session: aiohttp.ClientSession | None = None
        self._loop_task: asyncio.Task[None] | None = None

    def app(self) -> web.Application:
        # aiohttp's own limit is a backstop: _read_body refuses over-limit bodies as they arrive
        app = web.Application(client_max_size=self.config.max_payload_bytes)
        app.router.add_get(METRICS_PATH, self._metrics)
        app.router.add_get(HEALTH_PATH, self._health)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        app.on_startup.append(self._start)
        app.on_shutdown.append(self._shutdown)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        # No total timeout: a long generation streams for as long as it takes.
        timeout = aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout)
        self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)
        self._loop_task = asyncio.create_task(self.controller.run())

    async def _shutdown(self, _app: web.Application) -> None:
        # SIGTERM (the model deleted, a rollout): held requests get their 503 before connections close.
        self.gate.close(f"the activator of model {self.gate.model} is shutting down")

    async def _stop(self, _app: web.Application) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        if self._session is not None:
            await self._session.close()

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), content_type="text/plain", charset="utf-8")

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _read_body(self, request: web.Request) -> bytes:
        """The whole request body, read as it arrives; raises _TooLarge as soon as the declared or the
        received length passes max_payload_bytes (a chunked body has no declared length)."""
        limit = self.config.max_payload_bytes
        if request.content_length is not None and request.content_length > limit:
            raise _TooLarge
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.content.iter_any():
            size += len(chunk)
            if size > limit:
                raise _TooLarge
            chunks.append(chunk)
        return b"".join(chunks)

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._read_body(request)
        except _TooLarge:
            limit = self.config.max_payload_bytes
            response = web.Response(
                status=413,
                body=error_body(f"request body is larger than {limit} bytes", 413, "BadRequestError"),
                content_type="application/json",
            )
            response.force_close()  # the rest of the body is not read: the connection cannot be reused
            return response
        try:
            await self.gate.admit()
        except Refused as exc:
            self.metrics.refused(exc.reason)
            return web.Response(
                status=503,
                body=error_body(exc.message, 503),
                content_type="application/json",
                headers={"Retry-After": str(exc.retry_after)},
            )
        try:
            return await self._send(request, body)
        finally:
            self.gate.release()

    async def _send(self, request: web.Request, body: bytes) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        try:
            upstream = await self._session.request(
                request.method,
                self.config.upstream + request.rel_url.raw_path_qs,
                headers=headers,
                data=body if body else None,
                allow_redirects=False,
            )
        except (aiohttp.ClientError, OSError) as exc:
            return web.Response(
                status=502,
                body=error_body(f"the model's replica did not answer: {exc}", 502),
                content_type="application/json",
            )
        async with upstream:
            length = upstream.content_length
            if length is not None and length <= WHOLE_BODY_LIMIT:
                # A sized body (a non-streaming answer) goes out in one write: header and body in
                # separate small writes cost a delayed-ACK round on the client's side.
                whole = web.Response(
                    status=upstream.status, reason=upstream.reason, body=await upstream.read()
                )
                for key, value in upstream.headers.items():
                    if key.lower() not in HOP_BY_HOP:
                        whole.headers.add(key, value)
                return whole
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in HOP_BY_HOP:
                    response.headers.add(key, value)
            try:
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
            except ConnectionResetError:
                # The client left (a streaming client closes once it read [DONE]); leaving the `async
                # with` closes the upstream connection, which aborts the request on the replica.
                pass
            return response
