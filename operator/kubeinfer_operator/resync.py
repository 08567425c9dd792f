"""An operator-wide periodic resync that depends neither on watch streams nor on finalizers.

kopf resumes a watch from its last resourceVersion instead of re-listing, so a resync driven by
re-listing may never run; kopf's per-object timers would add a finalizer to every InferenceModel
(deletion would then hang while the operator is down). Instead, the models seen in watch events are
remembered here, and one thread calls `resync_one` for each of them every `interval` seconds, or at
once when `trigger()` is called (an optional CRD was installed)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Resyncer:
    def __init__(self, resync_one: Callable[[str, str], None], interval: float) -> None:
        self._resync_one = resync_one
        self._interval = interval
        self._known: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def seen(self, namespace: str, name: str) -> None:
        with self._lock:
            self._known.add((namespace, name))

    def gone(self, namespace: str, name: str) -> None:
        with self._lock:
            self._known.discard((namespace, name))

    def known(self) -> list[tuple[str, str]]:
        with self._lock:
            return sorted(self._known)

    def trigger(self) -> None:
        self._wake.set()

    def start(self, run: Callable[[Callable[[], None]], None] | None = None) -> None:
        """Start the thread; `run` wraps its body (e.g. contextvars.Context.run, so kopf.event works)."""
        body = self._loop if run is None else (lambda: run(self._loop))
        self._thread = threading.Thread(target=body, name="kubeinfer-resync", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            for namespace, name in self.known():
                if self._stop.is_set():
                    return  # shutting down: a pass over many models must not delay the exit
                try:
                    self._resync_one(namespace, name)
                except Exception:  # one model's failure must not end the resync of the others
                    log.exception("resync of %s/%s failed", namespace, name)
