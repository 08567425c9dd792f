"""ResponseStore's bounds (count, bytes, TTL), LRU order and per-owner isolation, on a fake clock."""

from __future__ import annotations

import pytest

from server.api.response_store import ResponseStore, owner_of
from server.config import ResponsesStoreConfig


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _put(store: ResponseStore, rid: str, owner: str = "a", text: str = "x") -> bool:
    return store.put(rid, owner, {"id": rid, "text": text}, [{"role": "user", "content": text}], [])


def test_api_response_store_bounds_lru_ttl_and_owners() -> None:
    clock = Clock()
    store = ResponseStore(ResponsesStoreConfig(max_entries=3, max_bytes=4096, ttl_s=10.0), clock)
    for rid in ("r1", "r2", "r3"):
        assert _put(store, rid)
    assert store.get("r1", "a") is not None  # r1 is now the most recently used
    assert _put(store, "r4")  # over the count: the least recently used (r2) goes
    assert store.get("r2", "a") is None and len(store) == 3
    assert {r for r in ("r1", "r3", "r4") if store.get(r, "a")} == {"r1", "r3", "r4"}
    # Another owner sees nothing and deletes nothing.
    assert store.get("r1", "b") is None and not store.delete("r1", "b") and store.get("r1", "a")
    # Bytes: one entry over the budget is not stored; big entries push the old ones out.
    assert not _put(store, "huge", text="y" * 5000)
    assert _put(store, "big1", text="y" * 900) and _put(store, "big2", text="y" * 900)
    assert store.bytes_used <= 4096 and store.get("big1", "a") and store.get("big2", "a")
    assert sum(store.get(r, "a") is not None for r in ("r1", "r3", "r4")) <= 1
    # TTL: entries older than ttl_s are gone, whatever their use.
    clock.t = 11.0
    assert store.get("big2", "a") is None and len(store) == 0 and store.bytes_used == 0
    assert store.evictions > 0
    # Owners are hashes of the bearer token, never the token.
    assert owner_of(b"secret") != "secret" and len(owner_of(b"secret")) == 64 and owner_of(None) == ""


def test_api_response_store_config_is_validated() -> None:
    with pytest.raises(ValueError, match="max_entries"):
        ResponsesStoreConfig(max_entries=0)
    with pytest.raises(ValueError, match="ttl_s"):
        ResponsesStoreConfig(ttl_s=-1)
