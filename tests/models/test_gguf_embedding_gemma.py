"""EmbeddingGemma as a GGUF (llama.cpp's `gemma-embedding`, server/models/gguf_embedder.py): the tiny
EmbeddingGemma folder of tests/pooling (tests/embedding_models.py: bidirectional Gemma 3, sliding and
full layers interleaved, mean pooling, 2_Dense / 3_Dense, Normalize) written with gguf-py as
convert_hf_to_gguf.py's `EmbeddingGemma` writes it with `--sentence-transformers-dense-modules`
(Gemma 3's tensors with norms + 1, `dense_2.weight` / `dense_3.weight` and their `dense_*_feat_*` keys,
`pooling_type` 1, the window as config.json has it, the per-layer window pattern), the 2-D trunk
weights Q8_0. Served by the pooling loader, its vectors equal the folder's (within Q8_0's error) and the
vectors of a folder holding the file's own dequantized weights (within fp32 summation order). Slow: the
file's tokenizer (SmolLM2's 49152 tokens) is converted from its GGUF metadata."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from embedding_models import GEMMA_CONFIG_WINDOW, build_embedding_gemma
from gguf_vocab import add_embedded_tokenizer
from safetensors.torch import load_file, save_file

from server.models.layer_spec import UnsupportedModelError
from server.pooling.model import PoolingModel, load_pooling_model, resolve_task
from server.pooling.pooler import PoolingMode, finish_embedding

pytestmark = pytest.mark.slow
gguf = pytest.importorskip("gguf")

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog while the cat watches from the fence.",
    "a",
    "Émoji 🚀 and accents: café, naïve, Zürich, and a few more words to pass the window edge.",
]
_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _gguf_name(name: str) -> str:
    name = name.removeprefix("model.")
    if name == "embed_tokens.weight":
        return "token_embd.weight"
    if name == "norm.weight":
        return "output_norm.weight"
    parts = name.split(".")  # layers.N.<module...>.weight
    return f"blk.{parts[1]}.{_LAYER['.'.join(parts[2:-1])]}.{parts[-1]}"


def write_embedding_gemma_gguf(folder: Path, out: Path, ref: Path, dense: bool = True) -> Path:
    """`folder` (build_embedding_gemma's) as a gemma-embedding GGUF; `ref`: a copy of `folder` holding
    the file's weights (Q8_0 ones as gguf-py dequantizes them)."""

    cfg = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    w = gguf.GGUFWriter(str(out), "gemma-embedding")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg["rope_parameters"]
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_sliding_window(GEMMA_CONFIG_WINDOW)  # the converter writes config.json's own value
    w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    w.add_pooling_type(gguf.PoolingType.MEAN)
    add_embedded_tokenizer(w)  # SmolLM2's vocabulary, as the folder has
    kept: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        x = t.float().numpy()
        gname = _gguf_name(name)
        if x.ndim == 1:  # norms: F32, stored + 1 as the converter does
            w.add_tensor(gname, np.ascontiguousarray(x + 1.0, dtype=np.float32))
            kept[name] = t.float()
            continue
        data = gguf.quants.quantize(np.ascontiguousarray(x), gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(gname, data, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        back = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q8_0).reshape(x.shape)
        kept[name] = torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32))
    if dense:
        for stem, sub in (("dense_2", "2_Dense"), ("dense_3", "3_Dense")):
            lin = load_file(str(folder / sub / "model.safetensors"))["linear.weight"].float()
            w.add_dense_features_dims(stem, int(lin.shape[1]), int(lin.shape[0]))
            w.add_tensor(f"{stem}.weight", lin.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    shutil.copytree(folder, ref)
    save_file(kept, str(ref / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> tuple[Path, Path, Path]:
    """(the folder, the GGUF, the folder of the file's weights)."""
    root = tmp_path_factory.mktemp("eg-gguf")
    folder = build_embedding_gemma(smollm2_dir, root / "eg")
    path = write_embedding_gemma_gguf(folder, root / "eg.gguf", root / "ref")
    return folder, path, root / "ref"


def _embed(m: PoolingModel, texts: list[str]) -> torch.Tensor:  # -> [len(texts), dim] float32, one row each
    rows = []
    for text in texts:
        ids = torch.tensor([m.tokenizer.encode(text)])
        out = m.forward(ids, torch.zeros_like(ids), torch.ones_like(ids))
        rows.append(finish_embedding(out, m.pooling.normalize, None))
    return torch.cat(rows)


def test_gguf_embedding_gemma_matches_the_folder(made: tuple[Path, Path, Path]) -> None:
    from server.models.gguf_embedder import gguf_embedder_folder

    folder, path, ref = made
    assert resolve_task(str(path), "auto") == "embed"
    ours = load_pooling_model(gguf_embedder_folder(path, path.parent / "cache"))
    theirs, exact = load_pooling_model(folder), load_pooling_model(ref)
    assert (ours.pooling.mode, ours.pooling.normalize, ours.hidden_size) == (PoolingMode.MEAN, True, 48)
    assert ours.pooling.dense == ("2_Dense", "3_Dense")
    for text in TEXTS:
        assert ours.tokenizer.encode(text) == theirs.tokenizer.encode(text), text
    got = _embed(ours, TEXTS)
    # the file's own weights: only summation order differs
    torch.testing.assert_close(got, _embed(exact, TEXTS), atol=2e-5, rtol=0)
    # the original folder: within Q8_0's error (unit vectors; measured cosine >= 0.9999)
    cos = (got * _embed(theirs, TEXTS)).sum(-1)
    assert cos.min().item() > 0.999, cos


def test_gguf_embedder_without_dense_modules_is_refused(
    made: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    from server.models.gguf_embedder import gguf_embedder_folder

    folder, _, _ = made
    path = write_embedding_gemma_gguf(folder, tmp_path / "nodense.gguf", tmp_path / "ref", dense=False)
    with pytest.raises(UnsupportedModelError, match="--sentence-transformers-dense-modules"):
        gguf_embedder_folder(path, tmp_path / "cache")


def test_gguf_embedding_gemma_served_over_http(made: tuple[Path, Path, Path]) -> None:
    """`--model x.gguf`, task auto: the server embeds (the conversion of the first test reused from the
    same cache), OpenAI /v1/embeddings equal to the file's own weights' folder."""

    import httpx
    from serving import free_port, serve_in_thread

    from server.api.app import create_app
    from server.api.state import ServerState
    from server.config import EngineConfig, ModelConfig, ServerConfig

    _, path, ref = made
    port = free_port()
    model = ModelConfig(
        model=str(path), served_model_name="eg", dtype="float32", cache_dir=path.parent / "cache"
    )
    state = ServerState(
        ServerConfig(engine=EngineConfig(model=model, num_threads=1), host="127.0.0.1", port=port)
    )
    assert state.task == "embed"
    with serve_in_thread(create_app(state), port, name="gguf-embedder") as running:
        url = running.url
        r = httpx.post(f"{url}/v1/embeddings", json={"model": "eg", "input": TEXTS}, timeout=120)
        assert r.status_code == 200, r.text
        got = torch.tensor([d["embedding"] for d in r.json()["data"]])
        torch.testing.assert_close(got, _embed(load_pooling_model(ref), TEXTS), atol=2e-5, rtol=0)
