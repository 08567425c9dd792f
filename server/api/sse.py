"""Server-sent events: framing, and a response that aborts the producer as soon as the client goes away.

Starlette's StreamingResponse leaves a half-consumed async generator to the garbage collector when the
client disconnects; the engine request would keep its KV blocks until then. EventStreamResponse
watches for `http.disconnect` itself, cancels the producer at once and closes it, so the engine sees
the abort before its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def tgi_event(obj: Any) -> bytes:
    # TGI writes no space after "data:"; the text-generation client strips the prefix either way.
    return f"data:{_dumps(obj)}\n\n".encode()


def openai_event(obj: Any) -> bytes:
    return f"data: {_dumps(obj)}\n\n".encode()


OPENAI_DONE = b"data: [DONE]\n\n"


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes],
        headers: dict[str, str] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.on_close = on_close
        self.init_headers({**SSE_HEADERS, **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return

        pump_task = asyncio.create_task(pump())
        watch_task = asyncio.create_task(watch())
        try:
            done, _ = await asyncio.wait({pump_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
            if watch_task in done and not pump_task.done():
                log.debug("client disconnected mid-stream; aborting")
        finally:
            for task in (pump_task, watch_task):
                task.cancel()
            await asyncio.gather(pump_task, watch_task, return_exceptions=True)
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
            if self.on_close is not None:
                self.on_close()
        if pump_task.done() and not pump_task.cancelled():
            exc = pump_task.exception()
            if exc is not None and not isinstance(exc, OSError):
                log.error("event stream failed: %r", exc)
