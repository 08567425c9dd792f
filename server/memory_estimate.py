"""How much memory serving a model takes, read from its files without loading them: plain Python (json,
struct, and gguf-py's memory-mapped header reader), no torch, so the shared-cache loader Job can run it
right after the download and hand the operator the figure (docs/operator.md, "Memory").

Weights: a Hugging Face folder's safetensors headers (each tensor's dtype and shape: 8-byte little-endian
header length, then the JSON header, the safetensors format) at the serving dtype; a GGUF's tensor
infos at what the CPU loader keeps resident (server/quant/gguf_checkpoint.py: Q4_0/Q4_1/Q8_0 as in the
file, Q4_K/Q6_K and the repacked types at docs/quantization.md's resident bits per weight, or, where the
server estimates for itself on a CPU that holds them in 16-row tiles, or the loader Job for a CPU server, at
the tiles' bits (GGUF_TILE_BITS, `ServingSettings.gguf_tiles`); every other type and F16/BF16 as fp32). KV: 2 (K and V) x KV heads x head_dim x the cache's element size per layer
and token; a sliding-window layer holds at most its window per sequence (as vLLM's hybrid allocator
counts it; our paged cache frees out-of-window blocks only when every layer is windowed, so
`kv_cache_bytes`, the allocation, is what the server actually reserves).
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from server.core.kv_groups import cdiv, window_blocks_per_sequence

# Bytes per element of the safetensors dtypes (the format's names).
SAFETENSORS_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
_FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}
# GGUF type -> bits per weight resident on CPU (docs/quantization.md's table; kept types at file size).
# The k-quants at their repack's bits: what a CPU holds where the 16-row tiles do not run (no AVX2, fp32
# GEMMs, tensor-parallel ranks); where they do, GGUF_TILE_BITS.
GGUF_RESIDENT_BITS = {
    "Q8_0": 8.5,
    "Q4_0": 4.5,
    "Q4_1": 5.0,
    "Q4_K": 6.0,
    "Q6_K": 10.0,
    "Q5_0": 8.5,
    "Q5_1": 9.0,
    "Q5_K": 10.0,
    "Q3_K": 6.0,
    "Q2_K": 8.0,
    "IQ4_NL": 8.5,
    "IQ4_XS": 9.0,
    "MXFP4": 4.25,  # gpt-oss experts stay packed (16 bytes of e2m1 + one e8m0 scale per 32)
    "F32": 32.0,
}
# GGUF type -> bits per weight where the serving CPU holds it in 16-row tiles (server/quant/csrc/qk_native.cpp;
# gguf_checkpoint.super_blocks_enabled: AVX512-VNNI or AVX2 and bf16 or int8 layers), for tensors of whole tiles (N a multiple
# of 16): within 1/8 bit of the file's, no packed copy. Used where the server estimates for itself
# (`ServingSettings.gguf_tiles`), and for the operator by the loader Job (server/download.py), which assumes
# the AVX2 floor of the nodes clouds sell.
GGUF_TILE_BITS = {
    "Q8_0": 8.5,
    "Q5_0": 5.5,
    "Q5_1": 6.0,
    "IQ4_NL": 4.5,
    "Q4_K": 4.625,
    "Q6_K": 6.5625,
    "Q5_K": 5.625,
    "IQ4_XS": 4.3125,
    "Q3_K": 3.5625,
    "Q2_K": 2.625,
}
Q8_TILE_TYPES = ("Q8_0",)  # tiled only where `gguf_q8_tiles` (gguf_checkpoint.Q8_TILE_FORMATS: AVX512-VNNI)
# On-the-fly --quantize methods: resident bits per weight of a quantized linear weight (values plus
# the per-32 scale (and min) the block formats carry).
QUANTIZE_BITS = {"int8": 8.5, "q8_0": 8.5, "int4": 4.5, "q4_0": 4.5, "q4_1": 5.0, "fp8": 8.0}
# What a running server holds besides weights and KV: the interpreter, torch and its CPU libraries,
# the tokenizer, step activations. A GGUF's first start converts its config and tokenizer (transformers'
# GGUF readers: ~1,500 more modules imported, kept) and holds ~175 MB more than later starts: a
# Llama-3.2-1B-shaped Q4_K_M (128k vocabulary) 1,891 against 1,716 MB at rest, ~1,075 MB besides its
# weights, past the 1 GiB this was (2026-12-06, Zen 5): 1.25 GiB.
RUNTIME_OVERHEAD_BYTES = 5 << 28
DEFAULT_KV_CACHE_MEMORY = 512 * 2**20  # server/config.py CacheConfig.kv_cache_memory_bytes


class EstimateError(ValueError):
    """The model's files cannot be read for an estimate (no config.json, a corrupt header)."""


