"""GGUF files of every architecture beyond Llama/Mistral/Qwen2 (qwen3, granite, smollm3, olmo2, phi3,
gemma, gemma2, gemma3), written with gguf-py as llama.cpp's converter writes them (tests/models/
gguf_archs.py), served as they are (quantized tensors kept): our config and tokenizer from the file's
metadata, and greedy tokens equal to transformers' on the Hugging Face folder that holds the file's
weights, prompt logprobs within TOL[fmt]. The random weights are test_arch_parity.py's (its configs,
made expressible in a GGUF where llama.cpp fixes a value: Gemma 2's query_pre_attn_scalar = head_dim,
Gemma 3's window pattern of 6, SmolLM3's NoPE every 4th layer)."""

from __future__ import annotations

import json
import math
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_driver import run_staggered
from gguf_archs import CHAT_TEMPLATE, tiny_vocab, write_arch_gguf
from prompt_logprobs import engine_prompt_logprobs, hf_prompt_logprobs
from test_arch_parity import MAX_LEN, _config

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.models.registry import arch_from_hf
from server.quant.block_linear import BlockQuantLinear
from server.quant.gemm_dtype import apply_gemm_dtype
from server.request import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):",
]
NEW_TOKENS = 10
# One file per architecture mixes the types a Q4_K_M file holds: 2-D tensors Q8_0, the attention output
# and ffn_down Q6_K, ffn_gate/ffn_up Q4_K, the token embedding F16 (served as fp32, named in
# gguf_dequantized); rows a multiple of 256 so the k-quants apply (a shorter row falls back to Q8_0).
FMTS = {
    "*": "Q8_0",
    "attn_output": "Q6_K",
    "ffn_gate": "Q4_K",
    "ffn_up": "Q4_K",
    "ffn_down": "Q6_K",
    "token_embd": "F16",
}
# |ours - transformers| on each prompt logprob, both over the file's weights (the CPU kernel's fp32 path)
TOL = 1e-3


def _gguf_config(kind: str) -> Any:
    import transformers as tf
    from test_arch_parity import _common

    tie = kind not in ("granite", "olmo2", "phi3")
    if kind == "qwen3":
        cfg = tf.Qwen3Config(**_common(tie), head_dim=96)  # head_dim != hidden / heads: key_length
    else:
        cfg = _config(kind, tie)
    cfg.hidden_size, cfg.intermediate_size = 256, 512
    cfg.vocab_size = len(tiny_vocab())
    cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = tiny_vocab().index("<|endoftext|>")
    if kind == "gemma2":
        cfg.query_pre_attn_scalar = cfg.head_dim  # llama.cpp: head_dim outside the 27B shape
        cfg.sliding_window = 8
    if kind == "gemma3":
        cfg.num_hidden_layers = 6
        cfg.layer_types = ["sliding_attention"] * 5 + ["full_attention"]  # llama.cpp's pattern of 6
        cfg.sliding_window = 8
    if kind == "smollm3":
        cfg.no_rope_layers = [1, 1, 1, 0]  # llama.cpp's n_no_rope_layer_step = 4
    if kind == "phi3":  # head_dim 64 now: 48 rotary channels, 24 factors
        rope = dict(cfg.rope_parameters or {})
        rope["short_factor"] = [1.0 + 0.1 * i for i in range(24)]
        rope["long_factor"] = [2.0 + 0.5 * i for i in range(24)]
        cfg.rope_parameters = rope
    return cfg


def _build(out: Path, kind: str) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_gguf_config(kind), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.04)
            elif name.endswith("norm.weight"):
                p.normal_(0.0 if kind.startswith("gemma") else 1.0, 0.3)
    model.save_pretrained(str(out))
    return out


def _close(a: Any, b: Any) -> bool:
    """Equal, floats within float32's rounding (GGUF stores float keys and Phi-3's factors as float32)."""
    if is_dataclass(a) and is_dataclass(b):
        return type(a) is type(b) and all(_close(getattr(a, f.name), getattr(b, f.name)) for f in fields(a))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        return (
            isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-6)
        )
    return bool(a == b)


KINDS = ["qwen3", "granite", "smollm3", "olmo2", "phi3", "gemma", "gemma2", "gemma3"]


