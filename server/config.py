"""Frozen, validated configuration of the engine. (CLI and environment parsing: server/cli.py.)"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from server.core.burst_bound import BurstBoundConfig
from server.core.prefill_cap import PrefillCapConfig
from server.core.scheduler import SchedulerConfig
from server.spec_decode.config import SpeculativeConfig

QUANTIZE_CHOICES = (
    "awq",
    "gptq",
    "bitsandbytes",
    "bitsandbytes-nf4",
    "bitsandbytes-fp4",
    "fp8",
    "int8",
    "int4",
    "q8_0",  # GGUF's block formats, on CPU (server/quant/block_linear.py)
    "q4_0",
    "q4_1",
)


def default_cache_dir() -> Path:
    """Converted weights and built CPU kernels: $KUBEINFER_CACHE_DIR, else ~/.cache/kubeinfer."""
    env = os.environ.get("KUBEINFER_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kubeinfer"


DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
# vLLM's --kv-cache-dtype: auto, bfloat16 and float16 are vLLM's; float32 is ours (vLLM's CPU build keeps
# no fp32 cache), and int8 (CPU: a scale per 32 values, server/attention/int8_kv.py, as llama.cpp's
# q8_0 cache type). vLLM's fp8 formats are refused (server/attention/kv_cache_dtype.py).
KV_CACHE_DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32", "int8")
KV_CACHE_FP8_NAMES = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")
# vLLM's --logprobs-mode: what sampled-token logprobs report (server/worker/sampler.py)
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# --task: what the model serves (vLLM's former --task names; server/pooling/ serves embed and score)
TASK_CHOICES = ("auto", "generate", "embed", "score")
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
THREAD_POLICIES = ("adaptive", "fixed")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # HF folder, .gguf file, or None for the embedded SmolLM2
    dtype: str = "auto"
    quantize: str | None = None
    cache_dir: Path | None = None  # converted weights and built CPU kernels; None = default_cache_dir()
    served_model_name: str | None = None
    max_model_len: int | None = None  # None = min(model's max_position_embeddings, 8192)
    # Fuse q/k/v and gate/up and pre-pack CPU weights after loading (models/serving_weights.py).
    optimize_weights: bool = True
    # A Jinja chat template file replacing the model's (--chat-template); None = the model's own, or
    # for the embedded SmolLM2 the tool-aware server/templates/smollm2_tools.jinja.
    chat_template: str | None = None
    # Parse special-token strings inside chat messages as control tokens (--allow-special-tokens-in-
    # content); by default message content is tokenized as text (server/chat_tokens.py).
    allow_special_tokens_in_content: bool = False
    # What sampled-token logprobs report (vLLM's --logprobs-mode): raw_* = the model's own distribution,
    # processed_* = after penalties, the grammar's mask, temperature and top-k/top-p/min-p.
    logprobs_mode: str = "raw_logprobs"
    # auto = from config.json's architectures (BERT encoders embed, sequence classifiers score)
    task: str = "auto"

    def __post_init__(self) -> None:
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.task not in TASK_CHOICES:
            raise ValueError(f"task must be one of {TASK_CHOICES}, got {self.task!r}")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if self.quantize is not None and self.quantize not in QUANTIZE_CHOICES:
            raise ValueError(f"quantize must be one of {QUANTIZE_CHOICES}, got {self.quantize!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # None = from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 512 * 2**20
    enable_prefix_caching: bool = True
    # --kv-cache-dtype; auto = bf16 where --dtype resolves to bf16 compute, else the model's dtype
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.cache_dtype in KV_CACHE_FP8_NAMES:
            raise ValueError(
                f"--kv-cache-dtype {self.cache_dtype}: fp8 KV caches are not supported; "
                f"choose from {KV_CACHE_DTYPE_CHOICES}"
            )
        if self.cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(
                f"--kv-cache-dtype must be one of {KV_CACHE_DTYPE_CHOICES}, got {self.cache_dtype!r}"
            )
        if self.block_size < 1 or self.block_size > 256 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two in [1, 256], got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError("kv_cache_memory_bytes must be positive")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (server/distributed/): N processes, one per device, rank 0 in the server.

    Multi-node (a LeaderWorkerSet group of `nnodes` pods, docs/design.md): every pod runs N / nnodes
    ranks; pod `node_rank` 0 is the leader (HTTP API, rank 0), the others run the worker loop only.
    """

    tensor_parallel_size: int = 1  # N: ranks in the whole group (all nodes)
    # A collective (step broadcast, all-reduce) that waits longer than this raises: a hung rank ends the
    # engine loop (/health 503, exit) instead of stalling it. Start-up waits max(this, 600 s).
    distributed_timeout_s: float = 300.0
    nnodes: int = 1  # LWS_GROUP_SIZE
    node_rank: int = 0  # LWS_WORKER_INDEX
    master_addr: str = "127.0.0.1"  # LWS_LEADER_ADDRESS: rank 0's rendezvous store
    master_port: int | None = None  # None: a free port on one node, 29500 across nodes

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout_s must be > 0, got {self.distributed_timeout_s}")
        if self.nnodes < 1:
            raise ValueError(f"nnodes (LWS_GROUP_SIZE) must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"node_rank (LWS_WORKER_INDEX) must be in [0, {self.nnodes}), got {self.node_rank}"
            )
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size} must be a multiple of the number of "
                f"nodes ({self.nnodes}): every node runs the same number of ranks"
            )
        if self.master_port is not None and not 0 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be in [0, 65535], got {self.master_port}")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def is_leader(self) -> bool:
        """This process serves HTTP and holds rank 0."""
        return self.node_rank == 0

    @property
    def rendezvous_port(self) -> int:
        """The port rank 0's store listens on: 0 (any free one) on a single node unless set."""
        if self.master_port is not None:
            return self.master_port
        return 29500 if self.nnodes > 1 else 0


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` (a JSON object with these keys; unknown keys are refused).

    publisher: "null" (events off) or "zmq". endpoint: the PUB socket (`tcp://*:5557` binds; a
    concrete host connects). replay_endpoint: the ROUTER socket for late subscribers, or None.
    buffer_steps: batches kept for replay. hwm: the PUB socket's high-water mark (messages).
    max_queue_size: batches waiting for the sender thread before new ones are dropped."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in ("null", "zmq"):
            raise ValueError(f"kv-events publisher must be 'null' or 'zmq', got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv-events {name} must be >= 1, got {getattr(self, name)}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(
                    f"kv-events {name} must be a tcp://, ipc:// or inproc:// address, got {value!r}"
                )

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parses vLLM's JSON form, e.g. '{"enable_kv_cache_events": true, "publisher": "zmq"}'.
        Raises ValueError on bad JSON, unknown keys or bad values."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config is not valid JSON: {e}") from e
        if not isinstance(data, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown key(s) {unknown}; known: {sorted(known)}")
        try:
            return cls(**data)
        except TypeError as e:
            raise ValueError(f"--kv-events-config: {e}") from e


@dataclass(frozen=True)
class LoRAModule:
    """One --lora-modules entry: `name=path`, or vLLM's JSON form {"name", "path", "base_model_name"}."""

    name: str
    path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.name or not self.path:
            raise ValueError("a LoRA module needs a non-empty name and path")


@dataclass(frozen=True)
class LoRAConfig:
    """vLLM's LoRA flags. max_loras: distinct adapters in one batch (each a weight slot); max_cpu_loras:
    adapters kept loaded in memory (LRU beyond that, read again from disk when used)."""

    enable_lora: bool = False
    lora_modules: tuple[LoRAModule, ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None = max_loras
    allow_runtime_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    # Folders the run-time route may load local adapters from (server/lora/paths.py); () = the
    # --lora-modules paths and the cache dir
    allowed_paths: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if (self.lora_modules or self.allow_runtime_updating) and not self.enable_lora:
            raise ValueError("LoRA modules and run-time LoRA updates need --enable-lora")
        names = [m.name for m in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate LoRA module names in {names}")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras


# The prefill share cap on CPU (EngineConfig.long_prefill_threshold_for).
CPU_LONG_PREFILL_TOKEN_THRESHOLD = 128
# The measured cap's floor (EngineConfig.prefill_cap_for): a long prompt still advances where the target
# is out of reach (a mixed step's own overhead beyond (f - 1) quiet steps), at about half the prompt rate
# of the fixed cap for the embedded model on the 2-core Zen 4 (docs/benchmarks.md).
PREFILL_CAP_MIN_TOKENS = 16
# The measured cap's factor on CPU (EngineConfig.prefill_itl_factor_for): issue 49's target, a running
# stream's ITL p99 during another's 8k prefill within 2x its quiet ITL.
CPU_PREFILL_ITL_FACTOR = 2.0
_CAP_CONFLICT = (
    "prefill_itl_min_tokens 0 lets the measured cap (prefill_itl_factor) size every prompt's chunks, the cap "
    "that long_prefill_token_threshold fixes: set one of them (prefill_itl_factor 0 for the fixed threshold "
    "alone)"
)
# A burst step costs at most this many quiet decode steps of its streams (server/core/burst_bound.py). On
# the Llama-3.2-1B shape on 2 cores, 64 users: 16 cut ITL p99 8.4 -> 2.2 s with TTFT p50 0.87x and the same
# throughput; 4 cut it 4.8x but cost TTFT p50 1.8x and half the throughput (docs/benchmarks-log.md, "A burst
# step bounded by its measured cost").
BURST_ITL_FACTOR = 16.0
# and at most this many seconds (server/core/burst_bound.py, "Why seconds too"): f alone let a burst step
# beside 64 streams of the Llama-3.2-1B shape cost ~1.8 s (ITL p99 1.83 s against llama-server's 0.24 s).
BURST_ITL_SECONDS = 0.5
# A pooling step's token target (server/core/scheduler.py, "pooling"): on the Qwen3-Embedding-0.6B shape
# on 2 cores, 64 texts arriving together: p50 0.64x the one-step burst's at 0.96x its texts/s in process,
# served p50 0.62-0.69x at 0.82-1.00x the embeddings/s; 256 cost 0.84x the texts/s
# (docs/benchmarks-log.md, "Pooling steps of a token target").
POOLING_STEP_TOKENS = 512


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    # While decodes run, a step's prompt tokens are capped here (0 = no cap): bounds inter-token
    # latency when prompts arrive (server/core/scheduler.py). None = by device
    # (`long_prefill_threshold_for`): the value measured on CPU there, vLLM's default (no cap) on CUDA.
    long_prefill_token_threshold: int | None = None
    # > 1: beside decodes, a long prefill's chunks (`prefill_itl_min_tokens`) are sized from measured step
    # costs so that the step costs at most this many times a decode-only step (server/core/prefill_cap.py);
    # 0 = off (the fixed threshold for every prompt). None = by device (`prefill_itl_factor_for`): 2 on CPU,
    # off on CUDA.
    prefill_itl_factor: float | None = None
    # The measured cap governs prompts admitted with more uncached tokens than this; shorter ones keep the
    # fixed threshold. None = the token budget (`max_num_batched_tokens`): a prompt that needs several steps
    # even with nothing else running (`prefill_itl_min_tokens_for`). 0 = every prompt (the measured cap
    # replaces the threshold; not with an explicit long_prefill_token_threshold).
    prefill_itl_min_tokens: int | None = None
    # > 1: a burst step (scheduler.py) costs at most this many quiet decode steps of its streams
    # (server/core/burst_bound.py); 0 = off (a burst step may take the whole token budget).
    burst_itl_factor: float = BURST_ITL_FACTOR
    # ... and at most this many seconds (0 = the factor alone); only with burst_itl_factor on.
    burst_itl_seconds: float = BURST_ITL_SECONDS
    # A pooling model's step takes inputs while they fit this many tokens (its first whatever its length);
    # 0 = the whole budget (max(max_num_batched_tokens, the model's context)).
    pooling_step_tokens: int = POOLING_STEP_TOKENS
    # vLLM's --scheduling-policy: fcfs, or priority (the request's `priority`, lower first;
    # server/core/request_queue.py).
    scheduling_policy: str = "fcfs"
    attention_backend: str = "auto"  # auto = triton on CUDA; on CPU cpu (compiled decode kernel) or torch
    device: str = "auto"  # auto = cuda if available else cpu
    num_threads: int | None = None  # torch intra-op threads on CPU; None = torch's default
    # adaptive: each CPU step runs with the thread count (1 .. num_threads) measured fastest for steps of
    # its size (server/core/step_threads.py); fixed: always num_threads
    thread_policy: str = "adaptive"
    # An idle engine's first step waits until arrivals pause this long (AsyncEngine._gather_burst).
    batch_wait_ms: float = 5.0
    seed: int = 0  # for unseeded sampling
    speculative: SpeculativeConfig | None = None  # --speculative-config; None = no speculative decoding
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)  # server/kv_events.py
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if not (math.isfinite(self.batch_wait_ms) and self.batch_wait_ms >= 0):
            raise ValueError(f"batch_wait_ms must be >= 0, got {self.batch_wait_ms}")
        if self.thread_policy not in THREAD_POLICIES:
            raise ValueError(f"thread_policy must be one of {THREAD_POLICIES}, got {self.thread_policy!r}")
        if self.lora.enable_lora and self.parallel.tensor_parallel_size > 1:
            # the worker ranks shard plain projections; LoRA-wrapped ones are not sharded yet
            raise ValueError("--enable-lora does not work with --tensor-parallel-size > 1 yet")
        spec = self.speculative
        if spec is not None and spec.method == "draft_model" and self.parallel.tensor_parallel_size > 1:
            # the draft would run on rank 0 alone; not tested yet
            raise ValueError("a speculative draft model does not work with --tensor-parallel-size > 1 yet")
        f = self.prefill_itl_factor
        if not (f is None or f == 0 or (math.isfinite(f) and f > 1)):
            raise ValueError(f"prefill_itl_factor must be 0 (off) or > 1, got {f}")
        if self.prefill_itl_min_tokens is not None and self.prefill_itl_min_tokens < 0:
            raise ValueError(f"prefill_itl_min_tokens must be >= 0, got {self.prefill_itl_min_tokens}")
        b = self.burst_itl_factor
        if not (b == 0 or (math.isfinite(b) and b > 1)):
            raise ValueError(f"burst_itl_factor must be 0 (off) or > 1, got {b}")
        if self.pooling_step_tokens < 0:
            raise ValueError(f"pooling_step_tokens must be >= 0, got {self.pooling_step_tokens}")
        bs = self.burst_itl_seconds
        if not (bs == 0 or (math.isfinite(bs) and bs > 0)):
            raise ValueError(f"burst_itl_seconds must be 0 (off) or > 0, got {bs}")
        # (the same conflict under the device's default factor is refused by prefill_cap_for, per device)
        if f and self.prefill_itl_min_tokens == 0 and self.long_prefill_token_threshold is not None:
            raise ValueError(_CAP_CONFLICT)
        if f == 0 and self.prefill_itl_min_tokens is not None:
            raise ValueError(
                "prefill_itl_min_tokens chooses the prompts the measured cap governs, and prefill_itl_factor 0 "
                "turns that cap off: set one of them"
            )
        # Validates the token budget and sequence limits early, with the same messages.
        SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=max(self.max_num_batched_tokens, 2) if not self.enable_chunked_prefill else 2048,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold or 0,
            scheduling_policy=self.scheduling_policy,  # type: ignore[arg-type]  # validated there
        )

    def long_prefill_threshold_for(self, device_type: str) -> int:
        """The prefill share cap (prompt tokens per step while decodes run; 0 = none) on a device of
        this type ("cpu", "cuda"): the configured value, else CPU_LONG_PREFILL_TOKEN_THRESHOLD on CPU
        and 0 elsewhere. Why per device: on CPU a step's time grows with its tokens (a 2048-token step
        took 1.2-1.5 s against 45-55 ms for a step of 32 decodes on a Zen 4 EPYC), and
        128 measured best of 64-256 there (docs/benchmarks.md, "CPU: attention kernels in bf16 and the
        prefill cap at 128"; 64 measured no better at 32 users: "CPU: the prefill share at 32 users
        again"). On a GPU a few thousand tokens fill the device in about a decode step's time, so a
        CPU-sized cap would only add steps to every prompt: vLLM's GPU default (no
        long_prefill_token_threshold beyond the token budget) applies there, unmeasured by us."""
        if self.long_prefill_token_threshold is not None:
            return self.long_prefill_token_threshold
        return CPU_LONG_PREFILL_TOKEN_THRESHOLD if device_type == "cpu" else 0

    def burst_bound_config(self) -> BurstBoundConfig | None:
        """The burst step's cost bound (`burst_itl_factor` > 1, with `burst_itl_seconds`), or None when
        off."""
        if not self.burst_itl_factor:
            return None
        return BurstBoundConfig(itl_factor=self.burst_itl_factor, itl_seconds=self.burst_itl_seconds)

    def prefill_itl_factor_for(self, device_type: str) -> float:
        """`prefill_itl_factor` on a device of this type (0 = off): the configured value, else
        CPU_PREFILL_ITL_FACTOR on CPU and off elsewhere, and off where `long_prefill_token_threshold` is
        explicitly 0 (no cap beyond the token budget). Why on CPU: a running stream's ITL while
        another's 8k prompt prefilled at the fixed 128-token share was 9.6x its quiet ITL (Llama-3.2-1B
        Q4_K_M, Zen 5); the measured cap for prompts longer than the token budget brought it to 1.79x
        at the same TTFT, and leaves shorter prompts alone (`prefill_itl_min_tokens_for`). On a GPU the fixed cap is off too (vLLM's default), unmeasured by us."""
        if self.prefill_itl_factor is not None:
            return self.prefill_itl_factor
        if self.long_prefill_token_threshold == 0:  # asked for no cap beyond the budget
            return 0.0
        return CPU_PREFILL_ITL_FACTOR if device_type == "cpu" else 0.0

    def prefill_itl_min_tokens_for(self) -> int:
        """The uncached prompt tokens beyond which the measured cap governs a prompt's chunks: the
        configured value, else the token budget. Why the budget: such a prompt needs several steps even
        alone, and holds the running streams for all of them. Measured on Llama-3.2-1B Q4_K_M, 2-core Zen 5
        (docs/benchmarks-log.md, "The measured cap for long prefills only"): four 8,192-token prompts at
        once, a stream's ITL p99 during another's prefill 10.1x -> 1.79x its quiet p99 at the same TTFT;
        eight 2,048-token prompts at once (within the budget) would have paid 1.25x TTFT p50 for 5x lower
        ITL p99 during prefill (at 1,024), and applied to every prompt, 64 short-prompt users 2.3x TTFT p50."""
        if self.prefill_itl_min_tokens is not None:
            return self.prefill_itl_min_tokens
        return self.max_num_batched_tokens

    def prefill_cap_for(self, device_type: str) -> PrefillCapConfig | None:
        """The measured prefill cap's settings (`prefill_itl_factor_for` > 0), or None for the fixed cap of
        `long_prefill_threshold_for` alone. It starts at the fixed CPU value and stays within
        [PREFILL_CAP_MIN_TOKENS, the token budget] on every device type; it governs prompts of more than
        `prefill_itl_min_tokens_for()` uncached tokens (0: all)."""
        f = self.prefill_itl_factor_for(device_type)
        if not f:
            return None
        if self.prefill_itl_min_tokens == 0 and self.long_prefill_token_threshold is not None:
            raise ValueError(
                _CAP_CONFLICT
            )  # the device's default factor beside both (explicit: __post_init__)
        budget = self.max_num_batched_tokens
        return PrefillCapConfig(
            itl_factor=f,
            initial=min(CPU_LONG_PREFILL_TOKEN_THRESHOLD, budget),
            min_tokens=min(PREFILL_CAP_MIN_TOKENS, budget),
            max_tokens=budget,
            min_prompt_tokens=self.prefill_itl_min_tokens_for(),
        )


LOG_FORMATS = ("json", "text")
TOOL_CALL_PARSERS = (
    "hermes",
    "llama3_json",
    "granite",
    "phi4_mini_json",
    "pythonic",
    "openai",
)  # server/api/tool_parsers.py, harmony.py
REASONING_PARSERS = ("deepseek_r1", "qwen3", "openai_gptoss")  # server/api/reasoning.py (vLLM's names)


@dataclass(frozen=True)
class ResponsesStoreConfig:
    """The Responses API's store of responses (server/api/response_store.py), per replica, in memory.

    enabled: `store: true` keeps responses for previous_response_id / GET; off, such a request is a 400.
    max_entries / max_bytes: bounds, least recently used evicted first; ttl_s: age limit (0 = none).
    """

    enabled: bool = True
    max_entries: int = 1000
    max_bytes: int = 64 * 1024 * 1024
    ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.max_entries < 1:
            raise ValueError(f"responses store max_entries must be >= 1, got {self.max_entries}")
        if self.max_bytes < 1024:
            raise ValueError(f"responses store max_bytes must be >= 1024, got {self.max_bytes}")
        if self.ttl_s < 0:
            raise ValueError(f"responses store ttl_s must be >= 0, got {self.ttl_s}")


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server around the engine: limits that the API enforces before anything reaches the engine."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "0.0.0.0"
    port: int = 8080
    max_concurrent_requests: int = 128
    max_input_tokens: int | None = None  # None = max_total_tokens - 1
    max_total_tokens: int | None = None  # None = the engine's context length
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_client_batch_size: int = 4
    api_key: str | None = None
    # the management credential (server/api/admin.py): state-changing routes need it when set
    admin_api_key: str | None = field(default=None, repr=False)
    drain_timeout_s: float = 30.0
    # Seconds a connection may take to send a request head (server/api/limits.py)
    timeout_request_head_s: float = 30.0
    # Seconds from the end of a request head to the end of its body, in total (server/api/limits.py)
    timeout_request_body_s: float = 60.0
    # Connections open at once, in total and per client address; more are answered 503 and closed
    limit_concurrency: int = 1024
    limit_concurrency_per_client: int = 256
    log_format: str = "text"
    max_payload_bytes: int = 2_000_000
    # The Gateway API Inference Extension's objectives (x-gateway-inference-objective) -> request priority,
    # for requests whose body sets none (server/api/objectives.py)
    objective_priorities: tuple[tuple[str, int], ...] = ()
    ui: bool = True  # the chat playground at GET / (--no-ui turns it off)
    # CORS (vLLM's flags and defaults): browsers from these origins may call the API
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # tool_choice "auto" (vLLM's --enable-auto-tool-choice / --tool-call-parser)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # the Responses API's stored responses (--enable-responses-store and its bounds)
    responses_store: ResponsesStoreConfig = field(default_factory=ResponsesStoreConfig)
    # thinking split from the answer (vLLM's --reasoning-parser names)
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if not (0 <= self.port <= 65535):
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_concurrent_requests < 1:
            raise ValueError(f"max_concurrent_requests must be >= 1, got {self.max_concurrent_requests}")
        if self.max_total_tokens is not None and self.max_total_tokens < 2:
            raise ValueError(f"max_total_tokens must be >= 2, got {self.max_total_tokens}")
        if self.max_input_tokens is not None:
            if self.max_input_tokens < 1:
                raise ValueError(f"max_input_tokens must be >= 1, got {self.max_input_tokens}")
            if self.max_total_tokens is not None and self.max_input_tokens >= self.max_total_tokens:
                raise ValueError(
                    f"max_input_tokens ({self.max_input_tokens}) must be < max_total_tokens ({self.max_total_tokens})"
                )
        mml = self.engine.model.max_model_len
        if self.max_total_tokens is not None and mml is not None and self.max_total_tokens > mml:
            raise ValueError(f"max_total_tokens ({self.max_total_tokens}) exceeds the model length ({mml})")
        for name in ("max_best_of", "max_stop_sequences", "max_client_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (0 <= self.max_top_n_tokens <= 20):
            raise ValueError(f"max_top_n_tokens must be in [0, 20], got {self.max_top_n_tokens}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty when set")
        if self.admin_api_key is not None and not self.admin_api_key:
            raise ValueError("admin_api_key must be non-empty when set")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if not self.timeout_request_head_s > 0:
            raise ValueError(f"timeout_request_head_s must be > 0, got {self.timeout_request_head_s}")
        if not self.timeout_request_body_s > 0:
            raise ValueError(f"timeout_request_body_s must be > 0, got {self.timeout_request_body_s}")
        for name in ("limit_concurrency", "limit_concurrency_per_client"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {self.log_format!r}")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"{name} must be a tuple of non-empty strings, got {value!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}"
            )
        if self.tool_call_parser == "openai" and self.reasoning_parser != "openai_gptoss":
            # the harmony tool parser reads the answer text the harmony reasoning stream writes
            raise ValueError("tool_call_parser 'openai' (gpt-oss) requires reasoning_parser 'openai_gptoss'")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice requires tool_call_parser")
        if self.max_payload_bytes < 1024:
            raise ValueError(f"max_payload_bytes must be >= 1024, got {self.max_payload_bytes}")
        if self.objective_priorities and self.engine.scheduling_policy != "priority":
            # under fcfs a non-zero priority is refused per request: every mapped request would fail
            raise ValueError(
                "objective_priorities (--objective-priority) requires scheduling_policy 'priority'"
            )
