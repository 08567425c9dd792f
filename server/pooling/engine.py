"""The pooling engine: pooling requests through the same scheduler and step loop as generation.

`PoolingEngineCore` is what `server.engine.AsyncEngine` drives for an embed or score model: requests
(token ids, optional token type ids) are `Request`s with `PoolingParams`, admitted by
`server.core.scheduler.Scheduler` within `--max-num-seqs` and `--max-num-batched-tokens` (each one
whole, holding no KV blocks); a step runs the scheduled rows as one forward of the pooling model and
each request finishes with its row (nothing is kept after the forward: an encoder or a one-shot decoder
pass has no KV cache to keep). Requests that arrive while a step runs join the next one. A failed
forward fails only that step's requests (`ModelOutput.errors`); the loop goes on. Abort, drain and the
`vllm:num_requests_*` gauges are AsyncEngine's and the scheduler's, as for generation.

`PoolingEngine` is the API's handle: `encode(items)` awaits each item's row.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from server.core.kv_cache_manager import KVCacheManager
from server.core.outputs import ModelOutput, RequestMetrics, RequestOutput, SchedulerStats
from server.core.scheduler import Scheduler, SchedulerConfig
from server.core.step_threads import StepThreads
from server.cpu_env import release_free_heap
from server.engine import AsyncEngine
from server.request import FinishReason, LoRARequest, PoolingParams, Request, SamplingParams
from server.spec_decode.proposer import Speculator

from .model import PoolingModel

log = logging.getLogger(__name__)

# A pooling request samples nothing; the scheduler's Request still carries sampling parameters.
_NO_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass
class PoolingInput:
    """One sequence: token ids (special tokens included) and, for BERT pairs, token type ids."""

    input_ids: list[int]
    token_type_ids: list[int] | None = None
    per_token: bool = False  # every token's last hidden state (`PoolingParams.per_token`)


@dataclass
class PoolingStats:
    """Counters for metrics: finished sequences, prompt tokens, steps, the last step's batch size and
    intra-op thread count (server/core/step_threads.py)."""

    num_sequences: int = 0
    num_prompt_tokens: int = 0
    num_steps: int = 0
    last_batch_size: int = 0
    last_step_threads: int = 0
    num_waiting: int = 0


class PoolingAbortedError(RuntimeError):
    """The request was aborted (drain deadline, shutdown) before its forward ran."""


class PoolingEngineCore:
    """The engine step for a pooling model (AsyncEngine's `EngineCore`): the scheduler's admission and
    budget, the pooling model's forward in place of the model runner."""

    speculator: Speculator | None = None

    def __init__(
        self,
        model: PoolingModel,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_threads: int | None = None,
        adaptive_threads: bool = True,
        step_tokens: int = 0,
    ) -> None:
        """`step_tokens`: a step takes inputs while they fit this many tokens, its first whatever its
        length (`--pooling-step-tokens`, core/scheduler.py); 0 = the whole `max_num_batched_tokens`."""
        self.model = model
        # Each step's intra-op thread count, measured per step size (core/step_threads.py); None: torch's.
        # Every step size is measured on its own (no hint from the nearest size): one thread leading for a
        # sequential client's one-text steps put a BERT-large reranker's 64-pair steps (~9 s, GEMM-bound)
        # on one thread, 0.55x the pairs/s of two in a benchmark run (docs/benchmarks-log.md).
        # Probes back off as generation's do (16 to 256 steps of a size): at every 16th step for good, a
        # sequential client's one-text steps ran 2 of every 16 on the slower count (one client p50
        # 57-63 ms against 46-50 under --thread-policy fixed, Qwen3-Embedding-0.6B shape, idle Zen 5).
        self.threads = StepThreads(
            max_threads or torch.get_num_threads(),
            max_explore_every=256,
            adaptive=adaptive_threads,
            hint_new_buckets=False,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                max_model_len=max(model.max_model_len, 2),
                pooling_step_tokens=step_tokens,
            ),
            # Pooling requests hold no blocks; the manager only answers the scheduler's bookkeeping.
            KVCacheManager(1, 16, enable_prefix_caching=False),
        )
        self.pool_stats = PoolingStats()
        # Called on the engine thread after each schedule(), with the step's stats (its rows running).
        self.on_scheduled: Callable[[SchedulerStats], None] | None = None
        pad = model.tokenizer.pad_token_id
        self._pad_id = int(pad) if pad is not None else 0

    # ---- EngineCore ---------------------------------------------------------------------------
    def validate(
        self, prompt_token_ids: list[int], params: SamplingParams, lora: LoRARequest | None = None
    ) -> None:
        """Raises ValueError for an input the scheduler would refuse (read-only, any thread)."""
        if lora is not None:
            raise ValueError("LoRA adapters are not supported for pooling models")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the input must contain at least one token")
        cfg = self.scheduler.config
        if n > min(cfg.max_model_len, cfg.max_num_batched_tokens):
            raise ValueError(
                f"input has {n} tokens; at most {min(cfg.max_model_len, cfg.max_num_batched_tokens)}"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lora: LoRARequest | None = None,
        pooling: PoolingParams | None = None,
        priority: int = 0,
    ) -> Request:
        if pooling is None:
            raise ValueError("this engine serves a pooling model; generation requests need --task generate")
        self.validate(prompt_token_ids, params, lora)
        req = Request(request_id, list(prompt_token_ids), params, pooling=pooling, priority=priority)
        self.scheduler.add_request(req)
        self.pool_stats.num_waiting = len(self.scheduler.waiting)
        return req

    def check_priority(self, priority: int) -> None:
        self.scheduler.check_priority(priority)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.finish_request(request_id, FinishReason.ABORT)
        self.pool_stats.num_waiting = len(self.scheduler.waiting)
        return _output(req, None) if req is not None else None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        self.pool_stats.num_waiting = len(self.scheduler.waiting)
        if self.on_scheduled is not None:
            self.on_scheduled(self.scheduler.stats())
        reqs = [item.request for item in sched.scheduled]
        out = ModelOutput()
        rows: list[torch.Tensor] | None = None
        if reqs:
            num_tokens = sum(r.num_prompt_tokens for r in reqs)
            threads = self.threads.choose(num_tokens)
            torch.set_num_threads(threads)
            t0 = time.perf_counter()
            try:
                rows = self.run_batch(reqs)
            except Exception as e:  # a bad batch fails its own requests only
                log.exception("pooling forward failed for %d sequence(s)", len(reqs))
                out.errors = {r.request_id: f"{type(e).__name__}: {e}" for r in reqs}
            else:
                self.threads.record(num_tokens, threads, time.perf_counter() - t0)
                self.pool_stats.num_steps += 1
                self.pool_stats.last_batch_size = len(reqs)
                self.pool_stats.last_step_threads = threads
                self.pool_stats.num_sequences += len(reqs)
                self.pool_stats.num_prompt_tokens += num_tokens
        finished = self.scheduler.update_from_output(sched, out)
        return [
            _output(f.request, rows[reqs.index(f.request)].clone() if rows is not None else None)
            for f in finished
        ]

    def reset_prefix_cache(self) -> bool:
        return True  # pooling keeps no prefix cache

    def check_health(self) -> None:
        pass

    def release_idle_memory(self) -> int | None:
        """As LLMEngine's: the batches' freed heap back to the OS once idle (pooling runs on CPU)."""
        return release_free_heap(collect=False)

    def close(self, graceful: bool = True) -> None:
        pass

    # ---- the forward --------------------------------------------------------------------------
    def run_batch(self, reqs: Sequence[Request]) -> list[torch.Tensor]:
        """One padded forward over the requests' prompts: a float32 row per request, `[dim]` or
        `[num_labels]`, or `[num_tokens, dim]` for a `per_token` request."""
        longest = max(r.num_prompt_tokens for r in reqs)
        pad = self._pad_id
        ids = torch.tensor([r.prompt_token_ids + [pad] * (longest - r.num_prompt_tokens) for r in reqs])
        mask = torch.tensor([[1] * r.num_prompt_tokens + [0] * (longest - r.num_prompt_tokens) for r in reqs])
        types = torch.zeros_like(ids)
        for row, r in enumerate(reqs):
            if r.pooling is not None and r.pooling.token_type_ids is not None:
                types[row, : r.num_prompt_tokens] = torch.tensor(r.pooling.token_type_ids)
        per_token = [r.pooling is not None and r.pooling.per_token for r in reqs]
        return self.model.forward_rows(ids, types, mask, per_token)


