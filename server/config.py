"""Frozen, validated configuration of the engine. (CLI and environment parsing: server/cli.py.)"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from server.core.scheduler import SchedulerConfig

QUANTIZE_CHOICES = (
    "awq",
    "gptq",
    "bitsandbytes",
    "bitsandbytes-nf4",
    "bitsandbytes-fp4",
    "fp8",
    "int8",
    "int4",
)


def default_cache_dir() -> Path:
    """Converted weights and built CPU kernels: $KUBEINFER_CACHE_DIR, else ~/.cache/kubeinfer."""
    env = os.environ.get("KUBEINFER_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kubeinfer"


DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")


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

    def __post_init__(self) -> None:
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

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 256 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two in [1, 256], got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError("kv_cache_memory_bytes must be positive")


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


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    attention_backend: str = "auto"  # auto = triton on CUDA; on CPU cpu (compiled decode kernel) or torch
    device: str = "auto"  # auto = cuda if available else cpu
    num_threads: int | None = None  # torch intra-op threads on CPU; None = torch's default
    seed: int = 0  # for unseeded sampling
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
        # Validates the token budget and sequence limits early, with the same messages.
        SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=max(self.max_num_batched_tokens, 2) if not self.enable_chunked_prefill else 2048,
            enable_chunked_prefill=self.enable_chunked_prefill,
        )


LOG_FORMATS = ("json", "text")


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
    drain_timeout_s: float = 30.0
    log_format: str = "text"
    max_payload_bytes: int = 2_000_000

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
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {self.log_format!r}")
        if self.max_payload_bytes < 1024:
            raise ValueError(f"max_payload_bytes must be >= 1024, got {self.max_payload_bytes}")
