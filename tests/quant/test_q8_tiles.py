"""32-value blocks held as 16-row tiles (q8_0_x16, q5_0_x16, iq4_nl_x16 as 4-bit codebook indices,
q5_1_x16: csrc/qk_native.cpp's FMT_Q8_0_X16, FMT_Q5_0_X16, FMT_IQ4_NL_X16, FMT_Q5_1_X16,
cpu_qlinear.interleave_q8_x16): one copy at the file's bits per weight (8.5, 5.5, 4.5, 6.0) that serves one
row of x and batches, on every code path this CPU runs, through every entry point that serves a weight.

Tolerances:
- int8 activations (layers computing in bf16): against `cpu_qgemv_q8.linear_reference` (W @ x^ in
  float64, x^ = x quantized per 32 values as ggml's Q8_0, bit for bit): fp32 accumulation only,
  |err| <= 2e-5 * (|x^| @ |W|^T) + 1e-5 (per-block int32 sums are exact; K / 32 <= 36 blocks summed in
  fp32, relative error under ~40 * 2^-24 ~ 2.4e-6);
- fp32 activations (layers computing in fp32): against x @ W^T with the same slack on |x| @ |W|^T;
- dequantized values and layouts: exact.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gemm_paths import check_gemm_dtypes

from server.quant import cpu_qgemv_q8 as q8m
from server.quant import cpu_qlinear as cq
from server.quant.gguf_repack import from_gguf_repacked

N, K = 48, 160  # three tiles, five 32-blocks (K no multiple of 256, as Gemma's 1,152)
FORMATS = ["q8_0", "q5_0", "iq4_nl", "q5_1"]
TILE_ROW_BYTES = {"q8_0": 34, "q5_0": 22, "iq4_nl": 18, "q5_1": 24}  # per row per 32-block: the file's


def q8_weight(fmt: str, n: int, k: int, seed: int) -> cq.BlockQuantWeight:
    """A weight of format `fmt` as the loader reads it: q8_0 round-to-nearest from a Gaussian; q5_0, iq4_nl
    and q5_1 from random GGUF blocks (every 5-bit and codebook value), repacked to 8 bits (gguf_repack.py)."""
    g = torch.Generator().manual_seed(seed)
    if fmt == "q8_0":
        return cq.quantize_block(torch.randn(n, k, generator=g) * 0.05, "q8_0")
    from gguf_models import random_blocks

    blocks = random_blocks(fmt.upper(), n, k, np.random.default_rng(seed))
    return from_gguf_repacked(blocks, fmt.upper(), n, k)


@pytest.fixture(scope="module")
def kernel() -> cq.QLinearKernel:
    return cq.load_qlinear_kernel()


def slack(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:  # -> [M, N]
    return 2e-5 * (x.abs() @ dense.abs().t()) + 1e-5


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 16, 17, 33])
def test_tiles_match_the_references(kernel: cq.QLinearKernel, qk_path: str, fmt: str, m: int) -> None:
    """Through qlinear's entry (what BlockQuantLinear, the decode graph and the int8 library's fallback
    call): bf16 layers get W @ x^ with x^ ggml's Q8_0 activations, fp32 layers x @ W^T; a zero 32-block
    of x (dx = 0) and a bias included; the tiles hold the row-major weight's values exactly."""
    w = q8_weight(fmt, N, K, seed=m)
    tiles = cq.interleave_q8_x16(w)
    dense = cq.dequantize_reference(w)
    assert torch.equal(cq.dequantize_reference(tiles), dense)
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(100 + m)) * 3.0
    if m > 1:
        x[1, 32:64] = 0.0
    bias = torch.randn(N)
    y = kernel.linear(x, tiles, bias, compute=torch.bfloat16)
    want = q8m.linear_reference(x, w, bias)
    err = (y - want).abs()
    bound = slack(q8m.dequantize_activations_reference(x), dense)
    assert (err <= bound).all(), f"{qk_path} {fmt} M={m}: max excess {(err - bound).max().item():.3g}"
    y32 = kernel.linear(x, tiles, bias)
    assert ((y32 - (x @ dense.t() + bias)).abs() <= slack(x, dense)).all(), f"{qk_path} {fmt} fp32 M={m}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_layout_round_trips(kernel: cq.QLinearKernel, fmt: str) -> None:
    """interleave/deinterleave give the weight back bit for bit; the tiles hold the file's bytes (8.5, 5.5,
    4.5, 6.0 bits per weight, where the row-major repacks held 8.5, 8.5, 8.5, 9.0); a tile-aligned row
    selection stays tiles, any other becomes row-major blocks; concatenated tiles are the tiles of the
    concatenation; the kernel dequantizes any rows."""
    w = q8_weight(fmt, 64, 96, seed=3)
    t = cq.interleave_q8_x16(w)
    assert t.fmt == cq.Q8_TILED[fmt] and cq.file_format(t.fmt) == fmt and t.super_blocks
    assert w.nbytes() == 64 * 96 * (36 if fmt == "q5_1" else 34) // 32
    assert t.nbytes() == 64 * 96 * TILE_ROW_BYTES[fmt] // 32
    back = cq.deinterleave_q8_x16(t)
    assert torch.equal(back.q, w.q) and torch.equal(back.scales, w.scales) and back.fmt == fmt
    assert (back.mins is None) == (w.mins is None) and (w.mins is None or torch.equal(back.mins, w.mins))
    dense = cq.dequantize_reference(w)
    assert torch.equal(kernel.dequantize_rows(t), dense)
    rows = torch.tensor([63, 0, 17, 17])
    assert torch.equal(kernel.dequantize_rows(t, rows), dense[rows])
    assert torch.equal(kernel.dequantize_rows(t, start=20, count=9), dense[20:29])
    aligned = t.select_rows(torch.arange(16, 48))
    assert aligned.fmt == t.fmt and torch.equal(cq.dequantize_reference(aligned), dense[16:48])
    odd = t.select_rows(torch.tensor([63, 2, 17]))
    assert odd.fmt == w.fmt and not odd.super_blocks
    assert torch.equal(cq.dequantize_reference(odd), dense[[63, 2, 17]])
    both = cq.BlockQuantWeight.concat_rows([t, aligned])
    assert torch.equal(
        both.q,
        cq.interleave_q8_x16(cq.BlockQuantWeight.concat_rows([w, w.select_rows(torch.arange(16, 48))])).q,
    )
    assert torch.equal(cq.dequantize_reference(t, torch.tensor([5, 40])), dense[[5, 40]])