@dataclass(frozen=True)
class ServingSettings:
    """The server flags the estimate depends on (vLLM's names): `dtype` as `--dtype` (auto: the
    caller's device decides: `auto_dtype`), `quantize` (`--quantize`), `max_model_len`, `max_num_seqs`,
    `kv_cache_dtype` (`--kv-cache-dtype`), `kv_cache_memory` (`--kv-cache-memory`, bytes), `block_size`
    (`--block-size`) and `max_num_batched_tokens` (a step's tokens: the prompt chunk a windowed layer
    holds besides its window, server/core/kv_groups.py). `gguf_tiles`: the serving CPU holds a GGUF served
    as it is in 16-row tiles (GGUF_TILE_BITS); False: the repacks' bits (GGUF_RESIDENT_BITS). `gguf_q8_tiles` (with `gguf_tiles`): Q8_TILE_TYPES too (gguf_checkpoint.q8_tiles_enabled:
    not on an AVX2-only CPU)."""

    dtype: str = "auto"
    auto_dtype: str = "float32"  # what auto resolves to: fp32 on CPUs without native bf16, the safe bound
    quantize: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64  # server/core/scheduler.py SchedulerConfig.max_num_seqs (the server's default)
    kv_cache_dtype: str = "auto"
    kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY
    block_size: int = 16  # server/config.py CacheConfig.block_size
    max_num_batched_tokens: int = 2048  # server/config.py EngineConfig.max_num_batched_tokens
    gguf_tiles: bool = False
    gguf_q8_tiles: bool = True

    def __post_init__(self) -> None:
        for name in ("dtype", "auto_dtype", "kv_cache_dtype"):
            value = _DTYPE_ALIASES.get(getattr(self, name), getattr(self, name))
            allowed = ("auto", *DTYPE_BYTES) if name != "auto_dtype" else tuple(DTYPE_BYTES)
            if name == "kv_cache_dtype":
                allowed = (*allowed, "int8")
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
            object.__setattr__(self, name, value)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.kv_cache_memory < 1:
            raise ValueError("kv_cache_memory must be positive")
        if self.block_size < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size and max_num_batched_tokens must be >= 1")

    @property
    def weight_dtype(self) -> str:
        return self.auto_dtype if self.dtype == "auto" else self.dtype

    @property
    def cache_dtype(self) -> str:
        return self.weight_dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype


