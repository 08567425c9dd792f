"""What the HTTP layer knows about the server: loading phase, the engine, limits, admission and drain."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request

from server.config import ServerConfig
from server.core.outputs import SchedulerStats
from server.engine import AsyncEngine, LLMEngine
from server.metrics import ServerMetrics
from server.pooling.engine import PoolingEngine
from server.pooling.model import PoolingTask, load_pooling_model, pooling_dtypes, resolve_task

from .errors import APIError, ErrorKind
from .response_store import ResponseStore

log = logging.getLogger(__name__)

EMBEDDED_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


class Phase(enum.StrEnum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


def expected_model_name(config: ServerConfig) -> str:
    """The name the engine will report, known before loading (metrics labels must not change later)."""
    mc = config.engine.model
    if mc.served_model_name:
        return mc.served_model_name
    if not mc.model:
        return EMBEDDED_MODEL_ID
    path = Path(mc.model).expanduser()
    return path.stem if path.suffix == ".gguf" else path.name


@dataclass(frozen=True)
class Limits:
    """Token limits the API enforces (TGI's max_input_tokens / max_total_tokens)."""

    max_input_tokens: int
    max_total_tokens: int


class Slot:
    """One admitted request's share of --max-concurrent-requests; released exactly once."""

    def __init__(self, state: ServerState) -> None:
        self._state = state
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._state.in_flight -= 1


class ServerState:
    def __init__(self, config: ServerConfig, engine_factory: Callable[[], LLMEngine] | None = None) -> None:
        self.config = config
        self.phase = Phase.LOADING
        self.llm: LLMEngine | None = None
        self.engine: AsyncEngine | None = None
        self.load_error: BaseException | None = None
        self.limits: Limits | None = None
        self.in_flight = 0
        # Set at the drain deadline: why requests still running are being cut (their 503 / error event)
        self.cut_reason: str | None = None
        self.started_at = time.time()
        self.model_name = expected_model_name(config)
        mc = config.engine.model
        # generate | embed | score; a pooling task is served by `pooling` instead of `engine`
        self.task = resolve_task(mc.model, mc.task)
        self.pooling: PoolingEngine | None = None
        self._engine_factory = engine_factory or (lambda: LLMEngine(config.engine))
        self.on_load_failed: Callable[[BaseException], None] | None = None
        # Called on the event loop when the engine loop dies after loading (the server then exits 1).
        self.on_engine_dead: Callable[[BaseException], None] | None = None
        self.metrics = ServerMetrics(
            self.model_name,
            self._stats,
            lambda: self.in_flight,
            lambda: self.phase is Phase.READY and self.alive,
        )
        self.metrics.task = self.task
        # the Responses API's stored responses (server/api/responses.py)
        self.responses_store = ResponseStore(config.responses_store)

    def _stats(self) -> SchedulerStats | None:
        if self.pooling is not None:  # the same scheduler's stats (server/pooling/engine.py)
            return self.pooling.engine.last_stats
        return self.engine.last_stats if self.engine is not None else None

    # ---- lifecycle ----------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """Liveness: the process can still serve (loading counts), i.e. neither loading nor the loop failed."""
        if self.phase is Phase.FAILED:
            return False
        if self.pooling is not None:
            return self.pooling.alive
        return self.engine is None or self.engine.alive

    @property
    def ready(self) -> bool:
        if self.pooling is not None:
            return self.phase is Phase.READY and self.pooling.alive
        return self.phase is Phase.READY and self.engine is not None and self.engine.alive

    def start_loading(self) -> None:
        """Loads and warms the model on a thread while the event loop serves probes."""
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._load, args=(loop,), name="model-loader", daemon=True).start()

    def _load(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            mc = self.config.engine.model
            log.info(
                "loading model %s (dtype %s, quantization %s)",
                mc.model or f"{EMBEDDED_MODEL_ID} (embedded)",
                mc.dtype,
                mc.quantize or "none",
            )
            t0 = time.monotonic()
            if self.task != "generate":
                self._load_pooling(loop)
                return
            llm = self._engine_factory()
            log.info("model loaded in %.1f s; warming up", time.monotonic() - t0)
            t1 = time.monotonic()
            llm.warmup()
            log.info("warm-up done in %.1f s", time.monotonic() - t1)
        except BaseException as e:
            log.exception("model loading failed")
            loop.call_soon_threadsafe(self._fail, e)
            return
        asyncio.run_coroutine_threadsafe(self._attach(llm), loop)

    def _load_pooling(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the loader thread: the pooling model and its engine (server/pooling/); errors go to _load."""
        mc = self.config.engine.model
        folder = Path(mc.model).expanduser() if mc.model else None
        if folder is not None and folder.suffix == ".gguf" and folder.is_file():
            from server.config import default_cache_dir
            from server.models.gguf_embedder import gguf_embedder_folder

            folder = gguf_embedder_folder(folder, mc.cache_dir or default_cache_dir())
        if folder is None or not folder.is_dir():
            raise ValueError(f"--task {self.task} needs a local model folder or GGUF file (got {mc.model!r})")
        ec = self.config.engine
        if ec.device not in ("auto", "cpu"):
            raise ValueError(f"--task {self.task} runs on the CPU only (got --device {ec.device})")
        model = load_pooling_model(folder, PoolingTask(self.task), **pooling_dtypes(mc.dtype))
        engine = PoolingEngine(
            model,
            ec.max_num_seqs,
            max(ec.max_num_batched_tokens, model.max_model_len),
            ec.num_threads,
            adaptive_threads=ec.thread_policy == "adaptive",
            step_tokens=ec.pooling_step_tokens,
        )
        engine.warmup()
        loop.call_soon_threadsafe(self.attach_pooling, engine)

    def attach_pooling(self, engine: PoolingEngine) -> None:
        """Must run on the event loop (AsyncEngine.start binds to it)."""
        loop = asyncio.get_running_loop()

        def on_dead(e: BaseException) -> None:  # on the engine thread
            loop.call_soon_threadsafe(self._engine_died, e)

        engine.engine.on_dead = on_dead
        engine.start()
        self.pooling = engine
        self.metrics.pooling_source = lambda: dataclasses.asdict(engine.stats)
        max_total = min(
            self.config.max_total_tokens or engine.model.max_model_len, engine.model.max_model_len
        )
        self.limits = Limits(max_input_tokens=max_total, max_total_tokens=max_total)
        if self.phase is Phase.LOADING:
            self.phase = Phase.READY
        log.info(
            "ready: model=%s task=%s parameters=%.1fM max_input_tokens=%d url=http://%s:%d",
            self.model_name,
            self.task,
            engine.model.num_parameters / 1e6,
            max_total,
            self.config.host,
            self.config.port,
        )

    def _fail(self, e: BaseException) -> None:
        self.load_error = e
        self.phase = Phase.FAILED
        if self.on_load_failed is not None:
            self.on_load_failed(e)

    def _engine_died(self, e: BaseException) -> None:
        if self.on_engine_dead is not None:
            self.on_engine_dead(e)

    async def _attach(self, llm: LLMEngine) -> None:
        self.attach(llm)

    def attach(self, llm: LLMEngine) -> None:
        """Must run on the event loop (AsyncEngine.start binds to it)."""
        engine = AsyncEngine(llm, batch_wait_s=llm.config.batch_wait_ms / 1000)
        loop = asyncio.get_running_loop()

        def on_dead(e: BaseException) -> None:  # on the engine thread
            loop.call_soon_threadsafe(self._engine_died, e)

        engine.on_dead = on_dead
        engine.start()
        self.llm = llm
        self.engine = engine
        self.model_name = llm.info.served_model_name
        self.metrics.model_name = self.model_name
        self.metrics.structured_source = llm.structured_stats
        pub = llm.kv_events
        if pub is not None:
            self.metrics.kv_events_source = lambda: (pub.num_published, pub.num_dropped)
        if llm.lora is not None:
            self.metrics.max_lora = llm.config.lora.max_loras
        self.metrics.cache_config = {
            "block_size": str(llm.info.block_size),
            "num_gpu_blocks": str(llm.info.num_kv_blocks),  # vLLM's name, whatever the device
            "cache_dtype": llm.info.kv_cache_dtype,
            "enable_prefix_caching": str(llm.config.cache.enable_prefix_caching),
        }
        # A request longer than the whole KV cache could never be scheduled: cap the API's limit there,
        # so that defaults (max_new_tokens absent) stay servable.
        kv_tokens = llm.info.num_kv_blocks * llm.info.block_size
        max_total = min(self.config.max_total_tokens or llm.max_model_len, llm.max_model_len, kv_tokens)
        if self.config.max_total_tokens and max_total < self.config.max_total_tokens:
            log.warning(
                "--max-total-tokens %d lowered to %d: the KV cache holds %d tokens and the model %d",
                self.config.max_total_tokens,
                max_total,
                kv_tokens,
                llm.max_model_len,
            )
        max_input = self.config.max_input_tokens or max_total - 1
        self.limits = Limits(max_input_tokens=min(max_input, max_total - 1), max_total_tokens=max_total)
        if self.phase is Phase.LOADING:
            self.phase = Phase.READY
        info = llm.info
        log.info(
            "ready: model=%s architecture=%s dtype=%s quantization=%s parameters=%.1fM weights=%.1fMiB "
            "kv_blocks=%d of %s "
            "(block_size=%d, %d tokens) max_concurrent_sequences=%d max_concurrent_requests=%d "
            "max_input_tokens=%d max_total_tokens=%d attention=%s device=%s url=http://%s:%d",
            info.served_model_name,
            info.architecture,
            info.dtype,
            info.quantization or "none",
            info.num_parameters / 1e6,
            info.weight_bytes / 2**20,
            info.num_kv_blocks,
            info.kv_cache_dtype,
            info.block_size,
            info.num_kv_blocks * info.block_size,
            info.max_num_seqs,
            self.config.max_concurrent_requests,
            self.limits.max_input_tokens,
            self.limits.max_total_tokens,
            info.attention_backend,
            info.device,
            self.config.host,
            self.config.port,
        )

    # ---- admission and drain --------------------------------------------------------------------
    def admit(self, task: str = "generate") -> Slot:
        """Admits a request for `task` (generate, embed, score) or raises at once (no waiting queue in
        front of the engine); a request for another task than the model's is a 400."""
        if task != self.task:
            raise APIError(
                ErrorKind.VALIDATION,
                f"the served model {self.model_name} serves task {self.task!r}, not {task!r} "
                "(the server's --task)",
            )
        if self.phase is Phase.LOADING:
            raise APIError(ErrorKind.UNAVAILABLE, "the model is still loading; retry when /ready returns 200")
        if self.phase is Phase.DRAINING:
            raise APIError(ErrorKind.UNAVAILABLE, "the server is shutting down")
        if self.phase is Phase.FAILED or not self.alive or (self.engine is None and self.pooling is None):
            raise APIError(ErrorKind.INCOMPLETE, "the engine is not running")
        if self.in_flight >= self.config.max_concurrent_requests:
            raise APIError(
                ErrorKind.OVERLOADED,
                f"Model is overloaded: {self.in_flight} requests in flight "
                f"(--max-concurrent-requests {self.config.max_concurrent_requests})",
            )
        self.in_flight += 1
        return Slot(self)

    def begin_drain(self) -> None:
        if self.phase in (Phase.READY, Phase.LOADING):
            log.info("draining: %d request(s) in flight; new requests get 503", self.in_flight)
            self.phase = Phase.DRAINING

    def cut_in_flight(self, reason: str) -> int:
        """At the drain deadline: every engine request still running (and any that would start now)
        ends as an UNAVAILABLE APIError with `reason` (generation.stream_engine). Returns how many
        admitted requests there were."""
        self.cut_reason = reason
        if self.engine is not None:
            self.engine.abort_all()
        if self.pooling is not None:
            self.pooling.abort_all()
        return self.in_flight

    async def wait_drained(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.in_flight == 0

    async def shutdown(self) -> None:
        if self.pooling is not None:
            await self.pooling.shutdown()
        if self.engine is not None:
            await self.engine.shutdown()


def server_state(request: Request) -> ServerState:
    """The ServerState the app factory attached to the app."""
    state: ServerState = request.app.state.server
    return state