def test_bad_arguments() -> None:
    from gguf_models import random_blocks

    def tiles(rows: int, row_bytes: int, n: int) -> cq.BlockQuantWeight:  # q8_0_x16 of K = 64
        q = torch.zeros(rows, row_bytes, dtype=torch.uint8)
        return cq.BlockQuantWeight(
            q, torch.empty(rows, 0), None, "q8_0_x16", cq.KQUANT_BITS, cq.Q8X_GROUP, 0, 64, n
        )

    with pytest.raises(ValueError, match="multiple of 16"):
        cq.interleave_q8_x16(q8_weight("q8_0", 24, 64, seed=0))
    with pytest.raises(ValueError, match="32-value tiles take"):
        cq.interleave_q8_x16(cq.quantize_block(torch.randn(16, 64), "q4_0"))  # 4-bit
    with pytest.raises(ValueError, match="32-value tiles take"):
        cq.interleave_q8_x16(cq.quantize_block(torch.randn(16, 64), "q4_1"))  # 4-bit, mins
    q5_1 = from_gguf_repacked(random_blocks("Q5_1", 16, 64, np.random.default_rng(0)), "Q5_1", 16, 64)
    with pytest.raises(ValueError, match="32-value tiles take"):
        cq.interleave_q8_x16(dataclasses.replace(q5_1, mins=None))  # Q5_1 without its mins
    q5_1.q[2, 7] = 32  # past 5 bits
    with pytest.raises(ValueError, match=r"0\.\.31"):
        cq.interleave_q8_x16(q5_1)
    iq4 = q8_weight("iq4_nl", 16, 64, seed=0)
    iq4.q[0, 0] = 0  # no kvalues_iq4nl level
    with pytest.raises(ValueError, match="kvalues_iq4nl"):
        cq.interleave_q8_x16(iq4)
    with pytest.raises(ValueError, match="whole tiles"):
        tiles(8, 68, 8)
    with pytest.raises(ValueError, match=r"q must be \[16, 68\]"):
        tiles(16, 64, 16)
    bad = q8_weight("q5_0", 16, 64, seed=0)
    bad.q[3, 5] = 16  # no q - 16 of a 5-bit q
    with pytest.raises(ValueError, match=r"-16\.\.15"):
        cq.interleave_q8_x16(bad)
    with pytest.raises(ValueError, match="de-interleaving"):
        cq.deinterleave_q8_x16(q8_weight("q8_0", 16, 64, seed=0))


