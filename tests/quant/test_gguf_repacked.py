"""GGUF's Q5_0, Q5_1, Q5_K, Q3_K, Q2_K, IQ4_NL and IQ4_XS kept quantized (server/quant/gguf_repack.py):
the repacked values are gguf-py's dequantization bit for bit, every kernel path (GEMV, batched, bf16, the
int8-activation paths, each CPU level) multiplies by them within its stated error, a tiny Llama served
from such a GGUF gives the logits of the HF folder holding the same weights, within the stated memory
bound of the file's bytes; what is still dequantized is named in /info."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf_models import random_block_model, random_blocks, write_tiny_gguf

from server import native
from server.models.loader import resolve_dtype
from server.quant import cpu_qgemv_q8 as q8
from server.quant import cpu_qlinear as cq
from server.quant.block_linear import BlockQuantLinear
from server.quant.cpu_qlinear import BlockQuantWeight, QLinearKernel
from server.quant.gguf_checkpoint import TILE_32_FORMATS, TILE_ONLY_TYPES, super_blocks_enabled

TYPES = ["Q5_0", "Q5_1", "Q5_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS"]
# Resident bits per weight of each repacked layout (gguf_repack.py's table) and the file's.
BITS = {"Q5_0": 8.5, "Q5_1": 9.0, "Q5_K": 10.0, "Q3_K": 6.0, "Q2_K": 8.0, "IQ4_NL": 8.5, "IQ4_XS": 9.0}
FILE_BITS = {
    t: gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]][1]
    * 8
    / gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]][0]
    for t in TYPES
}
# The stated bound on resident / file bytes (docs/quantization.md), rounded up from BITS / FILE_BITS.
MEMORY_BOUND = {
    "Q5_0": 1.55,
    "Q5_1": 1.5,
    "Q5_K": 1.82,
    "Q3_K": 1.75,
    "Q2_K": 3.05,
    "IQ4_NL": 1.89,
    "IQ4_XS": 2.12,
}


def _weight(kind: str, n: int, k: int, seed: int = 0) -> tuple[BlockQuantWeight, np.ndarray]:
    """A repacked random-block weight and gguf-py's dequantization of the same blocks ([N, K] fp32)."""
    from server.quant.gguf_repack import from_gguf_repacked

    raw = random_blocks(kind, n, k, np.random.default_rng(seed))
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float32).reshape(n, k)
    return from_gguf_repacked(raw, kind, n, k), ref


@pytest.fixture(scope="module")
def kernel() -> QLinearKernel:
    return cq.load_qlinear_kernel()


@pytest.mark.parametrize("kind", TYPES)
def test_repacked_values_are_gguf_py_dequantization_bit_for_bit(kernel: QLinearKernel, kind: str) -> None:
    n, k = 24, 512
    w, ref = _weight(kind, n, k)
    assert w.fmt == kind.lower() and w.bits == (4 if kind in ("Q3_K", "Q2_K") else 8)
    expected = torch.from_numpy(ref)
    assert torch.equal(cq.dequantize_reference(w), expected)
    assert torch.equal(kernel.dequantize_rows(w), expected)
    rows = torch.tensor([5, 0, 23, 7])
    assert torch.equal(kernel.dequantize_rows(w, rows), expected[rows])
    out = torch.empty(n, k, dtype=torch.bfloat16)
    if kernel.dequantize_rows_bf16(w, 0, n, out):  # group 32 on an AVX512-BF16 CPU
        assert torch.equal(out, expected.bfloat16())
    assert w.nbytes() * 8 == BITS[kind] * n * k
    assert w.nbytes() <= MEMORY_BOUND[kind] * (n * k * FILE_BITS[kind] / 8)


