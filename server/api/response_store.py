"""Stored Responses API objects: what `previous_response_id`, `GET /v1/responses/{id}`,
`DELETE /v1/responses/{id}` and `.../input_items` read.

Bounded three ways (`ResponsesStoreConfig`): a count, a byte budget (the JSON size of what is kept)
and a TTL; the least recently used entry goes first when a bound is hit. Each entry belongs to the
API key that created it (`owner_of`: a sha256 of the bearer token, never the token itself), and a
lookup under another key answers as if the id did not exist, so one client cannot read or delete
another's conversation. In memory, per replica: a restart forgets everything and another replica
behind the same Service does not know this one's ids (README, "Responses API").

Plain Python, no I/O; the routes call it from the event loop only, so it takes no lock.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server.config import ResponsesStoreConfig


def owner_of(bearer_token: bytes | None) -> str:
    """The store's owner key for a request's bearer token: its sha256 hex ("" without a token)."""
    if not bearer_token:
        return ""
    return hashlib.sha256(bearer_token).hexdigest()


@dataclass(frozen=True)
class StoredResponse:
    """One stored response.

    body: the response object as the API returned it (status, output, usage...).
    history: the conversation after this response, as chat-template messages (role, content,
        tool_calls, tool_call_id, reasoning_content), without `instructions` (OpenAI does not carry
        them over to the next response); `previous_response_id` continues from it.
    input_items: this request's input items as `GET .../input_items` lists them (with ids).
    """

    owner: str
    body: dict[str, Any]
    history: list[dict[str, Any]]
    input_items: list[dict[str, Any]]
    size_bytes: int
    stored_at: float


def _size(body: dict[str, Any], history: list[dict[str, Any]], items: list[dict[str, Any]]) -> int:
    return len(json.dumps([body, history, items], ensure_ascii=False, default=str).encode())


class ResponseStore:
    """LRU map of response id -> StoredResponse under count, byte and age bounds."""

    def __init__(self, config: ResponsesStoreConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def put(
        self,
        response_id: str,
        owner: str,
        body: dict[str, Any],
        history: list[dict[str, Any]],
        input_items: list[dict[str, Any]],
    ) -> bool:
        """Stores (or replaces) an entry; False when it alone exceeds the byte budget (not stored)."""
        size = _size(body, history, input_items)
        if size > self.config.max_bytes:
            return False
        self._drop(response_id)
        self._entries[response_id] = StoredResponse(owner, body, history, input_items, size, self._clock())
        self._bytes += size
        self._expire()
        while len(self._entries) > self.config.max_entries or self._bytes > self.config.max_bytes:
            oldest = next(iter(self._entries))
            self._drop(oldest)
            self.evictions += 1
        return True

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The entry if it exists, has not expired and belongs to `owner` (marked recently used)."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str, owner: str) -> bool:
        if self.get(response_id, owner) is None:
            return False
        self._drop(response_id)
        return True

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size_bytes

    def _expire(self) -> None:
        if self.config.ttl_s <= 0:
            return
        limit = self._clock() - self.config.ttl_s
        # Entries are in use order, not storage order: scan them all (bounded by max_entries).
        for rid in [rid for rid, e in self._entries.items() if e.stored_at < limit]:
            self._drop(rid)
            self.evictions += 1