@pytest.mark.parametrize(("kind", "bits"), [("Q8_0", 34), ("Q5_0", 22), ("Q5_1", 24)])
def test_gguf_32_blocks_held_as_tiles(
    tiny_model_factory,  # type: ignore[no-untyped-def]
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    bits: int,
) -> None:
    """A Q8_0 (Q5_0, Q5_1) file with a tied head: every matrix of whole 16-row tiles is held as q8_0_x16
    (q5_0_x16, q5_1_x16) at the file's 8.5 (5.5, 6.0) bits per weight with no int8 packed copy (the
    row-major blocks took one of 10 bits more for batches, and Q5_0 was held at 8.5, Q5_1 at 9.0), the same
    values as
    KUBEINFER_KQUANT_BLOCKS=0 reads; fused q/k/v stay tiles; every serving
    path (qlinear's entry, the int8 library's entry, BlockQuantLinear at decode, batch and prefill sizes
    in fp32 and bf16, the embedding lookup) gives W @ x within its tolerance."""
    from gguf_models import write_tiny_gguf

    from server.quant.block_linear import BlockQuantEmbedding, BlockQuantLinear
    from server.quant.gguf_checkpoint import SUPER_BLOCKS_ENV, read_gguf_checkpoint

    hf = tiny_model_factory("llama", tie=True, hidden=96)
    gguf_path = write_tiny_gguf(hf, tmp_path / "tiny.gguf", kind, tokenizer=False)
    fmt = kind.lower()
    monkeypatch.setenv(SUPER_BLOCKS_ENV, "1")
    ckpt = read_gguf_checkpoint(gguf_path, torch.bfloat16)
    monkeypatch.setenv(SUPER_BLOCKS_ENV, "0")
    rowmajor = read_gguf_checkpoint(gguf_path, torch.bfloat16)
    kernel = cq.load_qlinear_kernel()
    q8 = q8m.load_q8_gemv_kernel(kernel)
    tiled = 0
    for name, w in ckpt.tensors.items():
        if not isinstance(w, cq.BlockQuantWeight):
            continue
        old = rowmajor.tensors[name]
        assert isinstance(old, cq.BlockQuantWeight) and old.fmt == fmt, name
        if w.out_features % 16:
            assert w.fmt == fmt, name
            continue
        tiled += 1
        assert w.fmt == fmt + "_x16" and w.nbytes() == w.out_features * w.in_features * bits // 32, name
        assert torch.equal(cq.dequantize_reference(w), cq.dequantize_reference(old)), name
        lin = BlockQuantLinear(w, kernel=kernel)
        lin.gemm_dtype = torch.bfloat16
        assert lin.pack_int8(q8) == 0, name  # the tiles serve batches: no second copy
        if q8.isa == "vnni" and q8.gemm_max_rows is None:  # prefill chunks too, as the int8 batched path
            assert lin.gemm_min_rows > 1 << 20, name
            with q8m.int8_gemm(False):  # that path switched off: dequantize + bf16 GEMM as for any weight
                assert lin.gemm_min_rows == 256, name
    assert tiled >= 5
    emb = ckpt.tensors["model.embed_tokens.weight"]
    assert isinstance(emb, cq.BlockQuantWeight) and emb.fmt == fmt + "_x16"  # the tied LM head too
    dense = cq.dequantize_reference(emb)
    ids = torch.tensor([7, 0, emb.out_features - 1])
    assert torch.equal(BlockQuantEmbedding(emb)(ids), dense[ids])
    _served_paths_match(emb, dense, kernel, q8)
    prefix = "model.layers.0.self_attn."
    parts = [ckpt.tensors[prefix + p + "_proj.weight"] for p in ("q", "k", "v")]
    fused = BlockQuantLinear.fuse([BlockQuantLinear(p, kernel=kernel) for p in parts])  # type: ignore[arg-type]
    assert fused is not None and fused.weight_q.fmt == fmt + "_x16"
    _served_paths_match(fused.weight_q, cq.dequantize_reference(fused.weight_q), kernel, q8)


