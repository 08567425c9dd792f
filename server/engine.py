"""LLMEngine (synchronous step loop) and AsyncEngine (the step loop on its own thread, an async
stream per request, add/abort from any coroutine)."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from server.attention import make_attention_backend
from server.config import EngineConfig
from server.core.kv_cache_manager import KVCacheManager
from server.core.outputs import RequestMetrics, RequestOutput, SchedulerStats
from server.core.scheduler import Scheduler, SchedulerConfig
from server.lora.manager import LoRAManager
from server.lora.registry import LoRARegistry
from server.models.loader import LoadedModel, ModelSource, load_model, resolve_dtype, resolve_model
from server.models.serving_weights import prepare_for_serving
from server.request import FinishReason, LoRARequest, Request, SamplingParams
from server.tokenizer import IncrementalDetokenizer, Tokenizer
from server.worker.model_runner import ModelRunner, kv_bytes_per_block

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop died; no request can be served until the process restarts."""


@dataclass
class _RequestState:
    request: Request
    detok: IncrementalDetokenizer
    num_sent: int = 0
    prompt_logprobs_sent: bool = False


@dataclass(frozen=True)
class EngineInfo:
    model_id: str
    served_model_name: str
    architecture: str
    dtype: str
    quantization: str | None
    num_parameters: int
    weight_bytes: int
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    attention_backend: str
    device: str


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.device == "auto":
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            self.device = torch.device(config.device)
        if config.num_threads is not None and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        t0 = time.monotonic()
        self.source: ModelSource = resolve_model(config.model.model, config.model.cache_dir)
        dtype = resolve_dtype(config.model.dtype, self.device)
        from server.models.loader import read_hf_config

        max_pos = int(read_hf_config(self.source.folder).get("max_position_embeddings", 2048))
        self.max_model_len = config.model.max_model_len or min(max_pos, 8192)
        self.loaded: LoadedModel = load_model(
            self.source.folder, dtype, self.device, self.max_model_len, config.model.quantize
        )
        if config.model.optimize_weights:
            prepare_for_serving(self.loaded.model, self.device, dtype)
        self.tokenizer = Tokenizer(self.source.folder)
        # LoRA: adapters by name (and their weights, LRU) + the model's projections wrapped with slots.
        self.lora: LoRARegistry | None = None
        lora_manager: LoRAManager | None = None
        if config.lora.enable_lora:
            self.lora = LoRARegistry(config.lora, self.loaded.arch, dtype, config.model.cache_dir)
            for module in config.lora.lora_modules:
                self.lora.add(module.name, module.path, module.base_model_name)
            lora_manager = LoRAManager(self.loaded.model, self.lora, self.device, dtype)
            log.info(
                "LoRA enabled: %d adapters, max_loras=%d, max_lora_rank=%d, %.1f MiB per resident adapter",
                len(config.lora.lora_modules),
                config.lora.max_loras,
                config.lora.max_lora_rank,
                lora_manager.slot_bytes() / 2**20,
            )
        self.lora_manager = lora_manager
        log.info("loaded weights from %s in %.1f s", self.source.folder, time.monotonic() - t0)

        block_size = config.cache.block_size
        backend = make_attention_backend(
            config.attention_backend, block_size, self.device.type, config.model.cache_dir
        )
        self.backend_name = backend_name = backend.name
        num_blocks = config.cache.num_kv_blocks or max(
            1, config.cache.kv_cache_memory_bytes // kv_bytes_per_block(self.loaded.model, block_size, dtype)
        )
        self.runner = ModelRunner(
            self.loaded.model,
            backend,
            num_blocks,
            block_size,
            dtype,
            self.device,
            lora=lora_manager,
        )
        self.kv = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                max_loras=config.lora.max_loras if config.lora.enable_lora else 0,
            ),
            self.kv,
        )
        eos = set(self.loaded.arch.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self._states: dict[str, _RequestState] = {}
        self.info = EngineInfo(
            model_id=self.source.model_id,
            served_model_name=config.model.served_model_name or self.source.model_id,
            architecture=self.loaded.arch.architecture,
            dtype=str(dtype).removeprefix("torch."),
            quantization=self.loaded.quantization,
            num_parameters=self.loaded.num_parameters,
            weight_bytes=self.loaded.weight_bytes,
            block_size=block_size,
            num_kv_blocks=num_blocks,
            max_model_len=self.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            attention_backend=backend_name,
            device=str(self.device),
        )

    # ---- requests -----------------------------------------------------------------------------
    def validate(
        self, prompt_token_ids: list[int], params: SamplingParams, lora: LoRARequest | None = None
    ) -> None:
        """Raises ValueError if the request can never be served. Reads only immutable config."""
        if lora is not None and self.lora is None:
            raise ValueError("LoRA adapters are not enabled on this server (--enable-lora)")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt must contain at least one token")
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; the model's context is {self.max_model_len} tokens")
        vocab = self.loaded.arch.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        needed = min(n + params.max_tokens, self.max_model_len)
        if not self.kv.can_ever_fit(needed):
            raise ValueError(
                f"prompt + max_tokens = {n + params.max_tokens} tokens can never fit in the KV cache "
                f"({self.kv.pool.num_blocks} blocks of {self.kv.block_size} tokens)"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lora: LoRARequest | None = None,
    ) -> Request:
        self.validate(prompt_token_ids, params, lora)
        req = Request(request_id, list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids, lora=lora)
        self.scheduler.add_request(req)
        self._states[request_id] = _RequestState(
            req, IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params)
        )
        return req

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.finish_request(request_id, FinishReason.ABORT)
        state = self._states.pop(request_id, None)
        if req is None or state is None:
            return None
        return self._output(state, [], "", finished=True)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    # ---- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        model_out = self.runner.execute(sched)
        self.scheduler.update_from_output(sched, model_out)
        outputs: list[RequestOutput] = []
        for item in sched.scheduled:
            rid = item.request.request_id
            state = self._states.get(rid)
            if state is None:
                continue
            req = state.request
            new_tokens = req.output_token_ids[state.num_sent :]
            state.num_sent = len(req.output_token_ids)
            prompt_lps = None
            if rid in model_out.prompt_logprobs and not state.prompt_logprobs_sent:
                prompt_lps = model_out.prompt_logprobs[rid]
                state.prompt_logprobs_sent = True
            if not new_tokens and not req.is_finished:
                continue
            text = ""
            try:
                if new_tokens:
                    upd = state.detok.push(new_tokens)
                    text = upd.text
                    if upd.stop_string is not None and not req.is_finished:
                        self.scheduler.finish_request(rid, FinishReason.STOP, stop_reason=upd.stop_string)
                if req.is_finished:
                    text += state.detok.flush()
            except Exception as e:  # one request's detokenization must not take the batch down
                log.exception("detokenization failed for request %s", rid)
                req.error = f"detokenization failed: {type(e).__name__}: {e}"
                self.scheduler.finish_request(rid, FinishReason.ERROR)
            lps = [model_out.logprobs[rid]] if rid in model_out.logprobs and new_tokens else []
            out = self._output(state, new_tokens, text, finished=req.is_finished, logprobs=lps)
            out.prompt_logprobs = prompt_lps
            outputs.append(out)
            if req.is_finished:
                del self._states[rid]
        return outputs

    def _output(
        self,
        state: _RequestState,
        new_tokens: list[int],
        text: str,
        finished: bool,
        logprobs: list | None = None,
    ) -> RequestOutput:
        req = state.request
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=list(new_tokens),
            text=text,
            finished=finished,
            finish_reason=req.finish_reason if finished else None,
            stop_reason=req.stop_reason if finished else None,
            new_logprobs=logprobs or [],
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(req.output_token_ids),
            num_cached_tokens=req.num_cached_tokens,
            error=req.error,
            metrics=RequestMetrics(
                arrival_time=req.arrival_time,
                first_scheduled_time=req.first_scheduled_time,
                first_token_time=req.first_token_time,
                finished_time=time.monotonic() if finished else None,
            ),
        )

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        loras: list[LoRARequest | None] | None = None,
    ) -> list[list[int]]:
        """Offline helper: run prompts to completion, return each one's output token ids."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        llist = loras if loras is not None else [None] * len(prompts)
        ids = [f"offline-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        for rid, p, sp, lora in zip(ids, prompts, plist, llist, strict=True):
            self.add_request(rid, p, sp, lora)
        result: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for out in self.step():
                if out.request_id in result:
                    result[out.request_id].extend(out.new_token_ids)
        return [result[rid] for rid in ids]

    def warmup(self) -> None:
        """One short request through every stage, so the first user request pays no start-up cost."""
        prompt = self.tokenizer.encode("Hello") or [0]
        self.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))


_STOP = object()


@dataclass(frozen=True)
class _AddCommand:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora: LoRARequest | None = None


class AsyncEngine:
    """Runs LLMEngine.step() on a dedicated thread. Commands (add, abort) cross into that thread through
    a queue and take effect before the next step; outputs cross back with call_soon_threadsafe."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stopping = False
        self.error: BaseException | None = None
        self.last_stats: SchedulerStats = engine.stats()
        self.steps = 0
        self._counter = 0

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._stopping = True
        self._commands.put(("stop", _STOP))
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    # ---- called from the event loop ------------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        lora: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs; the last has finished=True. Leaving the iteration early
        (client disconnect, cancellation) aborts the request."""
        if not self.alive:
            raise EngineDeadError(f"engine loop is not running: {self.error!r}")
        if request_id is None:
            self._counter += 1
            request_id = f"req-{self._counter}-{time.monotonic_ns()}"
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.engine.validate(prompt_token_ids, params, lora)
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        self._commands.put(("add", _AddCommand(request_id, prompt_token_ids, params, lora)))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    # ---- the engine thread ------------------------------------------------------------------
    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(item)

    def _post(self, request_id: str, item: RequestOutput | BaseException) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._deliver, request_id, item)

    def _drain_commands(self) -> bool:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return True
            if kind == "stop":
                return False
            if kind == "add":
                assert isinstance(payload, _AddCommand)
                try:
                    self.engine.add_request(
                        payload.request_id, payload.prompt_token_ids, payload.params, payload.lora
                    )
                except ValueError as e:
                    self._post(payload.request_id, e)
            elif kind == "abort":
                out = self.engine.abort_request(str(payload))
                if out is not None:
                    self._post(out.request_id, out)

    def _run(self) -> None:
        try:
            while self._drain_commands():
                if not self.engine.has_unfinished():
                    self.last_stats = self.engine.stats()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                self.steps += 1
                self.last_stats = self.engine.stats()
                for out in outputs:
                    self._post(out.request_id, out)
        except BaseException as e:
            log.exception("engine loop died")
            self.error = e
            dead = EngineDeadError(f"engine loop died: {type(e).__name__}: {e}")
            if self._loop is not None and not self._loop.is_closed():
                for rid in list(self._streams):
                    self._post(rid, dead)


@dataclass
class EngineHandle:
    """What the HTTP layer holds: the async engine once loaded, and whether loading failed."""

    engine: AsyncEngine | None = None
    load_error: BaseException | None = None
    extra: dict[str, object] = field(default_factory=dict)
