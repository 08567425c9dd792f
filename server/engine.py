"""LLMEngine (synchronous step loop) and AsyncEngine (the step loop on its own thread, an async
stream per request, add/abort from any coroutine)."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import torch

from server.attention import make_attention_backend
from server.attention.kv_cache_dtype import check_int8_kv_cache, dtype_name, resolve_kv_cache_dtype
from server.config import EngineConfig
from server.core.burst_bound import BurstBound
from server.core.finish import decide_finish
from server.core.kv_cache_manager import KVCacheManager
from server.core.kv_groups import KVLayout, plan_engine_kv
from server.core.outputs import RequestMetrics, RequestOutput, SchedulerStats
from server.core.prefill_cap import AdaptivePrefillCap, step_shape
from server.core.scheduler import Scheduler, SchedulerConfig
from server.core.step_threads import StepThreads
from server.cpu_env import release_free_heap
from server.distributed.driver import TensorParallelDriver
from server.distributed.sharding import rank_loading, rank_loading_slicer
from server.kv_events import KVEventPublisher, make_publisher
from server.lora.manager import LoRAManager
from server.lora.registry import LoRARegistry
from server.memory_estimate import MemoryEstimate
from server.memory_report import check_memory, serving_estimate
from server.models.loader import (
    LoadedModel,
    ModelSource,
    load_gguf_model,
    load_model,
    resolve_dtype,
    resolve_model,
)
from server.models.moe.quant import pack_moe_int8_weights
from server.models.serving_weights import prepare_for_serving
from server.quant.block_linear import BF16_GEMM_MIN_ROWS
from server.quant.cpu_qgemv_q8 import int8_paths_text
from server.quant.cpu_qk_native import amx_tiles_text
from server.quant.cpu_qlinear import BF16_GEMV_MAX_ROWS, INT8_ACTIVATION_DTYPES
from server.quant.gemm_dtype import apply_gemm_dtype, cpu_gemm_dtype, pack_int8_weights
from server.quant.gguf_checkpoint import DequantizedTensor, q8_tiles_enabled, super_blocks_enabled
from server.request import (
    FinishReason,
    GrammarSpec,
    LoRARequest,
    PoolingParams,
    Request,
    SamplingParams,
)
from server.spec_decode.draft_model import load_draft_proposer
from server.spec_decode.proposer import Speculator
from server.structured import GrammarCompiler, StructuredOutputManager, compile_stats
from server.tokenizer import IncrementalDetokenizer, Tokenizer, shipped_chat_template
from server.worker.model_runner import ModelRunner, kv_bytes_per_block

log = logging.getLogger(__name__)


def _chat_template(path: str | None) -> str | None:
    """The text of a --chat-template file; None keeps the model's own (or the shipped one, see Tokenizer)."""
    if path is None:
        return None
    from pathlib import Path

    try:
        return Path(path).read_text()
    except OSError as e:
        raise ValueError(f"cannot read the chat template {path}: {e}") from None


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
    gemm_dtype: str = "float32"  # block-quantized projections' large GEMMs (server/quant/gemm_dtype.py)
    # the int8 batched path's packed copies of block-quantized weights (gemm_dtype.pack_int8_weights), bytes
    # resident beside weight_bytes
    packed_weight_bytes: int = 0
    kv_cache_dtype: str = "float32"  # the KV cache's element type (server/attention/kv_cache_dtype.py)
    # a GGUF served as it is: the tensors held as fp32 because no kept layout takes their type (/info)
    gguf_dequantized: tuple[DequantizedTensor, ...] | None = None
    # where the memory goes, estimated from the files before loading (server/memory_estimate.py)
    memory: MemoryEstimate | None = None
    # the KV cache's layer groups (server/core/kv_groups.py): one, or full-attention layers beside
    # sliding-window ones, each group with its own block count (/info's kv_groups)
    kv_layout: KVLayout | None = None


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
        # A GGUF model is served as it is (quantized) on CPU unless a --dtype or --quantize asks otherwise,
        # or tensor parallelism, which shards dense layers only.
        serve_gguf = (
            self.device.type == "cpu"
            and config.model.dtype == "auto"
            and config.model.quantize is None
            and config.parallel.tensor_parallel_size == 1
        )
        self.source: ModelSource = resolve_model(
            config.model.model, config.model.cache_dir, keep_gguf=serve_gguf
        )
        dtype = (
            torch.float32 if self.source.gguf is not None else resolve_dtype(config.model.dtype, self.device)
        )
        from server.models.loader import read_hf_config

        max_pos = int(read_hf_config(self.source.folder).get("max_position_embeddings", 2048))
        self.max_model_len = config.model.max_model_len or min(max_pos, 8192)
        # Before any weight is read: a limit that cannot hold them fails here, not as an OOM kill.
        compute_name = str(
            resolve_dtype(config.model.dtype, self.device) if self.source.gguf is not None else dtype
        ).removeprefix("torch.")
        # Block-quantized projections' GEMM dtype where --dtype resolves to bf16 (auto: CPUs with native bf16),
        # int8 activations for auto on AVX512-VNNI or AVX2 CPUs without it; activations stay fp32 around them
        # (server/quant/gemm_dtype.py). Not under tensor parallelism: the other ranks load their own shards
        # and would sum partials of another precision.
        tp = config.parallel.tensor_parallel_size
        self.gemm_dtype = torch.float32
        if self.device.type == "cpu" and tp == 1:
            compute = (
                resolve_dtype(config.model.dtype, self.device) if self.source.gguf is not None else dtype
            )
            self.gemm_dtype = cpu_gemm_dtype(compute, config.model.dtype)
        # the layout the loader will hold a GGUF's quantized tensors in here (read_gguf_checkpoint)
        gguf_tiles = (
            self.source.gguf is not None
            and self.device.type == "cpu"
            and super_blocks_enabled(self.gemm_dtype)
        )
        self.memory = serving_estimate(
            config,
            self.source.gguf or self.source.folder,
            compute_name,
            self.max_model_len,
            gguf_tiles,
            gguf_tiles and q8_tiles_enabled(),
        )
        if self.device.type == "cpu":
            check_memory(self.memory)
        if self.source.gguf is not None:
            self.loaded: LoadedModel = load_gguf_model(
                self.source.gguf,
                self.source.folder,
                self.device,
                self.max_model_len,
                config.model.cache_dir,
                self.gemm_dtype,
            )
        else:
            tp = config.parallel.tensor_parallel_size
            # TP: rank 0 reads only its slices of the checkpoint (server/distributed/sharding.py)
            slicer = rank_loading_slicer(self.source.folder, config.model.quantize, 0, tp) if tp > 1 else None
            with rank_loading(tp):
                self.loaded = load_model(
                    self.source.folder, dtype, self.device, self.max_model_len, config.model.quantize, slicer
                )
        tp = config.parallel.tensor_parallel_size
        self.tp: TensorParallelDriver | None = None
        if tp > 1:  # rank 0 of N: start ranks 1..N-1, keep this rank's shard (server/distributed/)
            self.tp = TensorParallelDriver(config, self.device, self.loaded.model)
        # Each CPU step's intra-op thread count, measured per step size (server/core/step_threads.py):
        # on cores shared with other processes (or our own event loop) fewer threads can be several
        # times faster. Not under tensor parallelism, whose ranks keep their own counts.
        self.step_threads: StepThreads | None = None
        self.last_step_threads = torch.get_num_threads()
        if self.device.type == "cpu" and self.tp is None:
            self.step_threads = StepThreads(
                torch.get_num_threads(),
                explore_every=16,
                max_explore_every=256,
                adaptive=config.thread_policy == "adaptive",
            )
        if config.model.optimize_weights:
            prepare_for_serving(self.loaded.model, self.device, dtype, config.model.cache_dir)
        self.packed_weight_bytes = 0  # int8 packed copies of block-quantized weights (pack_int8_weights)
        # what the copies must leave free: the KV cache, allocated after them, whose untouched pages would
        # still read as available (a pod's limit sized from the estimate counts weights, KV and runtime only)
        kv_reserve = self.memory.kv_cache_bytes if self.memory is not None else 0
        quantized_gemms = (
            self.device.type == "cpu" and tp == 1 and apply_gemm_dtype(self.loaded.model, self.gemm_dtype)
        )
        if self.gemm_dtype == torch.int8 and not quantized_gemms:
            self.gemm_dtype = torch.float32  # nothing block-quantized: the model computes in fp32
        if quantized_gemms and self.gemm_dtype != torch.float32:
            self.packed_weight_bytes = pack_int8_weights(self.loaded.model, kv_reserve)
            self.packed_weight_bytes += pack_moe_int8_weights(self.loaded.model, kv_reserve)
            if self.packed_weight_bytes:
                log.info(
                    "int8 batches read packed weights (%.1f MiB more: /info packed_weight_bytes)",
                    self.packed_weight_bytes / 2**20,
                )
            int8 = int8_paths_text(config.model.cache_dir)
            if self.gemm_dtype == torch.int8:
                paths = ["the GGUF's 16-row tiles"] if gguf_tiles else []
                log.info(
                    "block-quantized GEMMs take int8 activations where their kernels have them (%s), "
                    "float32 elsewhere: no native bf16 here (KUBEINFER_INT8_GEMV=0 KUBEINFER_INT8_GEMM=0 "
                    "KUBEINFER_KQUANT_BLOCKS=0 keep fp32 activations; --dtype float32 also dequantizes a GGUF)",
                    "; ".join([*paths, int8] if int8 else paths) or "none here",
                )
            else:
                log.info(
                    "block-quantized GEMMs of %d+ rows in bfloat16 (the kernel's AVX512-BF16 path where usable; "
                    "dequantize + GEMM from %d rows)%s",
                    BF16_GEMV_MAX_ROWS + 1,
                    BF16_GEMM_MIN_ROWS,
                    f"; int8 activations instead for {int8}" if int8 else "",
                )
                amx = amx_tiles_text(config.model.cache_dir) if gguf_tiles else ""
                if amx:
                    log.info("%s", amx)
        template = _chat_template(config.model.chat_template)
        if template is None and config.model.model is None:
            # The embedded SmolLM2's own template knows no tools; ours renders the same without them.
            template = shipped_chat_template("smollm2_tools")
        self.tokenizer = Tokenizer(
            self.source.folder,
            chat_template=template,
            special_tokens_in_content=config.model.allow_special_tokens_in_content,
        )
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
        compute = resolve_dtype(config.model.dtype, self.device) if self.source.gguf is not None else dtype
        self.kv_cache_dtype = resolve_kv_cache_dtype(
            config.cache.cache_dtype, dtype, compute, self.device.type
        )
        backend = make_attention_backend(
            config.attention_backend, block_size, self.device.type, config.model.cache_dir
        )
        self.backend_name = backend_name = backend.name
        check_int8_kv_cache(
            self.kv_cache_dtype, getattr(backend, "decode_kernel", None), self.loaded.model.config.head_dim
        )
        eos = set(self.loaded.arch.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        # Compiles structured-output grammars (the API compiles off the event loop, before admission).
        self.grammars = GrammarCompiler(self.tokenizer.hf, self.loaded.arch.vocab_size, sorted(eos))
        block_bytes = kv_bytes_per_block(self.loaded.model, block_size, self.kv_cache_dtype)
        # Windowed layers beside global ones get their own group (server/core/kv_groups.py); tensor
        # parallel ranks plan the same cache from the same per-rank shapes (distributed/worker.py).
        plan = plan_engine_kv(
            [spec.sliding_window for spec in self.loaded.arch.layers],
            block_bytes,
            config.cache.num_kv_blocks,
            config.cache.kv_cache_memory_bytes,
            block_size,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
        )
        num_blocks, layout = plan.num_blocks, plan.layout
        log.info("KV cache: %d blocks of %s", num_blocks, dtype_name(self.kv_cache_dtype))
        if len(layout.groups) > 1:
            log.info(
                "KV cache groups: %d blocks for the full-attention layers, %d for the sliding-window layers "
                "(window %s)",
                layout.groups[0].num_blocks,
                layout.groups[1].num_blocks,
                layout.groups[1].sliding_window,
            )
        self.runner = ModelRunner(
            self.loaded.model,
            backend,
            num_blocks,
            block_size,
            self.kv_cache_dtype,
            self.device,
            structured=StructuredOutputManager(self.grammars),
            lora=lora_manager,
            logprobs_mode=config.model.logprobs_mode,
            layout=layout,
        )
        if self.tp is not None:
            self.tp.wait_ready(layout)
        # KV-cache events: the block pool records them, step() hands them to the publisher's queue.
        self.kv_events: KVEventPublisher | None = make_publisher(config.kv_events)
        self.kv = KVCacheManager(
            num_blocks,
            block_size,
            config.cache.enable_prefix_caching,
            record_events=self.kv_events is not None,
            groups=layout.groups,
        )
        # The prefill share cap sized from this engine's measured step costs (server/core/prefill_cap.py).
        cap = config.prefill_cap_for(self.device.type) if config.enable_chunked_prefill else None
        if cap is None and config.prefill_itl_min_tokens is not None:
            log.warning(
                "--prefill-itl-min-tokens has no effect here: the measured prefill cap is off on %s%s "
                "(--prefill-itl-factor F turns it on)",
                self.device.type,
                "" if config.enable_chunked_prefill else " without chunked prefill",
            )
        burst = config.burst_bound_config()
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                long_prefill_token_threshold=config.long_prefill_threshold_for(self.device.type),
                scheduling_policy=config.scheduling_policy,  # type: ignore[arg-type]  # EngineConfig validated it
                max_loras=config.lora.max_loras if config.lora.enable_lora else 0,
            ),
            self.kv,
            prefill_cap=AdaptivePrefillCap(cap) if cap is not None else None,
            # A burst step's prompt tokens bounded by its measured cost (server/core/burst_bound.py).
            burst_bound=BurstBound(burst) if burst is not None else None,
        )
        self.speculator: Speculator | None = None
        if config.speculative is not None:
            proposer = None
            if config.speculative.method == "draft_model":  # the draft's own model and paged KV cache
                proposer = load_draft_proposer(
                    config.speculative,
                    self.loaded,
                    self.tokenizer,
                    backend,
                    num_blocks=num_blocks,
                    block_size=block_size,
                    max_model_len=self.max_model_len,
                    device=self.device,
                    cache_dir=config.model.cache_dir,
                    keep_gguf=self.source.gguf is not None,
                    gemm_dtype=self.gemm_dtype,
                    optimize_weights=config.model.optimize_weights,
                    kv_cache_dtype=self.kv_cache_dtype,
                )
            # (apply_gemm_dtype runs for any proposer: it sets the dtype of its projections and quantized
            # experts alike; packing follows bf16 only)
            if (
                proposer is not None
                and apply_gemm_dtype(proposer.model, self.gemm_dtype)
                and self.gemm_dtype in INT8_ACTIVATION_DTYPES
            ):
                self.packed_weight_bytes += pack_int8_weights(proposer.model, kv_reserve)
            self.speculator = Speculator(config.speculative, proposer)
        if self.speculator is not None:
            log.info("speculative decoding: %s", config.speculative)
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
            kv_layout=layout,
            max_model_len=self.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            attention_backend=backend_name,
            device=str(self.device),
            gemm_dtype=str(self.gemm_dtype).removeprefix("torch."),
            packed_weight_bytes=self.packed_weight_bytes,
            kv_cache_dtype=dtype_name(self.kv_cache_dtype),
            gguf_dequantized=self.loaded.gguf_dequantized,
            memory=self.memory,
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
        pooling: PoolingParams | None = None,
        priority: int = 0,
    ) -> Request:
        if pooling is not None:
            raise ValueError(
                "this engine serves a generative model; pooling requests need --task embed/score"
            )
        self.validate(prompt_token_ids, params, lora)
        if params.structured is not None:
            self.grammars.compile(params.structured)  # a cache hit when the API compiled it first
        req = Request(
            request_id,
            list(prompt_token_ids),
            params,
            eos_token_ids=self.eos_token_ids,
            lora=lora,
            priority=priority,
        )
        self.scheduler.add_request(req)
        self._states[request_id] = _RequestState(
            req, IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params)
        )
        return req

    def check_priority(self, priority: int) -> None:
        self.scheduler.check_priority(priority)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.finish_request(request_id, FinishReason.ABORT)
        if self.speculator is not None:
            self.speculator.drop(request_id)
        state = self._states.pop(request_id, None)
        if req is None or state is None:
            return None
        return self._output(state, [], "", finished=True)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def structured_stats(self) -> dict[str, float]:
        """Cumulative grammar figures: mask seconds and rows (engine thread), compiles (any thread)."""
        mask = self.runner.structured.stats if self.runner.structured is not None else None
        return {
            "mask_seconds": mask.seconds if mask else 0.0,
            "mask_rows": float(mask.rows) if mask else 0.0,
            "mask_steps": float(mask.steps) if mask else 0.0,
            "compile_seconds": compile_stats.compile_seconds,
            "compiled": float(compile_stats.compiled),
            "cache_hits": float(compile_stats.cache_hits),
        }

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix block (vLLM's reset_prefix_cache). False, changing nothing,
        while any request holds blocks."""
        ok = self.kv.reset_prefix_cache()
        self._publish_kv_events()
        return ok

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None:
            events = self.kv.pool.take_events()
            if events:
                self.kv_events.publish(events)

    # ---- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if self.tp is not None:
            self.tp.broadcast(sched)
        t0 = time.perf_counter()
        if self.step_threads is not None and not sched.is_empty:
            threads = self.step_threads.choose(sched.num_batched_tokens)
            torch.set_num_threads(threads)
            model_out = self.runner.execute(sched)
            self.step_threads.record(sched.num_batched_tokens, threads, time.perf_counter() - t0)
            self.last_step_threads = threads
        else:
            model_out = self.runner.execute(sched)
        if not sched.is_empty:
            shape, seconds = step_shape(sched), time.perf_counter() - t0
            if self.scheduler.prefill_cap is not None:
                self.scheduler.prefill_cap.observe(shape, seconds)
            if self.scheduler.burst_bound is not None:
                self.scheduler.burst_bound.observe(shape, seconds)
        self.scheduler.update_from_output(sched, model_out)
        self._publish_kv_events()
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
            token_texts: list[str] = []
            try:
                if new_tokens:
                    upd = state.detok.push(new_tokens, drop_last=self._stopped_by_token(req))
                    text, token_texts = upd.text, upd.token_texts
                    if upd.stop_string is not None and upd.stop_index is not None:
                        keep = upd.stop_index + 1
                        if self._finish_by_stop_string(req, new_tokens, upd.stop_index, upd.stop_string):
                            # a stop string that ends inside a run of accepted draft tokens cuts the run
                            new_tokens, token_texts = new_tokens[:keep], token_texts[:keep]
                            state.num_sent = len(req.output_token_ids)
                if req.is_finished:
                    text += state.detok.flush()
            except Exception as e:  # one request's detokenization must not take the batch down
                log.exception("detokenization failed for request %s", rid)
                req.error = f"detokenization failed: {type(e).__name__}: {e}"
                self.scheduler.finish_request(rid, FinishReason.ERROR)
            lps = [model_out.logprobs[rid]] if rid in model_out.logprobs and new_tokens else []
            out = self._output(state, new_tokens, text, finished=req.is_finished, logprobs=lps)
            out.new_token_texts = token_texts if len(token_texts) == len(new_tokens) else []
            out.prompt_logprobs = prompt_lps
            outputs.append(out)
            if req.is_finished:
                del self._states[rid]
        if self.speculator is not None:  # after stop strings have ended their requests
            self.speculator.propose(self.scheduler.running)
        return outputs

    @staticmethod
    def _stopped_by_token(req: Request) -> bool:
        """The last token ended the request by itself (EOS or a stop id): its text stays out of the
        output unless include_stop_str_in_output (vLLM's rule for stop-terminated sequences)."""
        if not req.is_finished or req.finish_reason is not FinishReason.STOP:
            return False
        if req.sampling_params.include_stop_str_in_output:
            return False
        return not isinstance(req.stop_reason, str)

    def _finish_by_stop_string(self, req: Request, new_tokens: list[int], index: int, stop: str) -> bool:
        """The detokenizer found `stop` in the text of new_tokens[index]: decide_finish gives the
        verdict, which replaces a LENGTH finish the scheduler made on the same token. Tokens after
        new_tokens[index] (accepted drafts) are discarded. Returns whether the request stopped here."""
        num_out = len(req.output_token_ids) - len(new_tokens) + index + 1
        decision = decide_finish(
            req.sampling_params,
            new_tokens[index],
            num_out,
            req.num_prompt_tokens + num_out,
            self.max_model_len,
            req.eos_token_ids,
            stop_string=stop,
        )
        if decision is None or decision.reason is not FinishReason.STOP:
            return False
        tail = len(new_tokens) - index - 1  # accepted draft tokens after the stop (speculative decoding)
        if tail:
            self.scheduler.discard_output_tail(req, tail)
        if not req.is_finished:
            self.scheduler.finish_request(req.request_id, decision.reason, stop_reason=decision.stop_reason)
        elif tail or req.finish_reason is FinishReason.LENGTH:
            # EOS or the length limit later in the run, or on the same token: the stop string came first
            req.finish_reason = decision.reason
            req.stop_reason = decision.stop_reason
        return True

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

    def close(self, graceful: bool = True) -> None:
        """Flushes and closes the KV-event publisher and stops the tensor-parallel workers, if any;
        graceful only between steps."""
        if self.kv_events is not None:
            if graceful:
                self._publish_kv_events()
            self.kv_events.close()
        if self.tp is not None:
            self.tp.close(graceful)

    def check_health(self) -> None:
        """Called by the idle loop between steps: raises if a tensor-parallel rank died or hung."""
        if self.tp is not None:
            self.tp.heartbeat()

    def release_idle_memory(self) -> int | None:
        """Called once per idle spell by the engine loop (`IDLE_TRIM_S` after the last step): on CPU, hands
        the heap pages the steps freed back to the OS (`cpu_env.release_free_heap`, no garbage collection:
        it would hold the GIL from the HTTP loop). The heap keeps up to 256 MiB of freed blocks mapped for
        the next step (cpu_env, "Heap"), which is what a busy server wants and an idle one need not hold:
        glibc has no decay of its own (jemalloc's dirty_decay_ms). Returns the bytes released, None where
        nothing was tried (not CPU, not glibc)."""
        if self.device.type != "cpu":
            return None
        return release_free_heap(collect=False)

    def warmup(self) -> None:
        """One short request through every stage, so the first user request pays no start-up cost."""
        prompt = self.tokenizer.encode("Hello") or [0]
        self.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))
        try:  # builds the grammar library's tokenizer tables (~0.3 s) before the first constrained request
            self.grammars.compile(GrammarSpec("json_object"))
        except ValueError as e:
            log.warning("structured outputs unavailable: %s", e)
        if self.device.type == "cpu":
            # what loading and the warm-up freed (the tokenizer's parse above all) leaves the RSS
            released = release_free_heap()
            if released:
                log.info("returned %.0f MiB of freed heap to the OS after the warm-up", released / 2**20)


