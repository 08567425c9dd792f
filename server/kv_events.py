"""vLLM's KV-cache events over ZMQ: what the block pool caches and evicts, for KV-aware routers.

Wire format (vLLM's `vllm/distributed/kv_events.py`, read by `vllm-router --policy kv_aware`):
- Each published message is three ZMQ frames: topic (utf-8, may be empty), sequence number (8-byte
  big-endian, 0, 1, 2, ... per publisher) and a msgpack payload.
- The payload is a `KVEventBatch` msgspec Struct encoded array-like: `[ts, events, data_parallel_rank]`
  (`ts` a float, seconds since the epoch; the rank 0, as vLLM's publisher fills it in). Each event is a msgspec
  tagged Struct, a map whose "type" key holds its class name:
  `{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
  "medium", "lora_name"}`, `{"type": "BlockRemoved", "block_hashes", "medium"}`,
  `{"type": "AllBlocksCleared"}`. (vllm-router 0.1.17 reads exactly this: an array batch of tagged
  maps; it refuses array-like events.)
- Block hashes on the wire are unsigned 64-bit integers: the last 8 bytes (big-endian) of our 32-byte
  SHA-256 chain hash (`wire_block_hash`), as vLLM sends them with integer block hashes.
- The replay socket (ROUTER) answers a request frame holding an 8-byte big-endian start sequence
  with one `[seq, payload]` reply per buffered batch from that sequence on, then `[-1, b""]`.

The engine thread never blocks on this: `publish` puts the batch in a bounded queue and counts it as
dropped when the queue is full; a daemon thread encodes, sends and keeps the replay buffer.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence

import msgspec
import zmq

from server.config import KVEventsConfig
from server.core.block_pool import (
    AllBlocksClearedEvent,
    BlockHash,
    BlockRemovedEvent,
    BlockStoredEvent,
    KVCacheEvent,
)

log = logging.getLogger(__name__)

# vLLM's name for the engine's own (first-tier) KV cache, whatever the device.
MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# ---- wire types (msgspec Structs laid out as vLLM's) -------------------------------------------------
class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def wire_block_hash(h: BlockHash) -> int:
    """Our 32-byte chain hash as the unsigned 64-bit integer sent on the wire."""
    return int.from_bytes(h[-8:], "big")


def to_wire(event: KVCacheEvent) -> BlockStored | BlockRemoved | AllBlocksCleared:
    if isinstance(event, BlockStoredEvent):
        return BlockStored(
            block_hashes=[wire_block_hash(h) for h in event.block_hashes],
            parent_block_hash=None
            if event.parent_block_hash is None
            else wire_block_hash(event.parent_block_hash),
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=None,
            medium=MEDIUM,
            lora_name=None,
        )
    if isinstance(event, BlockRemovedEvent):
        return BlockRemoved(block_hashes=[wire_block_hash(h) for h in event.block_hashes], medium=MEDIUM)
    assert isinstance(event, AllBlocksClearedEvent)
    return AllBlocksCleared()


_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decodes one published payload (for subscribers and tests). Raises msgspec.DecodeError."""
    return _decoder.decode(payload)


class KVEventPublisher:
    """Publishes batches of block-pool events on a ZMQ PUB socket, with a replay ROUTER socket.

    `publish` is called by the engine thread and never blocks. Sockets live on the sender thread
    (ZMQ sockets are not thread-safe); they are bound before the constructor returns, so a bad or
    busy address fails the server's start-up instead of a background thread."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self.num_published = 0  # batches sent
        self.num_events_published = 0
        self.num_dropped = 0  # events dropped because the queue was full
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket | None = None
        try:
            _bind_or_connect(self._pub, config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(
                f"kv-events: cannot open {config.endpoint} / {config.replay_endpoint}: {e}"
            ) from e
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """The PUB socket's bound address (the real port when the config asked for port 0 / '*')."""
        return str(self._pub.getsockopt_string(zmq.LAST_ENDPOINT))

    @property
    def replay_address(self) -> str | None:
        return None if self._replay is None else str(self._replay.getsockopt_string(zmq.LAST_ENDPOINT))

    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        """Queues one batch; never blocks. A full queue drops the batch (counted in num_dropped)."""
        if not events or not self._running:
            return
        batch = KVEventBatch(ts=time.time(), events=[to_wire(e) for e in events], data_parallel_rank=0)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += len(events)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Waits until every queued batch has been sent; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and self._running:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def close(self, timeout_s: float = 2.0) -> None:
        """Sends what is queued (up to timeout_s), then closes the sockets."""
        if not self._running:
            return
        self._running = False
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout_s)

    # ---- the sender thread ------------------------------------------------------------------------
    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        try:
            while True:
                if self._replay is not None:
                    while self._replay.poll(0):
                        self._serve_replay()
                try:
                    batch = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if batch is None:
                    break
                payload = encoder.encode(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                seq += 1
                self.num_published += 1
                self.num_events_published += len(batch.events)
                self._queue.task_done()
        except Exception:
            log.exception("kv-events publisher thread failed; events are no longer published")
            self._running = False
        finally:
            self._close_sockets()

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv-events: malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


def _bind_or_connect(sock: zmq.Socket, endpoint: str) -> None:
    # vLLM's convention: a wildcard host or ipc/inproc binds (stable side); a concrete host connects.
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


def make_publisher(config: KVEventsConfig) -> KVEventPublisher | None:
    return KVEventPublisher(config) if config.enabled else None
