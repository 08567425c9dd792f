"""A timeout on the request head (request line and headers), which uvicorn lacks.

uvicorn's HTTP protocols (httptools, which `http="auto"` picks when installed, and h11) time out only
idle keep-alive connections: a connection that never sends a byte, or sends part of a request head and
stalls (slowloris), stays open forever and holds a socket and a protocol object each. nginx's
`client_header_timeout` and Go's `ReadHeaderTimeout` close such connections; so does this.

`with_head_timeout(base, seconds)` subclasses uvicorn's protocol class: a timer starts when a
connection opens and when the first bytes of a new request arrive after the previous response; when
it fires and no new request head has been parsed since (the protocol's `cycle` is unchanged) and no
response is in progress, the server writes `408 Request Timeout` and closes the connection. The
request body is not covered (the routes read it under --max-payload-bytes and the client's own
timeouts); neither are running responses.
"""

from __future__ import annotations

import asyncio
from typing import Any

_REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: 27\r\n\r\nrequest head not received\r\n"
)


def with_head_timeout(base: type[asyncio.Protocol], timeout_s: float) -> type[asyncio.Protocol]:
    """`base` (uvicorn's H11Protocol or HttpToolsProtocol) with a request-head timeout of `timeout_s`."""

    class HeadTimeoutProtocol(base):  # type: ignore[valid-type,misc]
        _head_timer: asyncio.TimerHandle | None = None
        _armed_cycle: Any = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            cycle = getattr(self, "cycle", None)
            if self._head_timer is not None and cycle is not self._armed_cycle:
                self._disarm()  # stale: a head was parsed since it was armed
            if self._head_timer is None and (cycle is None or cycle.response_complete):
                self._arm()  # the first bytes of a new request on a kept-alive connection
            super().data_received(data)
            if self._head_timer is not None and getattr(self, "cycle", None) is not self._armed_cycle:
                self._disarm()  # the head is complete

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._armed_cycle = getattr(self, "cycle", None)
            self._head_timer = asyncio.get_running_loop().call_later(timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            cycle = getattr(self, "cycle", None)
            if cycle is not self._armed_cycle:
                return  # a head arrived in time
            if cycle is not None and not cycle.response_complete:
                return  # a response is running (pipelined bytes came early)
            transport = self.transport
            if not transport.is_closing():
                transport.write(_REQUEST_TIMEOUT)
                transport.close()

    HeadTimeoutProtocol.__name__ = f"HeadTimeout{base.__name__}"
    HeadTimeoutProtocol.__qualname__ = HeadTimeoutProtocol.__name__
    return HeadTimeoutProtocol
