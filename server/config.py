"""Frozen, validated configuration of the engine. (CLI and environment parsing: server/cli.py.)"""

from __future__ import annotations

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
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # HF folder, .gguf file, or None for the embedded SmolLM2
    dtype: str = "auto"
    quantize: str | None = None
    cache_dir: Path | None = None  # converted-weights cache; None = $KUBEINFER_CACHE_DIR or ~/.cache/kubeinfer
    served_model_name: str | None = None
    max_model_len: int | None = None  # None = min(model's max_position_embeddings, 8192)

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
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError("kv_cache_memory_bytes must be positive")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    attention_backend: str = "auto"  # auto = torch on CPU, triton on CUDA
    device: str = "auto"  # auto = cuda if available else cpu
    num_threads: int | None = None  # torch intra-op threads on CPU; None = torch's default
    seed: int = 0  # for unseeded sampling

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
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
