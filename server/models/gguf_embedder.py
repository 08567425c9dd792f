"""An EmbeddingGemma GGUF (llama.cpp's `gemma-embedding` architecture) as a sentence-transformers folder
that the pooling loader serves (server/pooling/model.py), converted once into the GGUF cache.

What the file carries (convert_hf_to_gguf.py's `EmbeddingGemma`, llama.cpp's models/gemma-embedding.cpp):
Gemma 3's tensors and keys (norms stored + 1, q/k norms, `attention.sliding_window` as config.json
has it, the window pattern: `attention.sliding_window_pattern` or 6), attention never causal and
windows symmetric (our config: `use_bidirectional_attention`), `gemma-embedding.pooling_type`
(gguf-py `PoolingType`: 1 mean, 2 CLS, 3 last token), and, when converted with
`--sentence-transformers-dense-modules`, the 2_Dense / 3_Dense projections as `dense_2.weight`
[`dense_2_feat_out`, hidden] and `dense_3.weight` [hidden, `dense_3_feat_in`] (no bias, identity
activation: EmbeddingGemma's). llama.cpp normalizes the pooled vector by default (`--embd-normalize
2`), as EmbeddingGemma's Normalize module does. Not in the file: the named prompts
(`task: search result | query: ` ...): a client adds them to its text.

Refused: a file without `pooling_type`, or without the Dense projections (converted without
`--sentence-transformers-dense-modules`: its vectors are the trunk's mean, not the model's embedding).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from server.gguf_file import shared_gguf_readers
from server.models.layer_spec import UnsupportedModelError

ARCHITECTURE = "gemma-embedding"
# gguf-py constants.PoolingType -> sentence-transformers' pooling_mode
_POOLING = {1: "mean", 2: "cls", 3: "lasttoken"}
_IDENTITY = "torch.nn.modules.linear.Identity"


def is_gguf_embedder(path: Path) -> bool:
    """Whether `path` is a .gguf file of llama.cpp's gemma-embedding architecture."""
    from server.models.gguf_config import gguf_architecture

    return path.is_file() and path.suffix == ".gguf" and gguf_architecture(path) == ARCHITECTURE


def _dense_and_pooling(path: Path) -> tuple[str, dict[str, torch.Tensor]]:
    """(pooling mode, {"dense_2": [out, hidden], "dense_3": [hidden, in]} fp32)."""
    import numpy as np
    from gguf.quants import dequantize

    from server.gguf_file import open_gguf

    reader = open_gguf(path)
    field = reader.fields.get(f"{ARCHITECTURE}.pooling_type")
    kind = None if field is None else int(field.contents())
    if kind not in _POOLING:
        raise UnsupportedModelError(
            f"{path.name}: {ARCHITECTURE}.pooling_type is {kind}; an embedder needs 1 (mean), 2 (CLS) or 3 (last)"
        )
    dense: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        stem = t.name.removesuffix(".weight")
        if stem in ("dense_2", "dense_3"):
            shape = [int(s) for s in reversed(t.shape.tolist())]
            dense[stem] = torch.from_numpy(dequantize(t.data, t.tensor_type).astype(np.float32)).reshape(
                shape
            )
    if set(dense) != {"dense_2", "dense_3"}:
        raise UnsupportedModelError(
            f"{path.name} lacks EmbeddingGemma's Dense projections (dense_2.weight, dense_3.weight): convert "
            "it with convert_hf_to_gguf.py --sentence-transformers-dense-modules"
        )
    return _POOLING[kind], dense


def _write_modules(folder: Path, mode: str, dense: dict[str, torch.Tensor], hidden: int) -> None:
    modules: list[dict[str, Any]] = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": hidden, "pooling_mode": mode})
    )
    for idx, (stem, sub) in enumerate((("dense_2", "2_Dense"), ("dense_3", "3_Dense")), start=2):
        w = dense[stem]  # [out, in]
        (folder / sub).mkdir()
        (folder / sub / "config.json").write_text(
            json.dumps(
                {
                    "in_features": int(w.shape[1]),
                    "out_features": int(w.shape[0]),
                    "bias": False,
                    "activation_function": _IDENTITY,
                }
            )
        )
        save_file({"linear.weight": w.contiguous()}, str(folder / sub / "model.safetensors"))
        modules.append(
            {"idx": idx, "name": str(idx), "path": sub, "type": "sentence_transformers.models.Dense"}
        )
    modules.append(
        {"idx": 4, "name": "4", "path": "4_Normalize", "type": "sentence_transformers.models.Normalize"}
    )
    (folder / "4_Normalize").mkdir()
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))


def gguf_embedder_folder(path: Path, cache_dir: Path) -> Path:
    """The sentence-transformers folder of a gemma-embedding GGUF (weights dequantized to fp32 by our
    GGUF reader), cached under `cache_dir` like a GGUF's conversion (keyed by the file and the writer,
    manifest checked). Raises UnsupportedModelError (see the module docstring)."""
    from server.models.gguf_config import hf_config_from_gguf
    from server.models.loader import (
        MANIFEST_NAME,
        _dequantized_state,
        _gguf_cache_folder,
        _manifest,
        _publish,
        _reusable,
        gguf_tokenizer,
    )

    target = _gguf_cache_folder(path, cache_dir).with_name(
        _gguf_cache_folder(path, cache_dir).name + "-embed"
    )
    if _reusable(target, path, ("embedder",)):
        return target
    with shared_gguf_readers():  # the metadata's questions, one parse; the tensors' read its own
        mode, dense = _dense_and_pooling(path)
        cfg = hf_config_from_gguf(path)
        tok = gguf_tokenizer(path)
    state = _dequantized_state(path)
    state.pop("lm_head.weight", None)  # a headless model: the embedding is not a head here
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".embed-", dir=cache_dir))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tok.save_pretrained(str(tmp))
        _write_modules(tmp, mode, dense, int(cfg["hidden_size"]))
        (tmp / MANIFEST_NAME).write_text(json.dumps(_manifest(path, "embedder"), indent=2))
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
