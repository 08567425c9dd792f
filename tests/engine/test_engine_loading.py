"""Model resolution and startup errors: what users get for a wrong --model or an unknown architecture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from server.models.arch import UnsupportedModelError
from server.models.loader import ModelLoadError, convert_gguf, load_model, resolve_model
from server.models.registry import arch_from_hf


def test_missing_path_names_what_was_expected(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="Hugging Face folder"):
        resolve_model(str(tmp_path / "nope"))


def test_folder_without_config_or_weights(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"\*\.safetensors"):
        resolve_model(str(tmp_path))


def test_hub_id_offline_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="hub"):
        resolve_model("some-org/some-model-that-is-not-cached", cache_dir=tmp_path)


def test_unsupported_architecture() -> None:
    with pytest.raises(UnsupportedModelError, match="expected one of"):
        arch_from_hf({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(UnsupportedModelError, match="layer_types"):
        arch_from_hf(
            {
                "architectures": ["Qwen2ForCausalLM"],
                "use_sliding_window": True,
                "sliding_window": 8,
                "layer_types": ["chunked_attention"],
                "num_attention_heads": 2,
                "hidden_size": 8,
                "vocab_size": 16,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
            }
        )


def test_checkpoint_missing_tensors(tiny_model_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file, save_file

    src = tiny_model_factory("llama")
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    state = load_file(str(next(src.glob("*.safetensors"))))
    state.pop("model.layers.1.mlp.down_proj.weight")
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="lacks 1 tensors"):
        load_model(bad, torch.float32, torch.device("cpu"), 64)


def test_qwen2_untied_loads_bias_and_lm_head(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    folder = tiny_model_factory("qwen2", tie=False)
    cfg = json.loads((folder / "config.json").read_text())
    loaded = load_model(folder, torch.bfloat16, torch.device("cpu"), 64)
    m = loaded.model
    assert loaded.arch.qkv_bias and not loaded.arch.o_bias
    assert m.model.layers[0].self_attn.q_proj.bias is not None
    assert m.lm_head.weight.data_ptr() != m.model.embed_tokens.weight.data_ptr()
    assert m.lm_head.weight.dtype == torch.bfloat16
    assert loaded.num_parameters > cfg["vocab_size"] * cfg["hidden_size"] * 2


def test_gguf_conversion_is_cached(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    from server.models.loader import embedded_gguf_path

    def no_conversion(*a: object, **k: object) -> None:
        raise AssertionError("the GGUF was dequantized again instead of read from the cache")

    # The session fixture converted it already: a second resolve must reuse the cache.
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_conversion)
    again = convert_gguf(embedded_gguf_path(), smollm2_dir.parent)
    assert again == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_size > 100_000_000


def test_auto_dtype_follows_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from server.models import loader

    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: True)
    assert loader.resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: False)
    assert loader.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert loader.resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        loader.resolve_dtype("int3", torch.device("cpu"))


@pytest.mark.parametrize(
    ("arch", "tie"), [("llama", True), ("qwen2", False), ("qwen3", True), ("qwen3", False)]
)
def test_logical_parameter_count_matches_the_dense_model(tiny_model_factory, arch: str, tie: bool) -> None:  # type: ignore[no-untyped-def]
    loaded = load_model(tiny_model_factory(arch, tie=tie), torch.float32, torch.device("cpu"), 64)
    assert loaded.num_parameters == sum(p.numel() for p in loaded.model.parameters())
