"""server/memory_estimate.py against numbers computed here from what the test wrote: safetensors tensor
bytes, GGUF tensor bytes per quant type (gguf-py's block sizes), KV per token with sliding-window layers
counted at their window, and every layer's window equal to what the model loader reads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from safetensors.numpy import save_file

from server.core.kv_groups import plan_kv_layout
from server.memory_estimate import (
    GGUF_RESIDENT_BITS,
    GGUF_TILE_BITS,
    RUNTIME_OVERHEAD_BYTES,
    EstimateError,
    ServingSettings,
    estimate_memory,
)
from server.models.registry import arch_from_hf

GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 256,
    "max_position_embeddings": 4096,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 32,
}


def _write_folder(out: Path, cfg: dict[str, object]) -> Path:
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    save_file(
        {
            "model.embed_tokens.weight": rng.standard_normal((256, 64)).astype(np.float32),
            "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((128, 64)).astype(np.float16),
            "model.norm.weight": np.ones(64, np.float32),
        },
        str(out / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {"model.layers.0.mlp.down_proj.weight": rng.standard_normal((64, 128)).astype(np.float16)},
        str(out / "model-00002-of-00002.safetensors"),
    )
    return out


def test_folder_weights_are_the_safetensors_tensors_at_the_serving_dtype(tmp_path: Path) -> None:
    folder = _write_folder(tmp_path / "m", GEMMA3)
    elements = 256 * 64 + 128 * 64 + 64 + 64 * 128
    file_bytes = 256 * 64 * 4 + 128 * 64 * 2 + 64 * 4 + 64 * 128 * 2
    fp32 = estimate_memory(folder, ServingSettings(dtype="auto", auto_dtype="float32"))
    bf16 = estimate_memory(folder, ServingSettings(dtype="bfloat16"))
    assert fp32.source == "safetensors"
    assert fp32.file_weight_bytes == bf16.file_weight_bytes == file_bytes
    assert fp32.weight_bytes == elements * 4
    assert bf16.weight_bytes == elements * 2
    # --quantize int8: the two projections at 8.5 bits per weight, embedding and norm at the dtype
    q = estimate_memory(folder, ServingSettings(dtype="bfloat16", quantize="int8"))
    assert q.weight_bytes == (256 * 64 + 64) * 2 + (2 * 128 * 64) * 17 // 16


def test_kv_per_token_counts_windowed_layers_at_their_window(tmp_path: Path) -> None:
    folder = _write_folder(tmp_path / "m", GEMMA3)
    est = estimate_memory(
        folder,
        ServingSettings(
            dtype="bfloat16",
            max_model_len=2048,
            max_num_seqs=4,
            kv_cache_memory=1 << 28,
            max_num_batched_tokens=256,
        ),
    )
    layer_token = 2 * 2 * 32 * 2  # K and V, 2 KV heads, head_dim 32, bf16
    # pattern 6: layers 0-4 windowed (512 tokens), layer 5 global (2048); a windowed layer holds its
    # window's 32 blocks of 16, a block of slack at each edge and a 256-token chunk: 50 blocks, 800 tokens
    assert est.num_layers == 6 and est.num_windowed_layers == 5
    assert est.kv_bytes_per_token == layer_token
    assert est.kv_window_bytes_per_sequence == 5 * 800 * layer_token
    assert est.kv_bytes_per_sequence == 2048 * layer_token + 5 * 800 * layer_token
    assert est.kv_bytes_for_context == 4 * est.kv_bytes_per_sequence
    assert est.total_bytes == est.weight_bytes + (1 << 28) + RUNTIME_OVERHEAD_BYTES
    assert est.minimum_bytes == est.weight_bytes + est.kv_bytes_per_sequence + RUNTIME_OVERHEAD_BYTES
    # a window longer than the context costs only the context
    short = estimate_memory(folder, ServingSettings(dtype="bfloat16", max_model_len=256))
    assert short.kv_bytes_per_sequence == 6 * 256 * layer_token
    # the fp32 cache doubles it
    f32 = estimate_memory(
        folder, ServingSettings(dtype="bfloat16", kv_cache_dtype="float32", max_model_len=256)
    )
    assert f32.kv_bytes_per_sequence == 2 * short.kv_bytes_per_sequence
    # an int8 cache: a byte a value and an fp32 scale per 32 (server/attention/int8_kv.py)
    i8 = estimate_memory(folder, ServingSettings(dtype="bfloat16", kv_cache_dtype="int8", max_model_len=256))
    assert i8.kv_bytes_per_sequence == 6 * 256 * 2 * 2 * (32 + 4)
    with pytest.raises(ValueError, match="dtype must be one of"):
        ServingSettings(dtype="int8")


WINDOW_CONFIGS = {
    "gemma3": GEMMA3,
    "gemma2": {
        **GEMMA3,
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "num_hidden_layers": 4,
    },
    "mistral": {
        **GEMMA3,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "sliding_window": 64,
    },
    "qwen2": {
        **GEMMA3,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "use_sliding_window": True,
        "max_window_layers": 2,
        "sliding_window": 64,
    },
    "qwen2-off": {**GEMMA3, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},
    "llama": {**GEMMA3, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "sliding_window": None},
}


@pytest.mark.parametrize("kind", sorted(WINDOW_CONFIGS))
def test_layer_windows_match_what_the_loader_serves(kind: str, tmp_path: Path) -> None:
    cfg = WINDOW_CONFIGS[kind]
    folder = _write_folder(tmp_path / "m", cfg)
    arch = arch_from_hf(dict(cfg))
    windows = [arch.layer_sliding_window(i) for i in range(arch.num_layers)]
    est = estimate_memory(folder, ServingSettings(dtype="float32", max_model_len=4096))
    layer_token = 2 * 2 * 32 * 4
    assert est.num_windowed_layers == sum(w is not None for w in windows)
    # the widest window, a block of slack at each edge and a 2048-token chunk, in blocks of 16
    widest = max((w for w in windows if w is not None), default=0)
    held = min(4096, (-(-(widest - 1) // 16) + 2 + 128) * 16)
    assert est.kv_bytes_per_sequence == sum(4096 if w is None else held for w in windows) * layer_token
    # the engine's KV groups given exactly that budget keep room for one full-length sequence
    layout = plan_kv_layout(windows, est.kv_bytes_per_sequence // (16 * layer_token), 16, 256, 2048, 4096)
    for group in layout.groups:
        assert group.num_blocks >= (256 if group.sliding_window is None else held // 16)


GGUF_TYPES = ["Q4_K", "Q6_K", "IQ4_XS", "Q8_0", "Q5_K", "Q2_K", "IQ2_XS", "F16"]


def _write_gguf(path: Path, types: list[str]) -> int:
    """A gguf2-style llama file, one [64, 256] weight per type, random bytes of the type's block size
    (the estimate reads headers only); returns the tensors' bytes."""
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_embedding_length(256)
    w.add_head_count(8)
    w.add_head_count_kv(2)
    w.add_context_length(1024)
    rng = np.random.default_rng(0)
    total = 0
    for i, name in enumerate(types):
        kind = GGMLQuantizationType[name]
        block, size = GGML_QUANT_SIZES[kind]
        nbytes = 64 * 256 // block * size
        raw = rng.integers(0, 255, (64, 256 // block * size), dtype=np.uint8)
        w.add_tensor(f"blk.{i}.ffn_up.weight", raw, raw_dtype=kind)
        total += nbytes
    norm = np.ones(256, np.float32)
    w.add_tensor("output_norm.weight", norm)
    total += norm.nbytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return total


def test_gguf_weights_at_each_quant_type_s_resident_bytes(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    file_bytes = _write_gguf(path, GGUF_TYPES)
    est = estimate_memory(path, ServingSettings(max_model_len=1024, max_num_seqs=1))
    assert est.source == "gguf"
    assert est.file_weight_bytes == file_bytes
    # Q4_K 6 bits, Q6_K 10, IQ4_XS 9, Q8_0 8.5, Q5_K 10, Q2_K 8 (repacked); IQ2_XS and F16 as fp32
    bits = [6.0, 10.0, 9.0, 8.5, 10.0, 8.0, 32.0, 32.0]
    assert [GGUF_RESIDENT_BITS.get(t, 32.0) for t in GGUF_TYPES] == bits
    assert est.weight_bytes == int(sum(b * 64 * 256 for b in bits) // 8) + 256 * 4
    # KV from the header: 2 layers, 2 KV heads of 256 / 8 = 32, fp32 cache under auto on CPU
    assert est.kv_bytes_per_token == 2 * 2 * 2 * 32 * 4
    # --dtype on a GGUF converts every tensor to it
    bf16 = estimate_memory(path, ServingSettings(dtype="bfloat16"))
    assert bf16.weight_bytes == (len(GGUF_TYPES) * 64 * 256 + 256) * 2
    # a folder holding the one .gguf reads as the file (the loader's cache layout)
    assert estimate_memory(tmp_path, ServingSettings(max_model_len=1024, max_num_seqs=1)) == est
    # where the serving CPU holds 16-row tiles (N = 64 here): the tiles' bits, within 1/8 of the file's
    tiles = estimate_memory(path, ServingSettings(max_model_len=1024, max_num_seqs=1, gguf_tiles=True))
    tile_bits = [4.625, 6.5625, 4.3125, 8.5, 5.625, 2.625, 32.0, 32.0]
    assert [GGUF_TILE_BITS.get(t, 32.0) for t in GGUF_TYPES] == tile_bits
    assert tiles.weight_bytes == int(sum(b * 64 * 256 for b in tile_bits) // 8) + 256 * 4


def test_unreadable_inputs_raise_estimate_errors(tmp_path: Path) -> None:
    with pytest.raises(EstimateError, match=r"config\.json"):
        estimate_memory(tmp_path, ServingSettings())
    (tmp_path / "config.json").write_text(json.dumps(GEMMA3))
    with pytest.raises(EstimateError, match=r"no \.safetensors"):
        estimate_memory(tmp_path, ServingSettings())
    (tmp_path / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(EstimateError, match="header"):
        estimate_memory(tmp_path, ServingSettings())
    with pytest.raises(ValueError, match="dtype"):
        ServingSettings(dtype="int3")


def test_the_estimates_defaults_are_the_servers() -> None:
    """An estimate made without the serving flags (the loader Job passes only those the spec sets)
    describes the server started without them: the defaults are the engine's, not vLLM's GPU 256 seats."""
    from server.config import CacheConfig, EngineConfig

    settings, engine = ServingSettings(), EngineConfig()
    assert settings.max_num_seqs == engine.max_num_seqs
    assert settings.block_size == CacheConfig().block_size
    assert settings.max_num_batched_tokens == engine.max_num_batched_tokens


def test_the_loader_cli_passes_the_step_flags_to_the_estimate(tmp_path: Path) -> None:
    """`python -m server.download --memory-estimate-file` reads --max-num-seqs and the step flags
    (--max-num-batched-tokens: the chunk a windowed layer holds besides its window); left out, the
    server's defaults."""
    import argparse

    from server.download import write_memory_estimate

    folder = _write_folder(tmp_path / "m", GEMMA3)
    out = tmp_path / "est.json"

    def run(**flags: object) -> dict[str, int]:
        base = {
            "dtype": "bfloat16",
            "device": "cpu",
            "quantize": None,
            "max_model_len": 4096,
            "kv_cache_dtype": "auto",
            "kv_cache_memory": None,
            "memory_estimate_file": out,
            "max_num_seqs": None,
            "block_size": None,
            "tensor_parallel_size": 1,
            "max_num_batched_tokens": None,
        }
        write_memory_estimate(argparse.Namespace(**(base | flags)), folder)
        return json.loads(out.read_text())  # type: ignore[no-any-return]

    default = run()
    assert default["max_num_seqs"] == 64
    layer_token = 2 * 2 * 32 * 2
    # the windowed layers hold 512 + 2 x 16 + the step's chunk: 2048 by default, 256 when passed
    assert default["kv_window_bytes_per_sequence"] == 5 * (544 + 2048) * layer_token
    small = run(max_num_batched_tokens=256, max_num_seqs=3)
    assert small["max_num_seqs"] == 3
    assert small["kv_window_bytes_per_sequence"] == 5 * 800 * layer_token