_STOP = object()


def _resolve(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)


@dataclass(frozen=True)
class _AddCommand:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora: LoRARequest | None = None
    pooling: PoolingParams | None = None
    priority: int = 0


class EngineCore(Protocol):
    """What AsyncEngine drives on its thread: LLMEngine, or server/pooling's PoolingEngineCore (the same
    scheduler, a pooling model's forward instead of the model runner)."""

    @property
    def speculator(self) -> Speculator | None: ...

    def validate(
        self, prompt_token_ids: list[int], params: SamplingParams, lora: LoRARequest | None = None
    ) -> None: ...

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lora: LoRARequest | None = None,
        pooling: PoolingParams | None = None,
        priority: int = 0,
    ) -> Request: ...

    def check_priority(self, priority: int) -> None: ...

    def abort_request(self, request_id: str) -> RequestOutput | None: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> SchedulerStats: ...

    def step(self) -> list[RequestOutput]: ...

    def reset_prefix_cache(self) -> bool: ...

    def check_health(self) -> None: ...

    def release_idle_memory(self) -> int | None: ...

    def close(self, graceful: bool = True) -> None: ...


E = TypeVar("E", bound=EngineCore)


_BURST_SPAN = 8  # the longest wait for a burst, in units of AsyncEngine.batch_wait_s
# seconds without a step before the engine loop hands the heap's freed pages back (release_idle_memory):
# far above the gaps inside a load (closed-loop users come back within milliseconds), so a busy server
# keeps its heap, and an idle one settles to its loaded size
IDLE_TRIM_S = 2.0