@pytest.mark.parametrize("path", ["vnni", "avx2"])
def test_gguf_iq4_nl_and_q5_1_held_at_the_files_bits(
    tiny_model_factory,  # type: ignore[no-untyped-def]
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
) -> None:
    """A file of IQ4_NL attention and Q5_1 MLP projections (random blocks: every codebook index and 5-bit
    value) with a Q8_0 embedding, read as served (KUBEINFER_KQUANT_BLOCKS unset, bf16 layers) on the vnni
    path and on the avx2 path (an AVX2-only CPU simulated): IQ4_NL and Q5_1 matrices are held as their
    16-row tiles at the file's bytes (4.5 and 6.0 bits per weight, where the repacks held 8.5 and 9.0) on
    both, the same values as the repack (KUBEINFER_KQUANT_BLOCKS=0), served within their tolerances; Q8_0
    as its tiles only on vnni."""
    from gguf_models import random_block_model, write_tiny_gguf
    from test_cpu_qk_native import AVX2_ONLY

    from server.quant import cpu_qk_native as qk
    from server.quant.gguf_checkpoint import SUPER_BLOCKS_ENV, read_gguf_checkpoint

    native = qk.load_qk_native_kernel()
    default = native.isa
    if native.set_path(path) != path:
        native.set_path(default)
        pytest.skip(f"this CPU does not run the {path} path")
    monkeypatch.setattr(qk, "try_load_qk_native_kernel", lambda cache_dir=None: native)  # the loader's
    if path == "avx2":  # the features the loader reads: an AVX2-only CPU's
        monkeypatch.setenv("KUBEINFER_CPU_DISABLE", AVX2_ONLY)
    template = tiny_model_factory("llama", tie=True, hidden=96)
    kinds = {"*": "IQ4_NL", "model.embed_tokens.weight": "F32"}
    kinds |= {f"model.layers.{i}.mlp.{p}_proj.weight": "Q5_1" for i in (0, 1) for p in ("gate", "up", "down")}
    raw = random_block_model(template, tmp_path / "hf", kinds)
    gguf_path = write_tiny_gguf(
        tmp_path / "hf", tmp_path / "tiny.gguf", "F32", "Q8_0", raw=raw, tokenizer=False
    )
    try:
        monkeypatch.delenv(SUPER_BLOCKS_ENV, raising=False)
        ckpt = read_gguf_checkpoint(gguf_path, torch.bfloat16)
        monkeypatch.setenv(SUPER_BLOCKS_ENV, "0")
        rowmajor = read_gguf_checkpoint(gguf_path, torch.bfloat16)
    finally:
        native.set_path(default)
    held = {"iq4_nl": 0, "q5_1": 0}
    for name, w in ckpt.tensors.items():
        if not isinstance(w, cq.BlockQuantWeight):
            continue
        old = rowmajor.tensors[name]
        assert isinstance(old, cq.BlockQuantWeight) and not old.super_blocks, name
        assert torch.equal(cq.dequantize_reference(w), cq.dequantize_reference(old)), name
        if old.fmt == "q8_0":
            assert w.fmt == ("q8_0_x16" if path == "vnni" else "q8_0"), name
            continue
        assert w.out_features % 16 == 0 and w.fmt == old.fmt + "_x16", name
        assert w.nbytes() == w.out_features * w.in_features * TILE_ROW_BYTES[old.fmt] // 32, name
        assert old.nbytes() == w.out_features * w.in_features * (36 if old.fmt == "q5_1" else 34) // 32
        held[old.fmt] += 1
    assert held == {"iq4_nl": 8, "q5_1": 6}  # two layers' q/k/v/o and gate/up/down
    kernel = cq.load_qlinear_kernel()
    q8 = q8m.load_q8_gemv_kernel(kernel)
    for name in ("model.layers.1.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        w = ckpt.tensors[name]
        assert isinstance(w, cq.BlockQuantWeight)
        _served_paths_match(w, cq.dequantize_reference(w), kernel, q8)


def _served_paths_match(w: cq.BlockQuantWeight, dense: torch.Tensor, kernel, q8) -> None:  # type: ignore[no-untyped-def]
    k = w.in_features
    wabs = dense.abs().reshape(w.out_features, k // 32, 32).sum(-1)  # [N, K / 32]
    for m in (1, 3, 5, 16, 300):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        exact = x @ dense.t()
        fp32 = slack(x, dense)
        dx = x.reshape(m, k // 32, 32).abs().amax(-1) / 127.0
        int8_bound = (dx / 2) @ wabs.t() + fp32  # activation_error_bound, W's |values| summed once
        assert ((kernel.linear(x, w) - exact).abs() <= fp32).all(), m
        via_entry = cq.call_linear(
            q8.lib.kubeinfer_qgemv_q8, "qgemv_q8", x, w, None, torch.empty(m, w.out_features), torch.bfloat16
        )
        assert ((via_entry - exact).abs() <= int8_bound).all(), m
        stay = w.fmt.endswith("_x16") and q8.isa == "vnni" and q8.gemm_max_rows is None
        check_gemm_dtypes(w, x, dense, fp32, int8_bound, kernel, stay)


def test_tiles_only_where_the_layers_take_int8_activations(
    tiny_model_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KUBEINFER_KQUANT_BLOCKS unset: layers computing in fp32 (--dtype float32, a CPU without AVX512-VNNI)
    read the file row-major, since the tiles' fp32 path dequantizes a row at a time (~10x the row-major
    kernel's time at one row); bf16 layers and int8 ones (auto on a CPU with AVX512-VNNI but no native
    bf16) take the tiles where the VNNI kernel runs; the switch overrides both ways."""
    from gguf_models import write_tiny_gguf

    from server.quant.cpu_qk_native import try_load_qk_native_kernel
    from server.quant.gguf_checkpoint import SUPER_BLOCKS_ENV, read_gguf_checkpoint

    hf = tiny_model_factory("llama", tie=True, hidden=96)
    gguf_path = write_tiny_gguf(hf, tmp_path / "tiny.gguf", "Q8_0", tokenizer=False)

    def layouts(compute: torch.dtype) -> set[str]:
        ckpt = read_gguf_checkpoint(gguf_path, compute)
        return {w.fmt for w in ckpt.tensors.values() if isinstance(w, cq.BlockQuantWeight)}

    monkeypatch.delenv(SUPER_BLOCKS_ENV, raising=False)
    assert layouts(torch.float32) == {"q8_0"}
    kernel = try_load_qk_native_kernel()
    assert ("q8_0_x16" in layouts(torch.bfloat16)) == (kernel is not None and kernel.isa == "vnni")
    assert ("q8_0_x16" in layouts(torch.int8)) == (kernel is not None and kernel.isa == "vnni")
    monkeypatch.setenv(SUPER_BLOCKS_ENV, "1")
    assert "q8_0_x16" in layouts(torch.float32)
    monkeypatch.setenv(SUPER_BLOCKS_ENV, "0")
    assert layouts(torch.bfloat16) == {"q8_0"}
