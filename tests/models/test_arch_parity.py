"""Parity with transformers for every architecture beyond Llama/Qwen (server/models/archs/): tiny random
models built here with transformers' own config classes, saved as Hugging Face folders, loaded by our
loader and served by our engine: greedy tokens equal token for token (staggered arrivals with chunked
prefill, then a prefix-cache hit) and prompt logprobs within 2e-4 of transformers' fp32 ones."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_driver import TOKENIZER_FILES, run_staggered
from prompt_logprobs import engine_prompt_logprobs, hf_greedy, hf_prompt_logprobs

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.request import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):",
    "In 1969, the first humans landed on the Moon. The mission was called",
]
MAX_LEN = 512  # max_position_embeddings of the tiny models: the engine's max_model_len
LOGPROB_TOL = 2e-4  # fp32 both sides; attention sums in another order


def _common(tie: bool) -> dict[str, Any]:
    return dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LEN,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        rms_norm_eps=1e-5,
    )


def _config(kind: str, tie: bool) -> Any:
    import transformers as tf

    c = _common(tie)
    if kind == "granite":
        return tf.GraniteConfig(
            **c,
            embedding_multiplier=6.0,
            residual_multiplier=0.4,
            attention_multiplier=0.09,
            logits_scaling=3.0,
        )
    if kind == "olmo2":
        return tf.Olmo2Config(**c)
    if kind == "smollm3":
        return tf.SmolLM3Config(**c, no_rope_layers=[1, 0, 1, 0])
    if kind == "phi3":
        # LongRoPE served up to original_max_position_embeddings: both sides use the short factors
        # (and the attention factor sqrt(1 + ln 4 / ln 512)).
        rd = 12  # partial_rotary_factor 0.75 of head_dim 16
        c["max_position_embeddings"] = 4 * MAX_LEN
        return tf.Phi3Config(
            **c,
            original_max_position_embeddings=MAX_LEN,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.1 * i for i in range(rd // 2)],
                "long_factor": [2.0 + 0.5 * i for i in range(rd // 2)],
                "original_max_position_embeddings": MAX_LEN,
            },
            sliding_window=None,
        )
    if kind == "gemma":
        return tf.GemmaConfig(**c, head_dim=16)
    if kind == "gemma2":
        return tf.Gemma2Config(
            **c,
            head_dim=16,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,  # small enough to bend the random model's scores
            final_logit_softcapping=5.0,
            sliding_window=MAX_LEN,
        )
    if kind == "gemma3":
        return tf.Gemma3TextConfig(
            **c,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=MAX_LEN,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
            },
        )
    raise ValueError(kind)


def build(out: Path, tokenizer_from: Path, kind: str, tie: bool, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(kind, tie), dtype=torch.float32)
    with torch.no_grad():
        # Larger-than-default weights so greedy argmax is not decided by noise; norms away from their
        # identity value so a missing or misapplied norm weight shows.
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            elif name.endswith("norm.weight"):
                p.normal_(0.0 if kind.startswith("gemma") else 1.0, 0.3)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, out / name)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Callable[[str, bool], Path]:
    made: dict[tuple[str, bool], Path] = {}

    def make(kind: str, tie: bool) -> Path:
        if (kind, tie) not in made:
            made[kind, tie] = build(tmp_path_factory.mktemp(f"tiny-{kind}"), smollm2_dir, kind, tie)
        return made[kind, tie]

    return make


CASES = [
    ("granite", False),
    ("granite", True),
    ("olmo2", False),
    ("smollm3", True),
    ("phi3", False),
    ("gemma", True),
    ("gemma2", True),
    ("gemma3", True),
]


@pytest.mark.parametrize(("kind", "tie"), CASES)
def test_greedy_and_prompt_logprob_parity(tiny: Callable[[str, bool], Path], kind: str, tie: bool) -> None:
    folder = tiny(kind, tie)
    engine = LLMEngine(
        EngineConfig(
            # Phi-3's max_position_embeddings is 4 x MAX_LEN: served up to its original length, where
            # its short LongRoPE factors are transformers' choice too
            model=ModelConfig(model=str(folder), dtype="float32", max_model_len=MAX_LEN),
            cache=CacheConfig(block_size=4, num_kv_blocks=128, enable_prefix_caching=True),
            max_num_batched_tokens=8,  # prompts are chunked, and chunks share steps with decodes
        )
    )
    a = engine.loaded.arch
    assert a.num_heads != a.num_kv_heads and a.tie_word_embeddings == tie
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    ref = hf_greedy(folder, prompts, 12)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    assert run_staggered(engine, prompts, params) == ref
    # the same prompts again: their full blocks come from the prefix cache
    hits = engine.stats().prefix_cache_hits
    assert [engine.generate([p], params)[0] for p in prompts] == ref
    assert engine.stats().prefix_cache_hits > hits
    ours = engine_prompt_logprobs(engine, prompts[1])
    theirs = hf_prompt_logprobs(folder, prompts[1], torch.float32)
    torch.testing.assert_close(ours, theirs, atol=LOGPROB_TOL, rtol=0)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.parametrize(
    ("kind", "backend"),
    # Triton's engine case: tests/kernels/test_kern_softcap.py (its interpreter is set up there)
    [("gemma2", "cpu"), ("gemma2", "torch"), ("gemma3", "auto")],
)
def test_interleaved_windows_shorter_than_the_text(
    tiny: Callable[[str, bool], Path], kind: str, backend: str
) -> None:
    """Gemma 2/3 with a 6-token window on their sliding layers, prompts and outputs well past it: the
    engine (each layer's window and Gemma 2's attention soft-cap handed to the backend; the global
    layers keep the whole context) equals transformers' eager attention token for token, through
    chunked prefill and a prefix-cache hit, on each CPU attention backend.
    Before the window reached the backends, such a model was refused at load; before the soft-cap did,
    Gemma 2's layers bypassed the backend for a per-sequence torch loop."""
    import json

    from transformers import AutoModelForCausalLM

    src = tiny(kind, True)
    folder = src.parent / f"{kind}-window-6"
    if not folder.exists():
        shutil.copytree(src, folder)
        hf = json.loads((folder / "config.json").read_text())
        hf["sliding_window"] = 6
        (folder / "config.json").write_text(json.dumps(hf))
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(folder), dtype="float32", max_model_len=MAX_LEN),
            cache=CacheConfig(block_size=4, num_kv_blocks=128, enable_prefix_caching=True),
            max_num_batched_tokens=8,
            attention_backend=backend,
        )
    )
    windows = {s.sliding_window for s in engine.loaded.arch.layers}
    assert windows == {6, None}  # interleaved: windowed and global layers
    # what each backend call was handed: (query rows, window, soft-cap)
    calls: list[tuple[int, int | None, float]] = []
    backend_forward = engine.runner.backend.forward

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append((args[0].shape[0], kwargs.get("sliding_window"), kwargs.get("softcap", 0.0)))
        return backend_forward(*args, **kwargs)

    engine.runner.backend.forward = spy  # type: ignore[method-assign]
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    hf_model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager"
    )
    ref = []
    with torch.inference_mode():
        for p in prompts:
            ids = hf_model.generate(  # type: ignore[operator,misc]
                torch.tensor([p]), max_new_tokens=16, do_sample=False, min_new_tokens=0, eos_token_id=2
            )
            ref.append(ids[0, len(p) :].tolist())
    params = SamplingParams(max_tokens=16, temperature=0.0)
    assert run_staggered(engine, prompts, params) == ref
    assert [engine.generate([p], params)[0] for p in prompts] == ref
    # Gemma 2's soft-cap reaches the backend on windowed and global layers, for prompt chunks (and, where
    # the fused CPU ops do not take pure decode steps, for decodes); Gemma 3 has none
    want_cap = 2.0 if kind == "gemma2" else 0.0
    assert {cap for _, _, cap in calls} == {want_cap}
    assert {w for n, w, _ in calls if n > 1} == {6, None}


def test_calibrated_quantization_refuses_other_layers(
    tiny: Callable[[str, bool], Path], tmp_path: Path
) -> None:
    """python -m server.quantize calibrates through the Llama layer: another architecture is refused,
    not quantized against the wrong forward pass."""
    from server.quantize import QuantizeOptions, quantize_model

    with pytest.raises(
        ValueError, match="GraniteForCausalLM: calibrated quantization runs the Llama layer only"
    ):
        quantize_model(str(tiny("granite", False)), tmp_path / "out", QuantizeOptions("rtn", calib_tokens=16))
    assert not (tmp_path / "out").exists()
