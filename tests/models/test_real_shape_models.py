"""benchmarks/real_shape_models.py (issue 49 item 1): the shapes are the public models' (parameter counts
of their checkpoints), and a made folder loads into our model with greedy decoding that only emits ids
the tokenizer has."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from benchmark_modules import load_benchmark


def _maker() -> Any:
    return load_benchmark("real_shape_models.py")


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("llama-3.2-1b", 1_235_814_400),  # meta-llama/Llama-3.2-1B's safetensors (tied embedding)
        ("qwen3-4b", 4_022_468_096),  # Qwen/Qwen3-4B's safetensors (tied embedding)
        ("gemma-3-1b", 999_885_952),  # google/gemma-3-1b-pt's safetensors (tied 262,144 x 1152 embedding)
        ("phi-4-mini", 3_836_021_760),  # microsoft/Phi-4-mini-instruct's safetensors (fused qkv, gate_up)
        ("qwen3-moe-2b", None),  # ours: 16 of Qwen3-30B-A3B's 48 layers, 16 of its 128 experts
    ],
)
def test_real_shapes_have_the_public_models_sizes(name: str, params: int | None) -> None:
    m = _maker()
    total = sum(int(torch.Size(shape).numel()) for _, shape in m.tensor_shapes(m.SHAPES[name]))
    if params is not None:
        assert total == params
    else:
        assert 2.0e9 < total <= 3.0e9  # issue 49: a MoE of at most 3B total parameters


def test_the_smollm2_shape_is_the_embedded_models(smollm2_dir: Path) -> None:
    """The stand-in for the embedded model (the device machine's tests) has its tensors' names and shapes."""
    from safetensors import safe_open

    m = _maker()
    theirs: dict[str, tuple[int, ...]] = {}
    for f in smollm2_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            theirs |= {k: tuple(st.get_slice(k).get_shape()) for k in st.keys()}  # noqa: SIM118
    assert dict(m.tensor_shapes(m.SHAPES["smollm2-135m"])) == theirs
    assert "smollm2-135m" not in m.DEFAULT_MODELS


def test_a_made_folder_loads_and_decodes_only_tokenizer_ids(tmp_path: Path, monkeypatch: Any) -> None:
    from server.models.loader import load_model
    from server.quantize.evaluation import SequenceRunner
    from server.tokenizer import Tokenizer

    m = _maker()
    small = {
        **m.SHAPES["qwen3-4b"],
        "num_hidden_layers": 2,
        "hidden_size": 128,
        "intermediate_size": 256,
        "head_dim": 32,
        "vocab_size": m.TOKENIZER_TOKENS + 4096,  # ids beyond the tokenizer, as in the real shapes
    }
    monkeypatch.setitem(m.SHAPES, "tiny-qwen3", small)
    monkeypatch.setattr(m, "SHARD_BYTES", 8 << 20)  # several shards and the index
    made = m.make_hf_folder("tiny-qwen3", tmp_path)
    folder = Path(made["folder"])
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    model = load_model(folder, torch.float32, torch.device("cpu"), 64).model  # the server's loader
    ids = Tokenizer(folder).encode("The history of the printing press")
    for _ in range(12):  # greedy, the whole sequence each time (tiny model)
        logits = SequenceRunner(model, len(ids)).logits(torch.tensor(ids))  # [T, vocab]
        assert logits.shape[1] == small["vocab_size"]
        ids.append(int(logits[-1].argmax()))
    assert all(0 <= t < m.TOKENIZER_TOKENS for t in ids[-12:]), ids


def _logits(model: Any, ids: list[int]) -> torch.Tensor:  # -> [T, vocab] fp32
    """One causal prefill through the model's own forward (every layer kind: SequenceRunner runs the
    Llama layer only), torch attention, a cache per layer."""
    import math

    from server.attention.torch_backend import TorchAttentionBackend
    from server.quantize.evaluation import _single_sequence_metadata

    cfg, t, bs = model.config, len(ids), 16
    shape = (math.ceil(t / bs), bs, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in model.decoder_layers()]
    meta = _single_sequence_metadata(t, bs, torch.device("cpu"))
    with torch.inference_mode():
        h = model(torch.tensor(ids), torch.arange(t), caches, meta, TorchAttentionBackend(bs))  # [T, hidden]
        return model.compute_logits(h)


def _tiny(m: Any, name: str, **over: Any) -> dict[str, Any]:
    """SHAPES[name] at a tiny size, keeping what makes it that architecture."""
    return {**m.SHAPES[name], "num_hidden_layers": 2, "vocab_size": m.TOKENIZER_TOKENS + 4096, **over}


@pytest.mark.parametrize(
    ("name", "over"),
    [
        # two windowed layers of 8 then a global one: prompts here run past the window
        (
            "gemma-3-1b",
            {
                "num_hidden_layers": 3,
                "hidden_size": 64,
                "intermediate_size": 128,
                "head_dim": 32,
                "query_pre_attn_scalar": 32,
                "sliding_window": 8,
                "sliding_window_pattern": 3,
                "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            },
        ),
        # 4 heads of 32 with 3/4 rotated: 12 LongRoPE factors per list
        (
            "phi-4-mini",
            {
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 12, "long_factor": [2.0] * 12},
            },
        ),
    ],
)
def test_gemma3_and_phi4_shapes_load_as_transformers_reads_them(
    tmp_path: Path, monkeypatch: Any, name: str, over: dict[str, Any]
) -> None:
    """The folder's tensors are the checkpoint's names and shapes: our loader and transformers both load
    it (transformers strictly: no missing or unexpected weights) and agree on greedy tokens, which stay
    within the tokenizer; Gemma's norms are the identity under its (1 + w) scaling."""
    from transformers import AutoModelForCausalLM

    from server.models.loader import load_model
    from server.tokenizer import Tokenizer

    m = _maker()
    monkeypatch.setitem(m.SHAPES, f"tiny-{name}", _tiny(m, name, **over))
    folder = Path(m.make_hf_folder(f"tiny-{name}", tmp_path)["folder"])
    loaded: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    ref, info = loaded
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ours = load_model(folder, torch.float32, torch.device("cpu"), 64).model
    tok = Tokenizer(folder)
    ids = tok.encode("The history of the printing press in Europe")
    for _ in range(8):
        logits = _logits(ours, ids)  # [T, vocab]
        with torch.inference_mode():
            want = ref(torch.tensor([ids])).logits[0, -1]  # [vocab]
        assert int(logits[-1].argmax()) == int(want.argmax())
        ids.append(int(logits[-1].argmax()))
    assert all(0 <= t < m.TOKENIZER_TOKENS for t in ids[-8:]), ids
    if name == "gemma-3-1b":
        # llama.cpp's Gemma 3 converter keeps as many embedding rows as the tokenizer has tokens
        assert tok.vocab_size == m.TOKENIZER_TOKENS + 4096
