"""A light HTTP/1.1 load generator for JSON POSTs: asyncio streams, keep-alive, pre-encoded requests.

Why: at 64 concurrent clients on 2 cores, httpx's AsyncClient spent 8-12 ms of CPU per
/v1/embeddings request (benchmarks/embeddings.py's `client_cpu_ms_per_request`, docs/benchmarks.md),
about as much as our server spends per embedding, taken from the same cores as the server under test.
This client writes one pre-built request (request line, headers, JSON body: RFC 9112) on a kept-alive
connection and reads the status line, headers and a Content-Length or chunked body; nothing else
(no redirects, no TLS, no cookies, no compression). The response body is returned as bytes for the
caller to validate as it would any client's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any


def build_request(host: str, port: int, path: str, payload: Any) -> bytes:
    """One HTTP/1.1 POST of `payload` as JSON, keep-alive: the bytes to write as they are."""
    body = json.dumps(payload, separators=(",", ":")).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("ascii") + body


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes


class ConnectionDropped(Exception):
    """The server closed a kept-alive connection before (or while) answering."""


class Connection:
    """One kept-alive HTTP/1.1 connection to `host:port`, opened on first use and again after the server
    closes it. Not for concurrent use: one coroutine (one simulated client) owns it."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post(self, request: bytes) -> Response:
        """Sends a `build_request` request and reads its response. Raises ConnectionDropped when the
        server closed the connection (the caller may retry once: a fresh one opens on the next call)
        and ValueError for a response this client cannot read."""
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        reader, writer = self._reader, self._writer
        assert reader is not None
        try:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status_line, *lines = head[:-4].decode("latin-1").split("\r\n")
            status = int(status_line.split(" ", 2)[1])
            headers = {}
            for line in lines:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            if "content-length" in headers:
                body = await reader.readexactly(int(headers["content-length"]))
            elif headers.get("transfer-encoding", "").lower() == "chunked":
                body = await _read_chunked(reader)
            else:
                raise ValueError(f"response without Content-Length or chunked body: {headers}")
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            await self.close()
            raise ConnectionDropped(str(e)) from e
        if headers.get("connection", "").lower() == "close":
            await self.close()
        return Response(status, body)

    async def close(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers, then the empty line
                pass
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)  # the chunk's CRLF
