"""KV-cache events end to end: an engine on a tiny model publishes over ZMQ, a subscriber (SUB socket,
vLLM's wire format decoded with our msgspec types) rebuilds the set of cached blocks, and after each
phase of a scripted sequence (prefix hit, eviction, preemption, reset) that set equals the block pool's,
with every stored block's hash recomputed from the event's parent hash and token ids. A late subscriber
catches up through the replay socket; a full queue drops batches and counts them."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from server.config import CacheConfig, EngineConfig, KVEventsConfig, ModelConfig
from server.core.block_pool import BlockHash, BlockStoredEvent, hash_block_tokens
from server.engine import LLMEngine
from server.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
    decode_batch,
    wire_block_hash,
)
from server.request import SamplingParams

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


class Index:
    """What a KV-aware router keeps: wire hash -> block tokens, from the event stream alone."""

    def __init__(self) -> None:
        self.blocks: dict[int, list[int]] = {}
        self.full: dict[int, BlockHash] = {}  # wire hash -> our full hash, recomputed from tokens
        self.seqs: list[int] = []
        self.counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}

    def apply(self, seq: int, payload: bytes) -> None:
        self.seqs.append(seq)
        batch = decode_batch(payload)
        for ev in batch.events:
            self.counts[type(ev).__name__] += 1
            if isinstance(ev, BlockStored):
                assert ev.block_size == BLOCK and ev.medium == "GPU" and ev.lora_id is None
                assert len(ev.token_ids) == BLOCK * len(ev.block_hashes)
                parent = None if ev.parent_block_hash is None else self.full[ev.parent_block_hash]
                for i, h in enumerate(ev.block_hashes):
                    tokens = ev.token_ids[i * BLOCK : (i + 1) * BLOCK]
                    full = hash_block_tokens(parent, tokens)
                    assert wire_block_hash(full) == h, "hash does not match the event's parent + tokens"
                    self.blocks[h] = tokens
                    self.full[h] = full
                    parent = full
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    assert h in self.blocks, "removed a block never stored"
                    del self.blocks[h]
            else:
                assert isinstance(ev, AllBlocksCleared)
                self.blocks.clear()


def pool_state(llm: LLMEngine) -> set[int]:
    return {wire_block_hash(h) for h in llm.kv.pool._cached}


def drain(sub: zmq.Socket, index: Index, expect_published: int, pub: KVEventPublisher) -> None:
    """Receives until every batch the publisher sent so far has arrived."""
    deadline = time.monotonic() + 60  # generous: a loaded machine delays the publisher thread
    while len(index.seqs) < expect_published:
        assert time.monotonic() < deadline, "events did not arrive"
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv@test"
            index.apply(int.from_bytes(seq, "big"), payload)


def run(llm: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> None:
    llm.generate(prompts, params)


@pytest.fixture(scope="module")
def engine(tiny_model_factory: Callable[..., Path]) -> Iterator[LLMEngine]:
    cfg = EngineConfig(
        model=ModelConfig(model=str(tiny_model_factory("llama")), dtype="float32"),
        cache=CacheConfig(block_size=BLOCK, num_kv_blocks=10),
        max_num_seqs=8,
        num_threads=1,
        kv_events=KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint="tcp://127.0.0.1:*",
            replay_endpoint="tcp://127.0.0.1:*",
            topic="kv@test",
        ),
    )
    llm = LLMEngine(cfg)
    yield llm
    llm.close()


def test_events_track_the_block_pool(engine: LLMEngine) -> None:
    llm = engine
    pub = llm.kv_events
    assert pub is not None
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@test")
    sub.connect(pub.endpoint)
    time.sleep(0.3)  # PUB drops messages sent before the subscription reaches it (ZMQ slow joiner)
    base = pub.num_published
    index = Index()
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, 40000) for _ in range(n)]

    def check(phase: str) -> None:
        assert pub.flush()
        drain(sub, index, pub.num_published - base, pub)
        assert set(index.blocks) == pool_state(llm), phase

    # 1. A 40-token prompt and 8 new tokens: KV exists for 47 of the 48 (the last sampled token is never
    # fed back), so two full blocks are stored.
    shared = tokens(32)
    run(llm, [[*shared, *tokens(8)]])
    check("first request")
    assert index.counts["BlockStored"] >= 1 and len(index.blocks) == 2
    # 2. Same 32-token prefix: a prefix hit (2 blocks), only the new blocks are stored.
    hits0 = llm.stats().prefix_cache_hits
    stored0 = set(index.blocks)
    run(llm, [[*shared, *tokens(20)]])
    check("prefix hit")
    assert llm.stats().prefix_cache_hits - hits0 == 32
    assert stored0 < set(index.blocks)
    # 3. Eviction: distinct prompts that need every block push the cached ones out (LRU).
    removed0 = index.counts["BlockRemoved"]
    run(llm, [tokens(120)], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    check("eviction")
    assert index.counts["BlockRemoved"] > removed0
    # 4. Preemption: three sequences of 5 blocks each on a 10-block pool.
    pre0 = llm.stats().num_preemptions
    run(llm, [tokens(30) for _ in range(3)], SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True))
    check("preemption")
    assert llm.stats().num_preemptions > pre0
    # 5. Reset: AllBlocksCleared and an empty index.
    assert llm.reset_prefix_cache()
    check("reset")
    assert index.blocks == {} and index.counts["AllBlocksCleared"] == 1
    # Sequence numbers are contiguous: nothing was dropped.
    assert index.seqs == list(range(index.seqs[0], index.seqs[0] + len(index.seqs)))
    assert pub.num_dropped == 0
    sub.close(linger=0)

    # A late subscriber asks the replay socket for everything from sequence 0.
    assert pub.replay_address is not None
    # DEALER (not REQ): one request, many replies; frames carry the REQ-style empty delimiter.
    req = ctx.socket(zmq.DEALER)
    req.connect(pub.replay_address)
    req.send_multipart((b"", (0).to_bytes(8, "big")))
    replayed: list[tuple[int, bytes]] = []
    while True:
        assert req.poll(5000), "no replay answer"
        empty, seq_b, payload = req.recv_multipart()
        assert empty == b""
        if seq_b == END_SEQ:
            break
        replayed.append((int.from_bytes(seq_b, "big"), payload))
    req.close(linger=0)
    assert [s for s, _ in replayed] == list(range(pub.num_published))
    late = Index()
    for s, payload in replayed:
        late.apply(s, payload)
    assert late.blocks == {} and late.counts["AllBlocksCleared"] == 1
    assert late.counts["BlockStored"] >= index.counts["BlockStored"]


def test_full_queue_drops_and_counts() -> None:
    pub = KVEventPublisher(
        KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://127.0.0.1:*", max_queue_size=1
        )
    )
    try:
        event = BlockStoredEvent([b"\x01" * 32], None, list(range(BLOCK)), BLOCK)
        n = 5000
        for _ in range(n):
            pub.publish([event])  # never blocks, whatever the sender thread does
        assert pub.flush()
        assert pub.num_dropped > 0
        assert pub.num_published + pub.num_dropped == n
    finally:
        pub.close()


def test_config_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="unknown key"):
        KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publishr": "zmq"}')
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig.from_json('{"publisher": "kafka"}')
    with pytest.raises(ValueError, match="JSON"):
        KVEventsConfig.from_json("{nope")
    cfg = KVEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}'
    )
    assert cfg.enabled and cfg.topic == "kv"
    assert not KVEventsConfig.from_json('{"publisher": "zmq"}').enabled  # vLLM: both must be set


def test_wire_layout_is_vllms() -> None:
    """The payload as a generic msgpack value: an array batch [ts, events, rank] of tagged maps."""
    from server.kv_events import KVEventBatch

    batch = KVEventBatch(
        ts=1.5,
        events=[
            BlockStored([7], None, [1, 2], 2, None, "GPU", None),
            BlockRemoved([7], "GPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    assert raw == [
        1.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [7],
                "parent_block_hash": None,
                "token_ids": [1, 2],
                "block_size": 2,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            },
            {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        ],
        0,
    ]
