"""config.json -> layer contract for the formats the parity tests' transformers 5 configs do not write:
the older published configs (top-level rope_theta / rope_scaling, no layer_types), and what is refused."""

from __future__ import annotations

from typing import Any

import pytest

from server.distributed.sharding import TensorParallelConfigError, validate_tensor_parallel
from server.models.arch import UnsupportedModelError
from server.models.registry import ARCHITECTURES, arch_from_hf, check_servable


def _base(arch: str, model_type: str, **kw: Any) -> dict[str, Any]:
    cfg = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
    }
    cfg.update(kw)
    return cfg


def test_gemma3_published_config_layout() -> None:
    """Gemma 3 as published (transformers 4.50): sliding_window_pattern 6, rope_local_base_freq for the
    sliding layers, linear rope_scaling for the global ones only."""
    cfg = _base(
        "Gemma3ForCausalLM",
        "gemma3_text",
        head_dim=16,
        query_pre_attn_scalar=256,
        sliding_window=1024,
        sliding_window_pattern=6,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        hidden_activation="gelu_pytorch_tanh",
    )
    a = arch_from_hf(cfg)
    sliding = [s.sliding_window is not None for s in a.layers]
    assert sliding == [True] * 5 + [False]
    local, full = a.layers[0].rope, a.layers[5].rope
    assert local is not None and full is not None
    assert (local.theta, local.kind) == (10000.0, "default")
    assert (full.theta, full.kind, dict(full.scaling or ())["factor"]) == (1000000.0, "linear", 8.0)
    assert a.layers[0].attn_scale == 256**-0.5 and a.layers[0].qk_norm == "head"
    assert a.embedding_multiplier == 64**0.5 and a.tie_word_embeddings
    check_servable(a, 1024)
    check_servable(a, 8192)  # windows are served past their length (every backend masks them)


def test_gemma2_without_layer_types_slides_on_even_layers() -> None:
    cfg = _base(
        "Gemma2ForCausalLM",
        "gemma2",
        head_dim=16,
        sliding_window=4096,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=144,
    )
    a = arch_from_hf(cfg)
    assert [s.sliding_window for s in a.layers] == [4096, None] * 3
    assert {s.attn_softcap for s in a.layers} == {50.0} and a.final_logit_softcap == 30.0


def test_smollm3_default_no_rope_interval() -> None:
    a = arch_from_hf(_base("SmolLM3ForCausalLM", "smollm3", num_hidden_layers=8))
    assert [s.rope is not None for s in a.layers] == [True, True, True, False] * 2


def test_phi3_window_and_gemma_activation_refusals() -> None:
    phi = arch_from_hf(_base("Phi3ForCausalLM", "phi3", sliding_window=2047))
    check_servable(phi, 4096)  # its window is served past 2047 tokens
    assert {s.sliding_window for s in phi.layers} == {2047}
    with pytest.raises(UnsupportedModelError, match="hidden_activation 'relu'"):
        arch_from_hf(_base("GemmaForCausalLM", "gemma", head_dim=16, hidden_activation="relu"))


def test_only_llama_layers_take_the_fused_path_and_tensor_parallelism() -> None:
    """The decode graph, the fused CPU ops and tensor parallelism serve ArchConfig.is_llama only;
    the registry's llama_layer flag (docs/models.md's column) says the same."""
    configs = {
        "GraniteForCausalLM": _base("GraniteForCausalLM", "granite", attention_multiplier=0.1),
        "Olmo2ForCausalLM": _base("Olmo2ForCausalLM", "olmo2"),
        "SmolLM3ForCausalLM": _base("SmolLM3ForCausalLM", "smollm3"),
        "Phi3ForCausalLM": _base("Phi3ForCausalLM", "phi3", partial_rotary_factor=0.5),
        "GemmaForCausalLM": _base("GemmaForCausalLM", "gemma", head_dim=16),
        "Gemma2ForCausalLM": _base("Gemma2ForCausalLM", "gemma2", head_dim=16),
        "Gemma3ForCausalLM": _base("Gemma3ForCausalLM", "gemma3_text", head_dim=16),
        "LlamaForCausalLM": _base("LlamaForCausalLM", "llama"),
        "Qwen3ForCausalLM": _base("Qwen3ForCausalLM", "qwen3", head_dim=32),
    }
    for name, cfg in configs.items():
        a = arch_from_hf(cfg)
        assert a.is_llama == ARCHITECTURES[name].llama_layer, name
        if not a.is_llama:
            with pytest.raises(TensorParallelConfigError, match="Llama layer only"):
                validate_tensor_parallel(a, 2)
            validate_tensor_parallel(a, 1)