class AsyncEngine(Generic[E]):
    """Runs the engine's step() on a dedicated thread. Commands (add, abort) cross into that thread through
    a queue and take effect before the next step; outputs cross back with call_soon_threadsafe."""

    def __init__(self, engine: E, batch_wait_s: float = 0.0) -> None:
        if batch_wait_s < 0:
            raise ValueError(f"batch_wait_s must be >= 0, got {batch_wait_s}")
        self.engine = engine
        # Idle -> busy: the first step waits until arrivals pause this long (at most _BURST_SPAN times it
        # in all), so a burst of requests starts in one step (see _gather_burst).
        self.batch_wait_s = batch_wait_s
        self._commands: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stopping = False
        self.error: BaseException | None = None
        # Called on the engine thread once, when the loop dies (the server exits: see api/server.py).
        self.on_dead: Callable[[BaseException], None] | None = None
        self.last_stats: SchedulerStats = engine.stats()
        self.steps = 0
        self._counter = 0
        self._last_spec_log = time.monotonic()

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
        # between steps only when the loop ended cleanly; a dead or stuck loop may be inside a collective
        clean = self.error is None and (self._thread is None or not self._thread.is_alive())
        await asyncio.to_thread(self.engine.close, clean)

    # ---- called from the event loop ------------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        lora: LoRARequest | None = None,
        pooling: PoolingParams | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs; the last has finished=True. Leaving the iteration early
        (client disconnect, cancellation) aborts the request. `priority`: vLLM's (lower first), only
        under --scheduling-policy priority (else a non-zero one is a ValueError)."""
        if not self.alive:
            raise EngineDeadError(f"engine loop is not running: {self.error!r}")
        if request_id is None:
            self._counter += 1
            request_id = f"req-{self._counter}-{time.monotonic_ns()}"
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.engine.validate(prompt_token_ids, params, lora)
        self.engine.check_priority(priority)
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        self._commands.put(
            ("add", _AddCommand(request_id, prompt_token_ids, params, lora, pooling, priority))
        )
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

    def abort_all(self) -> int:
        """Aborts every request in flight (the drain deadline); each stream ends with FinishReason.ABORT.
        Returns how many there were."""
        ids = list(self._streams)
        for request_id in ids:
            self._commands.put(("abort", request_id))
        self._wake.set()
        return len(ids)

    async def reset_prefix_cache(self) -> bool:
        """Runs LLMEngine.reset_prefix_cache on the engine thread, between steps."""
        if not self.alive:
            raise EngineDeadError(f"engine loop is not running: {self.error!r}")
        assert self._loop is not None
        done: asyncio.Future[bool] = self._loop.create_future()
        self._commands.put(("reset_prefix_cache", done))
        self._wake.set()
        return await done

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
                        payload.request_id,
                        payload.prompt_token_ids,
                        payload.params,
                        payload.lora,
                        payload.pooling,
                        payload.priority,
                    )
                except ValueError as e:
                    self._post(payload.request_id, e)
            elif kind == "abort":
                out = self.engine.abort_request(str(payload))
                if out is not None:
                    self._post(out.request_id, out)
            elif kind == "reset_prefix_cache":
                assert isinstance(payload, asyncio.Future) and self._loop is not None
                ok = self.engine.reset_prefix_cache()
                self._loop.call_soon_threadsafe(_resolve, payload, ok)

    def _log_speculation(self, every_s: float = 10.0) -> None:
        now = time.monotonic()
        if self.engine.speculator is None or now - self._last_spec_log < every_s:
            return
        self._last_spec_log = now
        st = self.last_stats
        if st.spec_num_drafts:
            log.info(
                "speculative decoding: acceptance rate %.1f%%, mean acceptance length %.2f, "
                "%d drafts, %d draft tokens, %d accepted, per position %s",
                100.0 * st.spec_num_accepted_tokens / st.spec_num_draft_tokens,
                1.0 + st.spec_num_accepted_tokens / st.spec_num_drafts,
                st.spec_num_drafts,
                st.spec_num_draft_tokens,
                st.spec_num_accepted_tokens,
                list(st.spec_accepted_per_pos),
            )

    def _gather_burst(self) -> bool:
        """After an idle spell, waits for the rest of a burst of requests before the first step: until no
        command came for `batch_wait_s` (at most _BURST_SPAN times that in all). Returns False on "stop".

        Why: clients that arrive together (a load balancer's retry, a batch job, closed-loop users whose
        previous requests finished in the same step) reach the engine a few ms apart. Stepping on the
        first alone starts it decoding, and every later one is then prefilled beside it: each such step
        stalls the running streams, and the batch stays staggered for the rest of its life."""
        deadline = time.monotonic() + _BURST_SPAN * self.batch_wait_s
        while True:
            self._wake.clear()
            if self._commands.empty():
                left = deadline - time.monotonic()
                if left <= 0 or not self._wake.wait(min(self.batch_wait_s, left)):
                    return True
            if not self._drain_commands():
                return False

    def _run(self) -> None:
        try:
            idle = True
            idle_since: float | None = None  # the last step's end, until the idle spell's heap trim
            while self._drain_commands():
                if not self.engine.has_unfinished():
                    idle = True
                    self.last_stats = self.engine.stats()
                    self.engine.check_health()
                    if idle_since is not None and time.monotonic() - idle_since >= IDLE_TRIM_S:
                        idle_since = None
                        released = self.engine.release_idle_memory()
                        if released:
                            log.debug("idle: returned %.0f MiB of freed heap", released / 2**20)
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                if idle:
                    idle = False
                    if self.batch_wait_s > 0:
                        if not self._gather_burst():
                            break
                        continue  # the burst's aborts may have emptied the engine again
                outputs = self.engine.step()
                idle_since = time.monotonic()  # from the step's end: a long step is no idle spell
                self.steps += 1
                self.last_stats = self.engine.stats()
                self._log_speculation()
                for out in outputs:
                    self._post(out.request_id, out)
        except BaseException as e:
            log.exception("engine loop died")
            self.error = e
            dead = EngineDeadError(f"engine loop died: {type(e).__name__}: {e}")
            if self._loop is not None and not self._loop.is_closed():
                for rid in list(self._streams):
                    self._post(rid, dead)
            if self.on_dead is not None and not self._stopping:
                self.on_dead(e)


@dataclass
class EngineHandle:
    """What the HTTP layer holds: the async engine once loaded, and whether loading failed."""

    engine: AsyncEngine | None = None
    load_error: BaseException | None = None
    extra: dict[str, object] = field(default_factory=dict)