@dataclass(frozen=True)
class MemoryEstimate:
    """Where a served model's memory goes, in bytes.

    `weight_bytes`: resident weights (MoE experts included: they are tensors in the files);
    `file_weight_bytes`: the same tensors' bytes in the files; `kv_bytes_per_token`: one token's K and V
    over every full-attention layer; `kv_window_bytes_per_sequence`: the windowed layers' K and V of one
    sequence of `max_model_len` tokens as the engine's KV groups hold it (the widest window, a block of
    slack on each edge and one step's `max_num_batched_tokens`, in whole blocks, at most the context:
    kv_groups.window_blocks_per_sequence); `kv_bytes_per_sequence`: one sequence of `max_model_len`
    tokens (the full layers' in whole blocks), what kv_groups.plan_kv_layout keeps room for; `kv_bytes_for_context`: `max_num_seqs` of them; `kv_cache_bytes`: what the
    server allocates (`--kv-cache-memory`); `runtime_overhead_bytes`: the process besides these;
    `total_bytes`: weights + allocated KV + overhead; `minimum_bytes`: weights + one sequence + overhead,
    below which the server cannot serve a full-length request."""

    source: str  # "safetensors" | "gguf"
    weight_bytes: int
    file_weight_bytes: int
    num_layers: int
    num_windowed_layers: int
    max_model_len: int
    max_num_seqs: int
    kv_dtype: str
    kv_bytes_per_token: int
    kv_window_bytes_per_sequence: int
    kv_bytes_per_sequence: int
    kv_bytes_for_context: int
    kv_cache_bytes: int
    runtime_overhead_bytes: int
    total_bytes: int
    minimum_bytes: int

    def to_json(self) -> str:
        """One line of JSON (the loader's termination message; the operator reads it back)."""
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)


@dataclass(frozen=True)
class _Attention:
    num_kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...]  # per layer: its sliding window, None for full attention
    max_position_embeddings: int


def _layer_windows(cfg: dict[str, Any], n: int) -> tuple[int | None, ...]:
    """Each layer's window as transformers (and server/models/arch.py, archs/gemma.py) read config.json:
    `layer_types` when given; Gemma 2 and gpt-oss every other layer from the first; Gemma 3 all but every
    `sliding_window_pattern`-th; Qwen2/3 with `use_sliding_window` from `max_window_layers` on;
    Mistral-style configs every layer."""
    raw = cfg.get("sliding_window")
    window = int(raw) if raw else None
    if window is None:
        return (None,) * n
    mtype = str(cfg.get("model_type", ""))
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == n:
        return tuple(window if t == "sliding_attention" else None for t in types)
    if mtype in ("gemma2", "gpt_oss"):
        return tuple(window if i % 2 == 0 else None for i in range(n))
    if mtype in ("gemma3", "gemma3_text"):
        pattern = int(cfg.get("sliding_window_pattern", 6) or 6)
        return tuple(window if (i + 1) % pattern else None for i in range(n))
    if mtype in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        if not cfg.get("use_sliding_window"):
            return (None,) * n
        first = int(cfg.get("max_window_layers", 28))
        return tuple(window if i >= first else None for i in range(n))
    if mtype in ("llama", "granite", "olmo2", "smollm3", "gemma"):
        return (None,) * n
    return (window,) * n  # mistral, mixtral, phi3: every layer


def _attention(cfg: dict[str, Any]) -> _Attention:
    cfg = cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg
    try:
        n = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise EstimateError(f"config.json lacks the attention sizes: {e}") from e
    return _Attention(kv, head_dim, _layer_windows(cfg, n), int(cfg.get("max_position_embeddings") or 2048))


