"""RoPE scaling kinds against transformers' own rope init (inverse frequencies and attention factor),
and through a whole model: a tiny Llama with each kind, greedy tokens and prompt logprobs."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_driver import TOKENIZER_FILES, run_staggered
from prompt_logprobs import engine_prompt_logprobs, hf_prompt_logprobs

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.models.arch import UnsupportedModelError
from server.models.registry import arch_from_hf, check_servable
from server.models.rope import RotaryEmbedding, rope_inv_freq
from server.request import SamplingParams

MAX_LEN = 256
KINDS: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 64,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
        "beta_fast": 24,
        "beta_slow": 2,
    },
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.2 * i for i in range(16)],
        "long_factor": [3.0 + 0.5 * i for i in range(16)],
        "original_max_position_embeddings": 64,
    },
}


def _llama_config(params: dict[str, Any], max_positions: int = MAX_LEN) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152,
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_theta": 10000.0, **params},
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )


@pytest.mark.parametrize("name", list(KINDS))
@pytest.mark.parametrize("seq_len", [32, MAX_LEN])
def test_inv_freq_and_attention_factor_match_transformers(name: str, seq_len: int) -> None:
    """`seq_len` is the length served (LongRoPE's choice between short and long factors)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _llama_config(KINDS[name])
    ours = arch_from_hf(cfg.to_dict()).layers[0].rope
    assert ours is not None and ours.kind == KINDS[name]["rope_type"]
    inv, factor = rope_inv_freq(ours, seq_len, MAX_LEN)
    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS[ours.kind](cfg, None, seq_len)
    torch.testing.assert_close(inv, ref_inv.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor, rel=1e-9)


def test_cos_sin_tables_match_transformers() -> None:
    """The served tables (yarn: cos/sin times its attention factor) equal the reference rotary's."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = _llama_config(KINDS["yarn"])
    ours = RotaryEmbedding(arch_from_hf(cfg.to_dict()).layers[0].rope, MAX_LEN, MAX_LEN)  # type: ignore[arg-type]
    ref = LlamaRotaryEmbedding(cfg)
    pos = torch.arange(MAX_LEN)[None]
    cos, sin = ref(torch.zeros(1, MAX_LEN, 128), pos)
    torch.testing.assert_close(ours.cos, cos[0], rtol=0, atol=2e-6)
    half = sin.shape[-1] // 2
    torch.testing.assert_close(ours.sin[:, half:], sin[0, :, half:], rtol=0, atol=2e-6)
    torch.testing.assert_close(ours.sin[:, :half], -sin[0, :, :half], rtol=0, atol=2e-6)


def test_dynamic_beyond_max_position_embeddings_is_refused() -> None:
    arch = arch_from_hf(_llama_config(KINDS["dynamic"]).to_dict())
    check_servable(arch, MAX_LEN)  # exact: plain RoPE up to max_position_embeddings
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        check_servable(arch, MAX_LEN + 1)


def test_unknown_rope_type_is_refused() -> None:
    cfg = _llama_config(KINDS["linear"]).to_dict()
    cfg["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "su-perscaled", "factor": 2.0}
    with pytest.raises(UnsupportedModelError, match="su-perscaled"):
        arch_from_hf(cfg)


@pytest.mark.parametrize("name", ["yarn", "longrope", "llama3"])
def test_model_parity_per_rope_kind(tmp_path: Path, smollm2_dir: Path, name: str) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_llama_config(KINDS[name]), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(tmp_path))
    for f in TOKENIZER_FILES:
        if (smollm2_dir / f).exists():
            shutil.copy(smollm2_dir / f, tmp_path / f)
    # longrope: served up to its original length (64), transformers' short factors
    max_len = 64 if name == "longrope" else MAX_LEN
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(tmp_path), dtype="float32", max_model_len=max_len),
            cache=CacheConfig(block_size=4, num_kv_blocks=64),
            max_num_batched_tokens=8,
        )
    )
    prompts = [engine.tokenizer.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
    ref = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=2)  # type: ignore[operator]
            ref.append(ids[0, len(p) :].tolist())
    assert run_staggered(engine, prompts, SamplingParams(max_tokens=10, temperature=0.0)) == ref
    ours = engine_prompt_logprobs(engine, prompts[0])
    torch.testing.assert_close(
        ours, hf_prompt_logprobs(tmp_path, prompts[0], torch.float32), atol=2e-4, rtol=0
    )
