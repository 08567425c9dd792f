"""A watch resumed from a resourceVersion, as the API server serves it, for kmock's emulator.

kmock's watch answers every watch with an ADDED event for each object that exists, then whatever is
written while the stream is open: an event written between two streams is lost, a deletion included.
kopf ends a stream after `?timeoutSeconds=` and watches again from the last resourceVersion it saw
(kopf/_cogs/clients/watching.py continuous_watch), without listing. The API server (its watch cache,
k8s.io/apiserver storage/cacher) then sends exactly the events after that version, and nothing for
objects that did not change; a version older than the cache keeps is answered with an ERROR event
of code 410 (Expired), after which kopf lists afresh. A child deleted in the gap between two streams
therefore reaches the operator on a real API server: CI saw the emulator lose it (stop 58).

What this module gives the emulator:
- every event written to a resource's bus gets the next resourceVersion of the emulator's counter,
  stamped on the stored object as well (the API server's versions advance on every write, including
  the DELETED event's);
- the bus keeps its last HISTORY events, which `resumed_watch` replays after the version given.
"""

from __future__ import annotations

import collections
import copy
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

from kmock._internal import aiobus, rendering

HISTORY = 10_000  # events kept per resource (the watch cache keeps a window too)


class VersionedBus(aiobus.Bus[Any]):
    """A kmock bus whose events carry advancing resourceVersions and are kept for replay."""

    def __init__(self, versions: itertools.count[int]) -> None:
        super().__init__()
        self._versions = versions
        self._history: collections.deque[tuple[int, dict[str, Any]]] = collections.deque(maxlen=HISTORY)
        self._dropped = 0  # the newest version pushed out of the history (0: nothing dropped yet)

    async def put(self, *items: Any) -> None:
        stamped = []
        for event in items:
            version = next(self._versions)
            obj = event.get("object")
            if isinstance(obj, dict):
                # The event's object shares its metadata with the stored version (kmock's `raw` is a
                # shallow copy): stamping it is the write's new resourceVersion for later reads too.
                obj.setdefault("metadata", {})["resourceVersion"] = str(version)
            # A copy: a later write must not change what this event said.
            event = copy.deepcopy(event)
            if self._history.maxlen and len(self._history) == self._history.maxlen:
                self._dropped = self._history[0][0]
            self._history.append((version, event))
            stamped.append(event)
        await super().put(*stamped)

    @property
    def oldest(self) -> int:
        """The lowest version a watch can resume from: every event after it is kept."""
        return self._dropped

    def since(self, version: int) -> list[tuple[int, dict[str, Any]]] | None:
        """The kept events after `version`, oldest first; None when some of them are no longer kept
        (the API server's 410 Expired)."""
        if version < self._dropped:
            return None
        return [(v, e) for v, e in self._history if v > version]


def expired(version: str, oldest: int) -> dict[str, Any]:
    """The ERROR event the API server sends, in a 200 stream that then ends, for a watch from a version
    older than its watch cache keeps (`oldest`: the lowest version it would resume from), as v1.36.2
    answered: `too old resource version: 1 (247)`."""
    return {
        "type": "ERROR",
        "object": {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": f"too old resource version: {version} ({oldest})",
            "reason": "Expired",
            "code": 410,
        },
    }


def event_version(event: dict[str, Any]) -> int:
    return int(((event.get("object") or {}).get("metadata") or {}).get("resourceVersion") or 0)


async def resumed_watch(
    bus: VersionedBus, version: str, matches: Callable[[dict[str, Any]], bool]
) -> AsyncIterator[Any]:
    """The events after resourceVersion `version` (an integer, as the request checks have already
    ensured) that `matches` accepts, then every new one, until the caller stops iterating."""
    yield b""  # the headers go out at once, as kmock's own watch does
    marker = await bus.mark()  # before the replay: nothing written meanwhile falls between the two
    try:
        backlog = bus.since(int(version))
        if backlog is None:
            yield expired(version, bus.oldest)
            return
        replayed = int(version)
        for seen, event in backlog:
            replayed = max(replayed, seen)
            if matches(event):
                yield event
        async for event in bus.stream(since=marker):
            if event_version(event) <= replayed:
                continue  # written between the mark and the replay: already sent
            if matches(event):
                yield event
    finally:
        await bus.unmark(marker)


class ResumableWatches:
    """Put before kmock.KubernetesEmulator among a subclass's bases: its buses become VersionedBus
    over `_resource_versions()` (the counter the subclass also lists with), and a watch from a
    resourceVersion replays the events after it. Without one (or with "0"), kmock's own watch: every
    object as ADDED, then the changes, as the API server's "most recent" watch does."""

    _buses: Any

    def _resource_versions(self) -> itertools.count[int]:
        raise NotImplementedError

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()  # type: ignore[misc]
        self._buses = collections.defaultdict(lambda: VersionedBus(self._resource_versions()))

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        version = request.params.get("resourceVersion")
        resource = request.resource
        if not version or version == "0" or resource is None:
            async for item in super()._serve_watch(request):  # type: ignore[misc]
                yield item
            return

        def matches(event: dict[str, Any]) -> bool:
            meta = (event.get("object") or {}).get("metadata") or {}
            check = self._KubernetesEmulator__check  # type: ignore[attr-defined]
            return bool(check(request, resource, meta.get("namespace"), meta.get("name"), strict=False))

        async for item in resumed_watch(self._buses[resource], str(version), matches):
            yield item
