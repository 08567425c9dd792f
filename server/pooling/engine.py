"""The pooling engine: continuous batching of pooling requests on a thread of its own.

Requests (token ids, optional token type ids) wait in a queue; each step takes as many as fit in
`max_num_seqs` rows and `max_num_batched_tokens` padded tokens (always at least one), runs one padded
forward pass and hands each row's result back on the event loop. Nothing is kept after the forward
(an encoder or a one-shot decoder pass has no KV cache to keep). Requests that arrive while a step runs
join the next one. A failed forward fails only that step's requests; the loop goes on.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from .model import PoolingModel

log = logging.getLogger(__name__)


@dataclass
class PoolingInput:
    """One sequence: token ids (special tokens included) and, for BERT pairs, token type ids."""

    input_ids: list[int]
    token_type_ids: list[int] | None = None


@dataclass
class _Pending:
    item: PoolingInput
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[torch.Tensor]
    queued_at: float = field(default_factory=time.monotonic)


@dataclass
class PoolingStats:
    """Counters for metrics: finished sequences, prompt tokens, steps, the last step's batch size."""

    num_sequences: int = 0
    num_prompt_tokens: int = 0
    num_steps: int = 0
    last_batch_size: int = 0
    num_waiting: int = 0


class PoolingEngine:
    def __init__(
        self,
        model: PoolingModel,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 16384,
        num_threads: int | None = None,  # torch intra-op threads (--num-threads); None = torch's default
    ) -> None:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max(max_num_batched_tokens, model.max_model_len)
        self.stats = PoolingStats()
        self.error: BaseException | None = None
        self._queue: collections.deque[_Pending] = collections.deque()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="pooling-engine", daemon=True)
        pad = model.tokenizer.pad_token_id
        self._pad_id = int(pad) if pad is not None else 0

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def warmup(self) -> None:
        self._run([PoolingInput([self._pad_id] * 2)])

    async def encode(self, items: list[PoolingInput]) -> list[torch.Tensor]:
        """Each item's result, float32 `[dim]` (pooled, not normalized) or `[num_labels]` logits."""
        loop = asyncio.get_running_loop()
        pending = [_Pending(it, loop, loop.create_future()) for it in items]
        with self._cond:
            if self._stop or not self.alive:
                raise RuntimeError("the pooling engine is not running")
            self._queue.extend(pending)
            self.stats.num_waiting = len(self._queue)
            self._cond.notify()
        try:
            return list(await asyncio.gather(*(p.future for p in pending)))
        except asyncio.CancelledError:
            with self._cond:  # a client gone: its rows that have not run yet leave the queue
                for p in pending:
                    if p in self._queue:
                        self._queue.remove(p)
            raise

    def _take(self) -> list[_Pending]:
        batch: list[_Pending] = []
        longest = 0
        while self._queue and len(batch) < self.max_num_seqs:
            n = len(self._queue[0].item.input_ids)
            if batch and max(longest, n) * (len(batch) + 1) > self.max_num_batched_tokens:
                break
            longest = max(longest, n)
            batch.append(self._queue.popleft())
        self.stats.num_waiting = len(self._queue)
        return batch

    def _run(self, items: list[PoolingInput]) -> torch.Tensor:
        longest = max(len(it.input_ids) for it in items)
        ids = torch.full((len(items), longest), self._pad_id, dtype=torch.long)
        types = torch.zeros((len(items), longest), dtype=torch.long)
        mask = torch.zeros((len(items), longest), dtype=torch.long)
        for row, it in enumerate(items):
            n = len(it.input_ids)
            ids[row, :n] = torch.tensor(it.input_ids)
            if it.token_type_ids is not None:
                types[row, :n] = torch.tensor(it.token_type_ids)
            mask[row, :n] = 1
        return self.model.forward(ids, types, mask)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if self._stop:
                    break
                batch = self._take()
            try:
                out = self._run([p.item for p in batch])
            except Exception as e:  # a bad batch fails its own requests only
                log.exception("pooling forward failed for %d sequence(s)", len(batch))
                for p in batch:
                    p.loop.call_soon_threadsafe(_set_exception, p.future, e)
                continue
            self.stats.num_steps += 1
            self.stats.last_batch_size = len(batch)
            self.stats.num_sequences += len(batch)
            self.stats.num_prompt_tokens += sum(len(p.item.input_ids) for p in batch)
            for row, p in enumerate(batch):
                p.loop.call_soon_threadsafe(_set_result, p.future, out[row].clone())
        with self._cond:
            for p in self._queue:
                p.loop.call_soon_threadsafe(_set_exception, p.future, RuntimeError("shutting down"))
            self._queue.clear()

    async def shutdown(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, 5.0)


def _set_result(f: asyncio.Future[torch.Tensor], value: torch.Tensor) -> None:
    if not f.done():
        f.set_result(value)


def _set_exception(f: asyncio.Future[torch.Tensor], e: BaseException) -> None:
    if not f.done():
        f.set_exception(e)