def safetensors_header(path: Path) -> dict[str, Any]:
    """A .safetensors file's header: {name: {"dtype", "shape", "data_offsets"}} (and `__metadata__`)."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise EstimateError(f"{path.name}: not a safetensors file")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 * 2**20:
            raise EstimateError(f"{path.name}: safetensors header of {size} bytes")
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise EstimateError(f"{path.name}: unreadable safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise EstimateError(f"{path.name}: safetensors header is not an object")
    return header


def _is_quantizable(name: str, shape: list[int]) -> bool:
    """A linear projection's weight, which on-the-fly --quantize replaces (embeddings, the head and
    norms stay)."""
    return len(shape) == 2 and name.endswith(".weight") and "embed" not in name and "lm_head" not in name


def _folder_weights(folder: Path, settings: ServingSettings) -> tuple[int, int]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise EstimateError(f"{folder}: no .safetensors files")
    resident = 0
    in_file = 0
    elem = DTYPE_BYTES[settings.weight_dtype]
    qbits = QUANTIZE_BITS.get(settings.quantize or "")
    for path in files:
        for name, info in safetensors_header(path).items():
            if name == "__metadata__":
                continue
            dtype, shape = str(info["dtype"]), [int(s) for s in info["shape"]]
            count = 1
            for s in shape:
                count *= s
            stored = count * SAFETENSORS_DTYPE_BYTES.get(dtype, 4)
            in_file += stored
            if dtype not in _FLOAT_DTYPES:
                resident += stored  # packed integers (AWQ/GPTQ/MXFP4 blocks) stay as stored
            elif qbits is not None and _is_quantizable(name, shape):
                resident += (count * int(qbits * 8) + 63) // 64
            else:
                resident += count * elem
    return resident, in_file


def _gguf_field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.contents()
    return value


def _gguf_config(path: Path, reader: Any) -> dict[str, Any]:
    """config.json's attention sizes from the GGUF's metadata (server/models/gguf_config.py for the
    architectures it reads, whose windows it knows; llama.cpp's common keys otherwise)."""
    from server.models.gguf_config import READERS, hf_config_from_gguf

    arch = str(_gguf_field(reader, "general.architecture") or "llama")
    if arch in READERS:
        return hf_config_from_gguf(path, reader)

    def get(key: str) -> Any:
        return _gguf_field(reader, f"{arch}.{key}")

    heads = int(get("attention.head_count") or 0)
    kv = get("attention.head_count_kv") or heads
    kv = max(kv) if isinstance(kv, list) else kv
    hidden = int(get("embedding_length") or 0)
    if not heads or not hidden:
        raise EstimateError(f"{path.name} lacks {arch}.attention.head_count or embedding_length")
    return {
        "model_type": arch,
        "num_hidden_layers": int(get("block_count") or 0),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv),
        "head_dim": int(get("attention.key_length") or hidden // heads),
        "hidden_size": hidden,
        "sliding_window": get("attention.sliding_window"),
        "max_position_embeddings": int(get("context_length") or 2048),
    }


def _gguf_weights(reader: Any, settings: ServingSettings) -> tuple[int, int]:
    resident_bits = 0.0
    in_file = 0
    explicit = None if settings.dtype == "auto" else DTYPE_BYTES[settings.weight_dtype]
    for t in reader.tensors:
        in_file += int(t.n_bytes)
        count = int(t.n_elements)
        if explicit is not None:  # --dtype on a GGUF: every tensor converted to it (models/loader.py)
            resident_bits += count * explicit * 8
        else:
            kind = t.tensor_type.name
            rows = int(t.shape[1]) if len(t.shape) >= 2 else 0  # ggml order: ne0 = K, ne1 = N
            tiled = settings.gguf_tiles and kind in GGUF_TILE_BITS and rows > 0 and rows % 16 == 0
            tiled = tiled and (settings.gguf_q8_tiles or kind not in Q8_TILE_TYPES)
            resident_bits += count * (GGUF_TILE_BITS[kind] if tiled else GGUF_RESIDENT_BITS.get(kind, 32.0))
    return int(resident_bits + 7) // 8, in_file


def estimate_memory(model: Path, settings: ServingSettings) -> MemoryEstimate:
    """The estimate for a model folder (config.json + *.safetensors) or a .gguf file (a folder holding
    exactly one .gguf and no safetensors counts as that file). Raises EstimateError when the files cannot
    be read."""
    gguf_files = sorted(model.glob("*.gguf")) if model.is_dir() else []
    if model.is_file() and model.suffix == ".gguf":
        gguf_file: Path | None = model
    elif len(gguf_files) == 1 and not any(model.glob("*.safetensors")):
        gguf_file = gguf_files[0]
    else:
        gguf_file = None
    if gguf_file is not None:
        from server.gguf_file import open_gguf

        try:
            reader = open_gguf(gguf_file, long_arrays=False)
        except (ValueError, OSError) as e:
            raise EstimateError(f"{gguf_file.name}: unreadable GGUF: {e}") from e
        cfg = _gguf_config(gguf_file, reader)
        weights, in_file = _gguf_weights(reader, settings)
        source = "gguf"
    else:
        try:
            cfg = json.loads((model / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise EstimateError(f"{model}: no readable config.json: {e}") from e
        weights, in_file = _folder_weights(model, settings)
        source = "safetensors"
    att = _attention(cfg)
    return _assemble(source, weights, in_file, att, settings)


def _assemble(
    source: str, weights: int, in_file: int, att: _Attention, settings: ServingSettings
) -> MemoryEstimate:
    max_len = settings.max_model_len or att.max_position_embeddings
    if settings.cache_dtype == "int8":  # a byte a value, an fp32 scale per 32 (server/attention/int8_kv.py)
        layer_token = 2 * att.num_kv_heads * (att.head_dim + att.head_dim // 8)
    else:
        layer_token = 2 * att.num_kv_heads * att.head_dim * DTYPE_BYTES[settings.cache_dtype]
    full_layers = sum(1 for w in att.windows if w is None)
    per_token = full_layers * layer_token
    bs = settings.block_size
    windowed = [w for w in att.windows if w is not None]
    window_tokens = (
        window_blocks_per_sequence(max(windowed), bs, settings.max_num_batched_tokens, max_len) * bs
        if windowed
        else 0
    )
    window_seq = len(windowed) * window_tokens * layer_token
    per_seq = cdiv(max_len, bs) * bs * per_token + window_seq
    overhead = RUNTIME_OVERHEAD_BYTES
    return MemoryEstimate(
        source=source,
        weight_bytes=weights,
        file_weight_bytes=in_file,
        num_layers=len(att.windows),
        num_windowed_layers=len(att.windows) - full_layers,
        max_model_len=max_len,
        max_num_seqs=settings.max_num_seqs,
        kv_dtype=settings.cache_dtype,
        kv_bytes_per_token=per_token,
        kv_window_bytes_per_sequence=window_seq,
        kv_bytes_per_sequence=per_seq,
        kv_bytes_for_context=per_seq * settings.max_num_seqs,
        kv_cache_bytes=settings.kv_cache_memory,
        runtime_overhead_bytes=overhead,
        total_bytes=weights + settings.kv_cache_memory + overhead,
        minimum_bytes=weights + per_seq + overhead,
    )


class InsufficientMemoryError(RuntimeError):
    """The memory this process may still use is below the weights plus one full-length sequence's KV."""


def memory_verdict(estimate: MemoryEstimate, headroom: int | None) -> tuple[str, str] | None:
    """("error" | "warning", message) when `headroom` (bytes the memory cgroup may still charge; None:
    unlimited) is below what serving needs: an error below the weights plus one `max_model_len`
    sequence's KV (the server could never finish a full-length request), a warning below the weights
    plus the whole KV allocation (--kv-cache-memory). None when it fits."""
    if headroom is None:
        return None
    need_min = estimate.weight_bytes + estimate.kv_bytes_per_sequence
    need_all = estimate.weight_bytes + estimate.kv_cache_bytes
    gib = 2**30
    if headroom < need_min:
        return (
            "error",
            f"the container's memory limit leaves {headroom / gib:.2f} GiB, and this model needs at least "
            f"{need_min / gib:.2f} GiB ({need_min} bytes: weights {estimate.weight_bytes} + the KV of one "
            f"{estimate.max_model_len}-token sequence {estimate.kv_bytes_per_sequence}), "
            f"{estimate.total_bytes / gib:.2f} GiB in all with the KV cache and the runtime; raise the memory "
            "limit (resources.memory), or lower --max-model-len or the weights (--quantize, a smaller --dtype)",
        )
    if headroom < need_all:
        return (
            "warning",
            f"the container's memory limit leaves {headroom / gib:.2f} GiB, below the weights "
            f"({estimate.weight_bytes} bytes) plus the KV cache allocation ({estimate.kv_cache_bytes} bytes, "
            f"--kv-cache-memory): {need_all / gib:.2f} GiB; lower --kv-cache-memory or raise the limit",
        )
    return None