@pytest.mark.parametrize("kind", TYPES)
def test_repack_refuses_partial_blocks_and_wrong_sizes(kind: str) -> None:
    from server.quant.gguf_repack import from_gguf_repacked

    raw = random_blocks(kind, 2, 256, np.random.default_rng(0))
    with pytest.raises(ValueError, match="bytes"):
        from_gguf_repacked(raw[:, :-1], kind, 2, 256)
    with pytest.raises(ValueError, match="whole"):
        from_gguf_repacked(raw, kind, 2, 250)


def _check_linear(kernel: QLinearKernel, kind: str, m: int, compute: torch.dtype = torch.float32) -> None:
    n, k = 37, 768  # a ragged N, K of 3 super-blocks (24 blocks: 8-block chunks)
    w, ref = _weight(kind, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * torch.linspace(0.1, 4.0, k)
    bias = torch.randn(n)
    y = kernel.linear(x, w, bias, compute=compute)
    exact = (x.double() @ torch.from_numpy(ref).double().t() + bias.double()).float()
    scale = x.double().abs() @ torch.from_numpy(ref).double().abs().t()  # [M, N] sum |x w|
    if compute == torch.bfloat16 and kernel.bf16 and m > cq.BF16_GEMV_MAX_ROWS:
        # both operands rounded to bf16 (8 significant bits each): at most ~2^-8 of sum |x w|
        assert ((y.double() - exact.double()).abs() <= 2**-7 * scale + 1e-5).all()
    else:  # fp32 sums of exact products: the kernel's summation error alone
        torch.testing.assert_close(y, exact, rtol=1e-4, atol=1e-4 * (k**0.5) * float(ref.std()) * 10)


# M: the GEMV (1, 3), the batched path's 8-row tile (7), 16-row blocks plus a rest (23)
@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("m", [1, 3, 7, 23])
def test_kernel_linear_matches_the_dequantized_reference(kernel: QLinearKernel, kind: str, m: int) -> None:
    _check_linear(kernel, kind, m)


@pytest.mark.parametrize("kind", TYPES)
def test_kernel_bf16_batched_path_within_bf16_rounding(kernel: QLinearKernel, kind: str) -> None:
    _check_linear(kernel, kind, 23, torch.bfloat16)


@pytest.fixture()
def fast(kernel: QLinearKernel) -> Iterator[q8.Q8GemvKernel]:
    """The int8-activation kernel taking every call it can (restored after the test)."""
    k = q8.load_q8_gemv_kernel(kernel)
    k.set_modes(gemv=True, gemm=True)
    yield dataclasses.replace(k, gemm_max_rows=None)
    k.set_path(q8.path_for(native.usable_cpu_features()))
    k.set_modes(q8.default_gemv_enabled(), q8.GEMM_DEFAULT_ENABLED, gemv_fp32=False)


# The 32-value groups (all but Q3_K/Q2_K's 16) take the int8-activation paths: the GEMV on each level
# the CPU allows, the batched path on AVX512-VNNI; held to the activations' quantization bound.
@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q5_K", "IQ4_NL", "IQ4_XS"])
@pytest.mark.parametrize("path", q8.PATHS)
def test_int8_activation_paths_take_the_32_value_groups(fast: q8.Q8GemvKernel, kind: str, path: str) -> None:
    best = q8.PATHS.index(q8.path_for(native.usable_cpu_features()))
    if q8.PATHS.index(path) > best:
        pytest.skip(f"this CPU (or KUBEINFER_CPU_DISABLE) does not allow the {path} path")
    assert fast.set_path(path) == path
    n, k = 37, 768
    w, _ = _weight(kind, n, k, seed=3)
    for m, compute in ((1, torch.float32), (4, torch.float32), (23, torch.bfloat16)):
        if not fast.supports(w, m, compute):
            assert m > q8.MAX_ROWS  # only the batched path is VNNI-only
            continue
        x = torch.randn(m, k) * torch.linspace(0.1, 4.0, k)
        y = fast.linear(x, w, compute=compute)
        exact = cq.linear_reference(x.double(), w).double()
        scale = (
            q8.dequantize_activations_reference(x).double().abs()
            @ cq.dequantize_reference(w).double().abs().t()
        )
        assert ((y.double() - exact).abs() <= q8.activation_error_bound(x, w) + 1e-5 * scale + 1e-6).all()


@pytest.mark.parametrize("kind", ["Q3_K", "Q2_K"])
def test_16_value_groups_stay_on_the_fp32_kernel(fast: q8.Q8GemvKernel, kind: str) -> None:
    w, _ = _weight(kind, 8, 256)
    assert not fast.supports(w, 1) and not fast.supports(w, 23, torch.bfloat16)


# The lower CPU levels: a fresh build (own cache folder) with the level's features turned off.
@pytest.mark.slow
@pytest.mark.parametrize("disable,isa", [("avx512", "avx2"), ("avx512,avx2", "portable")])
def test_every_cpu_level_computes_the_repacked_formats(
    disable: str, isa: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    here = native.usable_cpu_features()
    if isa == "avx2" and not here.avx512f:
        pytest.skip("no AVX-512 here: the default kernel is the AVX2 level already")
    monkeypatch.setenv("KUBEINFER_CPU_DISABLE", disable)
    lower = cq.load_qlinear_kernel(tmp_path)
    assert lower.isa == isa
    for kind in TYPES:
        w, ref = _weight(kind, 13, 512)
        assert torch.equal(lower.dequantize_rows(w), torch.from_numpy(ref))
        for m in (1, 3, 7, 23):
            _check_linear(lower, kind, m)


# ------------------------------------------------------------------ whole models


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def template(tiny_model_factory) -> Path:  # type: ignore[no-untyped-def]
    return tiny_model_factory("llama", tie=True, hidden=256)  # k-quants: whole 256-value super-blocks


def _gguf_and_hf(
    template: Path, tmp: Path, kinds: dict[str, str], tokenizer: bool = True, embedding_fmt: str | None = None
) -> tuple[Path, Path]:
    hf = tmp / "hf"
    raw = random_block_model(template, hf, kinds)
    (tmp / "gguf").mkdir()
    gguf_path = tmp / "gguf" / "tiny.gguf"
    return write_tiny_gguf(hf, gguf_path, "F32", embedding_fmt, raw=raw, tokenizer=tokenizer), hf


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:  # [1, S] -> [S, vocab]
    from server.pooling.decoder import DecoderEncoder

    with torch.inference_mode():
        h = DecoderEncoder(model)(ids, torch.zeros_like(ids), torch.ones_like(ids))  # type: ignore[arg-type]
        return model.lm_head(h[0])  # type: ignore[operator]


@pytest.mark.parametrize("kind", TYPES)
def test_gguf_model_served_quantized_gives_the_hf_folders_logits(
    template: Path, tmp_path: Path, cache: Path, kind: str
) -> None:
    """Every projection `kind` (the 49k-row embedding F32, to keep the test fast; the mixed-file test
    below serves one quantized): kept quantized, not fp32 copies; their resident bytes within the stated
    bound of their bytes in the file; logits those of transformers on the HF folder holding gguf-py's
    dequantization of the same blocks (an exact repack: only the fp32 summation order differs)."""
    from transformers import AutoModelForCausalLM

    from server.models.loader import load_gguf_model

    path, hf = _gguf_and_hf(
        template, tmp_path, {"*": kind, "model.embed_tokens.weight": "F32"}, tokenizer=False
    )
    loaded = load_gguf_model(path, hf, torch.device("cpu"), 64, cache)  # the HF folder's config.json
    model = loaded.model
    projections = [m for m in model.modules() if isinstance(m, BlockQuantLinear)]
    assert len(projections) == 14 and all(p.method == kind.lower() for p in projections)
    assert loaded.quantization == f"gguf-{kind.lower()}"
    assert loaded.gguf_dequantized == ()
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors if t.tensor_type.name == kind)
    resident = sum(p.weight_q.nbytes() for p in projections)
    # Q5_K / IQ4_XS / Q3_K / Q2_K, and Q5_0 / IQ4_NL / Q5_1, as their 16-row tiles where the loader holds
    # tiles (the layers computing in bf16 or int8 on an AVX512-VNNI or AVX2 CPU): the file's bits per weight
    # or within 1/8 bit of them
    tiled_types = {*TILE_ONLY_TYPES, *(f.upper() for f in TILE_32_FORMATS)}
    tiles = kind in tiled_types and super_blocks_enabled(resolve_dtype("auto", torch.device("cpu")))
    if kind in tiled_types:
        assert all(p.weight_q.fmt == (f"{kind.lower()}_x16" if tiles else kind.lower()) for p in projections)
    bound = (FILE_BITS[kind] + 0.125) / FILE_BITS[kind] if tiles else MEMORY_BOUND[kind]
    assert resident <= bound * file_bytes, (resident, file_bytes)
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 17, 45, 2010, 9]])
    ours = _logits(model, ids)
    ref_model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    with torch.inference_mode():
        ref = ref_model(ids).logits[0]
    err = (ours - ref).abs().max().item()
    assert err <= 1e-4 * ref.abs().max().item(), err
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.slow
def test_greedy_parity_through_the_engine_and_decode_graph(
    template: Path, tmp_path: Path, cache: Path
) -> None:
    """A mixed file, as llama.cpp's _M mixes write, holding all seven types (q/k/v and gate/up of one
    format each, so they fuse): served through LLMEngine (fused projections, the decode graph) token for
    token as transformers on the HF folder."""
    from engine_driver import run_staggered
    from transformers import AutoModelForCausalLM

    from server.config import CacheConfig, EngineConfig, ModelConfig
    from server.engine import LLMEngine
    from server.quant.gemm_dtype import apply_gemm_dtype
    from server.request import SamplingParams

    per_layer = [
        {"q_proj": "IQ4_XS", "k_proj": "IQ4_XS", "v_proj": "IQ4_XS", "o_proj": "Q5_K"}
        | {"gate_proj": "Q5_1", "up_proj": "Q5_1", "down_proj": "Q3_K"},
        {"q_proj": "Q5_K", "k_proj": "Q5_K", "v_proj": "Q5_K", "o_proj": "IQ4_NL"}
        | {"gate_proj": "Q2_K", "up_proj": "Q2_K", "down_proj": "Q5_K"},
    ]
    kinds = {"*": "Q5_0"}  # the token embedding and tied LM head
    for i, layer in enumerate(per_layer):
        for proj, kind in layer.items():
            part = "self_attn" if proj.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            kinds[f"model.layers.{i}.{part}.{proj}.weight"] = kind
    path, hf = _gguf_and_hf(template, tmp_path, kinds)
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(path), cache_dir=cache), cache=CacheConfig(cache_dtype="float32")
        )
    )
    apply_gemm_dtype(engine.loaded.model, torch.float32)  # against transformers fp32
    assert engine.info.quantization == "gguf-iq4_nl+iq4_xs+q2_k+q3_k+q5_0+q5_1+q5_k"
    assert engine.info.gguf_dequantized == ()
    model = engine.loaded.model
    layer0: Any = model.model.layers[0]
    assert isinstance(layer0.self_attn.qkv_proj, BlockQuantLinear)  # fused, one format
    prompts = [engine.tokenizer.encode(p) for p in ["The capital of France is", "def fibonacci(n):"]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ours = run_staggered(engine, prompts, params)
    assert model._decode_graph is not None and model._decode_graph[1] is not None  # recorded, so it ran
    ref = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    want = []
    with torch.inference_mode():
        for p in prompts:
            out = ref.generate(  # type: ignore[misc]
                torch.tensor([p]), max_new_tokens=12, do_sample=False, min_new_tokens=12, eos_token_id=None
            )
            want.append(out[0, len(p) :].tolist())
    assert ours == want
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_types_still_dequantized_are_named_with_their_cost(
    template: Path, tmp_path: Path, cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """IQ2_XXS (no kept layout) and an F16 embedding are read as fp32: the loader logs and lists them
    with the bytes they cost beyond the file's; the Q5_K rest stays quantized."""
    import logging

    from server.models.loader import load_gguf_model

    kinds = {
        "*": "Q5_K",
        "model.layers.0.mlp.down_proj.weight": "IQ2_XXS",
        "model.embed_tokens.weight": "F16",
    }
    path, hf = _gguf_and_hf(template, tmp_path, kinds, tokenizer=False, embedding_fmt="F16")
    with caplog.at_level(logging.WARNING):
        loaded = load_gguf_model(path, hf, torch.device("cpu"), 64, cache)
    logged = caplog.text
    assert "blk.0.ffn_down.weight (IQ2_XXS) is served as fp32: 786432 bytes resident, 735744 more" in logged
    assert "token_embd.weight (F16) is served as fp32" in logged
    assert "2 tensors served as fp32 (F16, IQ2_XXS)" in logged
    layer0: Any = loaded.model.model.layers[0]
    assert not isinstance(layer0.mlp.down_proj, BlockQuantLinear)
    assert isinstance(layer0.mlp.up_proj, BlockQuantLinear)
    listed = {d.name: d for d in loaded.gguf_dequantized or ()}
    assert set(listed) == {"blk.0.ffn_down.weight", "token_embd.weight"}
    emb, iq2 = listed["token_embd.weight"], listed["blk.0.ffn_down.weight"]
    assert (emb.gguf_type, emb.resident_bytes, emb.extra_bytes) == ("F16", 49152 * 256 * 4, 49152 * 256 * 2)
    assert (iq2.gguf_type, iq2.resident_bytes) == ("IQ2_XXS", 768 * 256 * 4)
    assert iq2.extra_bytes == 768 * 256 * 4 - 768 * 256 * 66 // 256  # block_iq2_xxs: 66 bytes per 256


@pytest.mark.slow
def test_info_names_what_is_still_dequantized(template: Path, tmp_path: Path, cache: Path) -> None:
    """/info's gguf_dequantized: each fp32-held tensor with its type and bytes, and their extra total."""
    from fastapi.testclient import TestClient

    from server.api.app import create_app
    from server.api.state import ServerState
    from server.config import CacheConfig, EngineConfig, ModelConfig, ServerConfig
    from server.engine import LLMEngine

    path, _ = _gguf_and_hf(template, tmp_path, {"*": "Q5_K", "model.layers.1.mlp.up_proj.weight": "IQ2_XXS"})
    engine = LLMEngine(
        EngineConfig(model=ModelConfig(model=str(path), cache_dir=cache), cache=CacheConfig(num_kv_blocks=16))
    )
    (iq2,) = engine.info.gguf_dequantized or ()
    assert (iq2.name, iq2.gguf_type) == ("blk.1.ffn_up.weight", "IQ2_XXS")
    state = ServerState(ServerConfig(engine=engine.config, host="127.0.0.1"), engine_factory=lambda: engine)
    # a loopback-bound server answers loopback Host names only (api/admin.py): not TestClient's "testserver"
    with TestClient(create_app(state), base_url="http://localhost") as client:
        deadline = time.monotonic() + 120  # loads (here: warms up) on a thread
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, "server not ready"
            time.sleep(0.1)
        info = client.get("/info").json()
    expected = {"name": "blk.1.ffn_up.weight", "type": "IQ2_XXS", "resident_bytes": 768 * 256 * 4}
    assert info["gguf_dequantized"] == {
        "tensors": [expected | {"extra_bytes": 768 * 256 * 4 - 768 * 256 * 66 // 256}],
        "extra_bytes": 768 * 256 * 4 - 768 * 256 * 66 // 256,
    }