def _output(req: Request, pooled: torch.Tensor | None) -> RequestOutput:
    return RequestOutput(
        request_id=req.request_id,
        new_token_ids=[],
        text="",
        finished=True,
        finish_reason=req.finish_reason,
        num_prompt_tokens=req.num_prompt_tokens,
        error=req.error,
        metrics=RequestMetrics(req.arrival_time, req.first_scheduled_time, None, time.monotonic()),
        pooled=pooled,
    )


class PoolingEngine:
    """The API's handle on a pooling model: an AsyncEngine over a `PoolingEngineCore`."""

    def __init__(
        self,
        model: PoolingModel,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 16384,
        num_threads: int | None = None,  # torch intra-op threads (--num-threads); None = torch's default
        adaptive_threads: bool = True,  # --thread-policy adaptive (core/step_threads.py) or fixed
        step_tokens: int = 0,  # --pooling-step-tokens (PoolingEngineCore); 0 = the whole budget
    ) -> None:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.model = model
        self.max_num_seqs = max_num_seqs
        # a longest input must fit a step whole
        self.max_num_batched_tokens = max(max_num_batched_tokens, model.max_model_len)
        self.core = PoolingEngineCore(
            model,
            max_num_seqs,
            self.max_num_batched_tokens,
            num_threads,
            adaptive_threads=adaptive_threads,
            step_tokens=step_tokens,
        )
        self.engine: AsyncEngine[PoolingEngineCore] = AsyncEngine(self.core)
        engine = self.engine

        def publish(stats: SchedulerStats) -> None:  # the gauges show the step's rows while it runs
            engine.last_stats = stats

        self.core.on_scheduled = publish
        self._counter = 0

    @property
    def stats(self) -> PoolingStats:
        return self.core.pool_stats

    def start(self) -> None:
        """Starts the step loop; call on the event loop that will await `encode`."""
        self.engine.start()

    @property
    def alive(self) -> bool:
        return self.engine.alive

    def warmup(self) -> None:
        self.core.run_batch([Request("warmup", [self.core._pad_id] * 2, _NO_SAMPLING)])

    async def encode(self, items: list[PoolingInput]) -> list[torch.Tensor]:
        """Each item's result, float32 `[dim]` (pooled, not normalized) or `[num_labels]` logits.
        Raises RuntimeError (EngineDeadError, PoolingAbortedError, a failed forward) or ValueError (an
        input the scheduler refuses). Cancelling the caller aborts the items not finished yet."""
        tasks = [asyncio.ensure_future(self._one(it)) for it in items]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:  # one failed or the caller left: the rest leave the engine (abort)
                t.cancel()

    async def _one(self, item: PoolingInput) -> torch.Tensor:
        self._counter += 1
        rid = f"pool-{self._counter}-{time.monotonic_ns()}"
        types = tuple(item.token_type_ids) if item.token_type_ids is not None else None
        async for out in self.engine.generate(
            item.input_ids, _NO_SAMPLING, rid, pooling=PoolingParams(types, item.per_token)
        ):
            if not out.finished:
                continue
            if out.error is not None:
                raise RuntimeError(out.error)
            if out.finish_reason is FinishReason.ABORT or out.pooled is None:
                raise PoolingAbortedError("the request was aborted")
            assert isinstance(out.pooled, torch.Tensor)
            return out.pooled
        raise PoolingAbortedError("the request ended without a result")

    def abort_all(self) -> int:
        """Aborts every request in flight (the drain deadline): each `encode` raises PoolingAbortedError."""
        return self.engine.abort_all()

    async def shutdown(self) -> None:
        self.abort_all()  # queued before the stop command: every open encode ends
        await self.engine.shutdown()