def _decoy_tokenizer(folder: Path) -> None:
    """Another tokenizer (two words, no chat template) as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    decoy = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    decoy.pre_tokenizer = pre_tokenizers.Whitespace()
    decoy.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"})
    )


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_loads_to_the_hf_folder_s_logits(kind: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = _build(tmp_path / "hf", kind)
    path = write_arch_gguf(hf, tmp_path / f"{kind}.gguf", tmp_path / "ref", FMTS)
    _decoy_tokenizer(tmp_path)  # beside the file, as a GGUF saved next to its source folder: never read
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(path), max_model_len=MAX_LEN),
            cache=CacheConfig(
                block_size=4, num_kv_blocks=128, enable_prefix_caching=True, cache_dtype="float32"
            ),
            max_num_batched_tokens=8,
        )
    )
    apply_gemm_dtype(engine.loaded.model, torch.float32)
    # the config our reader made of the file's metadata is the one config.json gives
    ours_arch, ref_arch = (
        engine.loaded.arch,
        arch_from_hf(json.loads((tmp_path / "ref" / "config.json").read_text())),
    )
    same = (
        "architecture",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "vocab_size",
        "tie_word_embeddings",
        "embedding_multiplier",
        "logits_divisor",
        "final_logit_softcap",
        "final_norm",
    )
    assert _close([getattr(ours_arch, f) for f in same], [getattr(ref_arch, f) for f in same])
    assert _close(ours_arch.layers, ref_arch.layers), (ours_arch.layers, ref_arch.layers)
    # served quantized, each type in its own blocks; the F16 embedding held as fp32 and named
    down = engine.loaded.model.model.layers[0].mlp.down_proj  # type: ignore[union-attr]
    assert isinstance(down, BlockQuantLinear) and down.method == "q6_k"
    quantization = engine.info.quantization or ""
    assert {"q8_0", "q4_k", "q6_k"} <= set(quantization.removeprefix("gguf-").split("+"))
    assert [d.gguf_type for d in engine.loaded.gguf_dequantized or ()] == ["F16"]
    # the tokenizer and chat template come from the file's metadata
    assert engine.tokenizer.hf.chat_template == CHAT_TEMPLATE
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert engine.tokenizer.decode(chat, skip_special_tokens=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat[0] == tiny_vocab().index("<|im_start|>")  # a control token, whole
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    hf_model = AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "ref"), dtype=torch.float32, attn_implementation="eager"
    )
    ref = []
    with torch.inference_mode():
        for p in prompts:
            ids = hf_model.generate(  # type: ignore[operator,misc]
                torch.tensor([p]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                min_new_tokens=NEW_TOKENS,
                eos_token_id=None,
            )
            ref.append(ids[0, len(p) :].tolist())
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert run_staggered(engine, prompts, params) == ref
    ours = engine_prompt_logprobs(engine, prompts[1])
    theirs = hf_prompt_logprobs(tmp_path / "ref", prompts[1], torch.float32)
    torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.slow  # ~20 s here
def test_an_explicit_dtype_converts_through_our_reader(tmp_path: Path) -> None:
    """`--dtype float32` on a file transformers' GGUF reader refuses (granite): converted once to an
    fp32 folder (our config, our dequantized reading), which loads to the reference's tokens."""
    from transformers import AutoModelForCausalLM

    hf = _build(tmp_path / "hf", "granite")
    path = write_arch_gguf(hf, tmp_path / "granite.gguf", tmp_path / "ref", FMTS)
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(
                model=str(path), dtype="float32", max_model_len=MAX_LEN, cache_dir=tmp_path / "c"
            ),
            cache=CacheConfig(block_size=4, num_kv_blocks=64),
        )
    )
    assert engine.source.gguf is None and (engine.source.folder / "model.safetensors").is_file()
    assert engine.info.quantization is None
    prompt = engine.tokenizer.encode(PROMPTS[1])
    hf_model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ref"), dtype=torch.float32)
    with torch.inference_mode():
        ids = hf_model.generate(  # type: ignore[operator,misc]
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None
        )
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert engine.generate([prompt], params)[0] == ids[0, len(prompt) :].tolist()


def test_the_memory_estimate_of_a_read_architecture_opens_the_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An architecture our config reader knows (qwen3): the estimate hands its open of the file to
    `hf_config_from_gguf` instead of opening it again."""
    from gguf_opens import count_gguf_opens

    from server.memory_estimate import ServingSettings, estimate_memory

    path = write_arch_gguf(
        _build(tmp_path / "hf", "qwen3"), tmp_path / "q.gguf", tmp_path / "ref", {"*": "Q8_0"}
    )
    opened = count_gguf_opens(monkeypatch)
    estimate = estimate_memory(path, ServingSettings(dtype="auto", auto_dtype="float32"))
    assert (
        opened == {("q.gguf", "short"): 1} and estimate.num_layers == _gguf_config("qwen3").num_hidden_layers
    )
