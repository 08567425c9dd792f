"""Timeouts on the request head and body, and caps on open connections, which uvicorn lacks.

uvicorn's HTTP protocols (httptools, which `http="auto"` picks when installed, and h11) time out only
idle keep-alive connections: a connection that never sends a byte, or sends part of a request head and
stalls (slowloris), stays open forever and holds a socket and a protocol object each. nginx's
`client_header_timeout` and Go's `ReadHeaderTimeout` close such connections; so does this.

`with_head_timeout(base, seconds)` subclasses uvicorn's protocol class: a timer starts when a
connection opens and when the first bytes of a new request arrive after the previous response; when
it fires and no new request head has been parsed since (the protocol's `cycle` is unchanged) and no
response is in progress, the server writes `408 Request Timeout` and closes the connection.

The body gets its own deadline (`body_timeout_s`, --timeout-request-body): from the end of a head
that announces a body until the body's last byte, in total, not between reads (one byte a second
would reset a per-read timer forever). When it passes, a request whose response has not started is
answered `408` and closed; one whose response is complete (a route that answered without reading the
body) is closed. nginx's `client_body_timeout` answers 408 the same way. Until then the request is
not admitted (server/api/state.py: `admit` runs after the body is read), so slow bodies never take
--max-concurrent-requests slots from other clients.

`ConnectionCaps` bounds the connections open at once, in total and per client address (the socket's
peer): one over a cap is answered `503 Service Unavailable` and closed at once, before it can hold a
protocol object for the length of two timeouts. uvicorn's own `--limit-concurrency` counts the same
connections (or its tasks) but refuses only once a request head has been parsed, so a connection
that never sends one still holds its socket; ours refuse at accept, hence the same name with
`--limit-concurrency-per-client` beside it.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

_REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: 27\r\n\r\nrequest head not received\r\n"
)


_BODY_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: 27\r\n\r\nrequest body not received\r\n"
)
_TOO_MANY_CONNECTIONS = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\nretry-after: 1\r\ncontent-length: 22\r\n\r\ntoo many connections\r\n"
)


@dataclass
class ConnectionCaps:
    """Open connections, in total and per client address, against their caps (--limit-concurrency and
    --limit-concurrency-per-client). Touched only on the event loop's thread."""

    total_limit: int
    per_client_limit: int
    total: int = 0
    per_client: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        if self.total_limit < 1 or self.per_client_limit < 1:
            raise ValueError(f"connection caps must be >= 1, got {self.total_limit}, {self.per_client_limit}")

    def open(self, client: str) -> bool:
        """Counts a new connection from `client`; False (and not counted) when a cap is reached."""
        if self.total >= self.total_limit or self.per_client[client] >= self.per_client_limit:
            return False
        self.total += 1
        self.per_client[client] += 1
        return True

    def close(self, client: str) -> None:
        self.total -= 1
        self.per_client[client] -= 1
        if self.per_client[client] <= 0:
            del self.per_client[client]


def with_head_timeout(
    base: type[asyncio.Protocol],
    timeout_s: float,
    body_timeout_s: float | None = None,
    caps: ConnectionCaps | None = None,
) -> type[asyncio.Protocol]:
    """`base` (uvicorn's H11Protocol or HttpToolsProtocol) with a request-head timeout of `timeout_s`
    seconds, a request-body deadline of `body_timeout_s` seconds (None: none) and `caps` on open
    connections (None: none)."""

    class HeadTimeoutProtocol(base):  # type: ignore[valid-type,misc]
        _head_timer: asyncio.TimerHandle | None = None
        _armed_cycle: Any = None
        _body_timer: asyncio.TimerHandle | None = None
        _body_cycle: Any = None
        _client: str | None = None  # set when counted against `caps`

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            if caps is not None:
                peer = transport.get_extra_info("peername")
                client = str(peer[0]) if isinstance(peer, tuple) and peer else "unix"
                if not caps.open(client):
                    transport.write(_TOO_MANY_CONNECTIONS)  # type: ignore[attr-defined]
                    transport.close()
                    return
                self._client = client
            self._arm()

        def data_received(self, data: bytes) -> None:
            cycle = getattr(self, "cycle", None)
            if self._head_timer is not None and cycle is not self._armed_cycle:
                self._disarm()  # stale: a head was parsed since it was armed
            if self._head_timer is None and (cycle is None or cycle.response_complete):
                self._arm()  # the first bytes of a new request on a kept-alive connection
            super().data_received(data)
            cycle = getattr(self, "cycle", None)
            if self._head_timer is not None and cycle is not self._armed_cycle:
                self._disarm()  # the head is complete
            if self._body_timer is not None and (cycle is not self._body_cycle or not cycle.more_body):
                self._body_timer.cancel()  # the body is complete (or a next request began)
                self._body_timer = None
            if (
                body_timeout_s is not None
                and self._body_timer is None
                and cycle is not None
                and cycle is not self._body_cycle
                and cycle.more_body
            ):
                self._body_cycle = cycle  # a new head whose body has not all arrived
                self._body_timer = asyncio.get_running_loop().call_later(body_timeout_s, self._body_timeout)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None
            if self._client is not None and caps is not None:
                caps.close(self._client)
                self._client = None
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

        def _body_timeout(self) -> None:
            self._body_timer = None
            cycle = getattr(self, "cycle", None)
            if cycle is not self._body_cycle or not cycle.more_body:
                return  # the body arrived in time
            transport = self.transport
            if transport.is_closing():
                return
            if cycle.response_started and not cycle.response_complete:
                return  # a response is running: the route did not wait for the body; let it finish
            if not cycle.response_started:
                transport.write(_BODY_TIMEOUT)
            transport.close()  # the route reading the body sees a disconnect (its 499)

    HeadTimeoutProtocol.__name__ = f"HeadTimeout{base.__name__}"
    HeadTimeoutProtocol.__qualname__ = HeadTimeoutProtocol.__name__
    return HeadTimeoutProtocol
