"""The k-quant kernel over GGUF's own super-blocks (server/quant/csrc/qk_native.cpp) against gguf-py's
dequantization, on every code path this CPU runs.

Tolerances:
- against `linear_reference` (W @ x^ in float64, W = gguf.quants.dequantize of the blocks, x^ the
  activations as the kernel rounds them, bit for bit): fp32 accumulation only, |err| <= 2e-5 * (|W| @
  |x^|) + 1e-5. The kernel's per-block int32 sums are exact; it sums K / 256 <= 3 blocks scaled in fp32
  plus a 16-lane reduction (relative error under ~20 * 2^-24 ~ 1.2e-6, 2e-5 leaves room);
- against fp32 activations: each x_k moves by at most half its 256-block's step dx_b / 2, so |err| <=
  sum_b (dx_b / 2) sum_{k in b} |W[n, k]| (`activation_error_bound`), plus the slack above.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from server.quant import cpu_qk_native as qk

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gemm_paths import check_gemm_dtypes
from gguf_quant import quantize_q4_k, quantize_q6_k

N, K = 37, 768  # odd N, three super-blocks per row


def random_blocks(fmt: str, n: int, k: int, seed: int) -> qk.KQuantBlocks:
    """Uniformly random block bytes (every scale, min and high-bit pattern) with finite fp16 d and dmin."""
    rng = np.random.default_rng(seed)
    size = qk.SUPER_BLOCK_BYTES[fmt]
    b = rng.integers(0, 256, size=(n * k // qk.QK_K, size), dtype=np.uint8)
    d = (rng.uniform(0.5, 2.0, size=(b.shape[0], 2)) * 1e-3).astype(np.float16).view(np.uint8)
    if fmt == "q4_k":
        b[:, 0:4] = d.reshape(-1, 4)  # d, dmin
    else:
        b[:, 208:210] = d.reshape(-1, 4)[:, :2]
    return qk.from_gguf(b, fmt, n, k)


def quantized_blocks(fmt: str, n: int, k: int, seed: int) -> qk.KQuantBlocks:
    """A Gaussian weight round-to-nearest quantized by tests/gguf_quant.py (the values a real file holds)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).numpy()
    return qk.from_gguf((quantize_q4_k if fmt == "q4_k" else quantize_q6_k)(w), fmt, n, k)


@pytest.fixture(scope="module")
def kernel() -> qk.QKNativeKernel:
    return qk.load_qk_native_kernel()


def fp32_slack(x: torch.Tensor, w: qk.KQuantBlocks) -> torch.Tensor:  # -> [M, N]
    return 2e-5 * (qk.quantize_activations_reference(x).abs() @ qk.dequantize_reference(w).abs().t()) + 1e-5


def assert_within_bounds(y: torch.Tensor, x: torch.Tensor, w: qk.KQuantBlocks, label: str) -> None:
    """y, the kernel's product of x [M, K] with w's values ([M, N]): W @ x^ within the fp32 slack, and W @ x
    within the activations' bound on top."""
    slack = fp32_slack(x, w)
    err = (y - qk.linear_reference(x, w)).abs()
    assert (err <= slack).all(), f"{label}: max excess {(err - slack).max().item():.3g}"
    fp32 = F.linear(x, qk.dequantize_reference(w))
    assert ((y - fp32).abs() <= qk.activation_error_bound(x, w) + slack).all(), label


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 16, 64])
@pytest.mark.parametrize("make", [random_blocks, quantized_blocks])
def test_matches_gguf_dequantize(kernel: qk.QKNativeKernel, qk_path: str, fmt: str, m: int, make) -> None:
    w = make(fmt, N, K, seed=m)
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(100 + m)) * 3.0
    x[0, :5] = 0.0  # zeros round to zero
    if m > 1:
        x[1, 256:512] = 0.0  # a whole zero block (dx = 0)
    assert_within_bounds(kernel.linear(x, w), x, w, f"{qk_path} {fmt} M={m}")


def test_paths_agree_and_strided_io(kernel: qk.QKNativeKernel, qk_path: str) -> None:
    w = quantized_blocks("q6_k", 19, 512, seed=3)
    big = torch.randn(5, 600)
    x = big[:, 7:519]  # rows strided, unit stride along K
    out = torch.full((5, 40), 7.0)
    kernel.linear(x, w, out=out[:, 3:22])
    assert torch.equal(out[:, :3], torch.full((5, 3), 7.0))  # nothing written outside the view
    assert torch.allclose(out[:, 3:22], qk.linear_reference(x, w), rtol=1e-4, atol=1e-4)


def test_held_bytes_are_the_files(kernel: qk.QKNativeKernel) -> None:
    for fmt, bits in (("q4_k", 4.5), ("q6_k", 6.5625)):
        w = random_blocks(fmt, 8, 512, seed=1)
        assert w.bits_per_weight() == bits
        assert w.nbytes() == 8 * 512 * bits / 8


def test_bad_arguments(kernel: qk.QKNativeKernel) -> None:
    w = random_blocks("q4_k", 4, 256, seed=0)
    with pytest.raises(TypeError):
        kernel.linear(torch.zeros(1, 256, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="must be"):
        kernel.linear(torch.zeros(1, 512), w)
    with pytest.raises(ValueError, match="out must be"):
        kernel.linear(torch.zeros(2, 256), w, out=torch.zeros(2, 5))
    with pytest.raises(ValueError, match="whole 256-value"):
        qk.from_gguf(np.zeros(144, np.uint8), "q4_k", 1, 128)
    with pytest.raises(ValueError, match="bytes"):
        qk.from_gguf(np.zeros(143, np.uint8), "q4_k", 1, 256)
    with pytest.raises(ValueError, match="unknown"):
        qk.from_gguf(np.zeros(144, np.uint8), "q5_1", 1, 256)
    assert kernel.linear(torch.zeros(0, 256), w).shape == (0, 4)


# ------------------------------------------------------------------ 16-row tiles (q4_k_x16, q6_k_x16)


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 33])
@pytest.mark.parametrize("make", [random_blocks, quantized_blocks])
def test_x16_tiles_match_gguf_dequantize(
    kernel: qk.QKNativeKernel, qk_path: str, fmt: str, m: int, make
) -> None:
    """The tiles give W @ x^ of the row-major blocks they came from, within the same fp32 slack (the
    per-lane sums need no horizontal reduction: no looser)."""
    w = make(fmt, 48, K, seed=m)
    tiles = kernel.interleave(w)
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(200 + m)) * 3.0
    if m > 1:
        x[1, 256:512] = 0.0  # a whole zero block (dx = 0)
    y = kernel.linear(x, tiles)
    slack = fp32_slack(x, w)
    err = (y - qk.linear_reference(x, w)).abs()
    assert (err <= slack).all(), f"{qk_path} {fmt} x16 M={m}: max excess {(err - slack).max().item():.3g}"
    assert torch.equal(qk.dequantize_reference(tiles), qk.dequantize_reference(w))


@pytest.mark.parametrize("fmt,bits", [("q4_k", 4.625), ("q6_k", 6.5625)])
def test_x16_layout_round_trips(kernel: qk.QKNativeKernel, fmt: str, bits: float) -> None:
    """The compiled re-lay writes interleave_reference's bytes; de-interleaving gives the file's blocks
    back byte for byte (every scale/min/high-bit pattern: random bytes); the bits per weight held."""
    from server.quant import cpu_qlinear as cq

    w = random_blocks(fmt, 64, 512, seed=5)
    tiles = kernel.interleave(w)
    assert tiles.fmt == qk.TILED[fmt]
    assert torch.equal(tiles.blocks, qk.interleave_reference(w).blocks)
    assert tiles.bits_per_weight() == bits and tiles.nbytes() == 64 * 512 * bits / 8
    held = cq.BlockQuantWeight(w.blocks, torch.empty(64, 0), None, fmt, cq.KQUANT_BITS, 256, 0, 512, 64)
    x16 = cq.interleave_x16(held)
    assert torch.equal(x16.q, tiles.blocks) and cq.file_format(x16.fmt) == fmt
    assert torch.equal(cq.deinterleave_x16(x16).q, w.blocks)
    dense = qk.dequantize_reference(w)
    assert torch.equal(qk.dequantize_reference(tiles), dense)
    # rows: a tile-aligned slice stays tiles, any other selection becomes the file's row blocks
    aligned = x16.select_rows(torch.arange(16, 48))
    assert aligned.fmt == x16.fmt and torch.equal(cq.dequantize_reference(aligned), dense[16:48])
    odd = x16.select_rows(torch.tensor([63, 2, 17]))
    assert odd.fmt == fmt and torch.equal(cq.dequantize_reference(odd), dense[[63, 2, 17]])
    both = cq.BlockQuantWeight.concat_rows([x16, aligned])
    assert torch.equal(cq.dequantize_reference(both), torch.cat([dense, dense[16:48]]))
    assert torch.equal(cq.dequantize_reference(x16, torch.tensor([5, 40])), dense[[5, 40]])


def test_x16_bad_arguments(kernel: qk.QKNativeKernel) -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        kernel.interleave(random_blocks("q4_k", 24, 256, seed=0))
    with pytest.raises(ValueError, match="interleaving takes"):
        kernel.interleave(kernel.interleave(random_blocks("q6_k", 16, 256, seed=0)))
    with pytest.raises(ValueError, match="whole tiles"):
        qk.KQuantBlocks(torch.zeros(8, 148, dtype=torch.uint8), "q4_k_x16", 256, 8)
    with pytest.raises(ValueError, match="whole tiles"):
        qk.KQuantBlocks(torch.zeros(8, 210, dtype=torch.uint8), "q6_k_x16", 256, 8)


# ------------------------------------------------------------------ Q5_K, IQ4_XS, Q3_K, Q2_K: tiles only

TILE_ONLY = ["q5_k", "iq4_xs", "q3_k", "q2_k"]
# bits per weight of each one's tiles (the files': 5.5, 4.25, 3.4375, 2.625)
TILE_ONLY_BITS = {"q5_k": 5.625, "iq4_xs": 4.3125, "q3_k": 3.5625, "q2_k": 2.625}


def file_blocks(fmt: str, n: int, k: int, seed: int) -> qk.KQuantBlocks:
    """Valid GGUF blocks of `fmt` from uniformly random bytes (every scale, min, level and high-bit
    pattern; fp16 scales finite): gguf_models.random_blocks."""
    from gguf_models import random_blocks as gguf_random_blocks

    raw = gguf_random_blocks(qk.GGUF_TYPES[fmt], n, k, np.random.default_rng(seed))
    return qk.from_gguf(raw, fmt, n, k)


@pytest.mark.parametrize("fmt", TILE_ONLY)
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 33])
def test_tile_only_kquants_match_gguf_dequantize(
    kernel: qk.QKNativeKernel, qk_path: str, fmt: str, m: int
) -> None:
    """Q5_K / IQ4_XS / Q3_K / Q2_K tiles give W @ x^ of the file's blocks (W gguf-py's dequantization)
    within the fp32 slack, and W @ x within the activations' bound; the row-major blocks do not run."""
    w = file_blocks(fmt, 48, K, seed=m)
    tiles = kernel.interleave(w)
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(300 + m)) * 3.0
    x[0, :7] = 0.0
    if m > 1:
        x[1, 256:512] = 0.0  # a whole zero block (dx = 0)
    assert_within_bounds(kernel.linear(x, tiles), x, w, f"{qk_path} {fmt} x16 M={m}")
    with pytest.raises(ValueError, match="runs as its 16-row tiles"):
        kernel.linear(x, w)


@pytest.mark.parametrize("fmt", TILE_ONLY)
def test_tile_only_layout_round_trips(kernel: qk.QKNativeKernel, fmt: str) -> None:
    """The tiles hold the file's blocks exactly (de-interleaving gives its bytes back; the compiled
    dequantization, fp32 activations' path, is gguf-py's bit for bit) at TILE_ONLY_BITS; selecting rows
    keeps whole tiles as tiles, 16 rows across tiles re-tiled, any other rows repacked exactly."""
    from server.quant import cpu_qlinear as cq

    w = file_blocks(fmt, 64, 512, seed=5)
    tiles = kernel.interleave(w)
    assert tiles.fmt == qk.TILED[fmt] and cq.file_format(tiles.fmt) == fmt
    assert (
        tiles.bits_per_weight() == TILE_ONLY_BITS[fmt]
        and tiles.nbytes() == 64 * 512 * TILE_ONLY_BITS[fmt] / 8
    )
    assert torch.equal(kernel.deinterleave(tiles).blocks, w.blocks)
    dense = qk.dequantize_reference(w)  # gguf-py's
    held = cq.BlockQuantWeight(w.blocks, torch.empty(64, 0), None, fmt, cq.KQUANT_BITS, 256, 0, 512, 64)
    x16 = cq.interleave_x16(held)
    assert torch.equal(x16.q, tiles.blocks)
    assert torch.equal(cq.deinterleave_x16(x16).q, w.blocks)
    assert torch.equal(cq.load_qlinear_kernel().dequantize_rows(x16), dense)  # the compiled dequantization
    aligned = x16.select_rows(torch.arange(16, 48))
    assert aligned.fmt == x16.fmt and torch.equal(aligned.q, x16.q[16:48])
    assert torch.equal(cq.dequantize_reference(aligned), dense[16:48])
    across = x16.select_rows(torch.arange(8, 24))
    assert across.fmt == x16.fmt and torch.equal(cq.dequantize_reference(across), dense[8:24])
    odd = x16.select_rows(torch.tensor([63, 2, 17]))
    assert odd.fmt == fmt and not odd.super_blocks  # repacked (gguf_repack.py): exact
    assert torch.equal(cq.dequantize_reference(odd), dense[[63, 2, 17]])
    both = cq.BlockQuantWeight.concat_rows([x16, aligned])
    assert torch.equal(cq.dequantize_reference(both), torch.cat([dense, dense[16:48]]))
    twice = torch.cat([torch.arange(48, 64), torch.arange(64)])  # whole tiles, one repeated: more rows than W
    picked = x16.select_rows(twice)
    assert picked.fmt == x16.fmt and torch.equal(cq.dequantize_reference(picked), dense[twice])


def test_tile_only_bad_arguments(kernel: qk.QKNativeKernel) -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        kernel.interleave(file_blocks("q5_k", 24, 256, seed=0))
    with pytest.raises(ValueError, match="de-interleave takes"):
        kernel.deinterleave(kernel.interleave(random_blocks("q4_k", 16, 256, seed=0)))
    with pytest.raises(ValueError, match="whole tiles"):
        qk.KQuantBlocks(torch.zeros(8, 180, dtype=torch.uint8), "q5_k_x16", 256, 8)
    with pytest.raises(ValueError, match="bytes"):
        qk.from_gguf(np.zeros(135, np.uint8), "iq4_xs", 1, 256)


# ------------------------------------------------------------------ held as the resident format


def test_gguf_q6_k_held_as_the_files_super_blocks(
    tiny_model_factory,  # type: ignore[no-untyped-def]
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Q4_K_M-style file: its Q6_K token embedding (the tied LM head) is held at the file's 6.56 bits per
    weight (not the repack's 10), as 16-row tiles, and a row subset of odd N as the file's row-major
    blocks; both dequantize as gguf-py does, and every path that serves them (qlinear's entry, the int8
    library's fallback, BlockQuantLinear at decode and prefill sizes in fp32 and bf16, the embedding
    lookup) gives W @ x within its tolerance; KUBEINFER_KQUANT_BLOCKS=0 repacks."""
    from gguf_models import write_tiny_gguf

    from server.quant import cpu_qlinear as cq
    from server.quant.block_linear import BlockQuantEmbedding
    from server.quant.gguf_checkpoint import SUPER_BLOCKS_ENV, read_gguf_checkpoint

    hf = tiny_model_factory("llama", tie=True, hidden=256)
    path = write_tiny_gguf(hf, tmp_path / "tiny-k.gguf", "Q4_K", embedding_fmt="Q6_K", tokenizer=False)
    monkeypatch.setenv(SUPER_BLOCKS_ENV, "1")
    ckpt = read_gguf_checkpoint(path, torch.bfloat16)
    emb = ckpt.tensors["model.embed_tokens.weight"]
    assert isinstance(emb, cq.BlockQuantWeight) and emb.super_blocks and emb.fmt == "q6_k_x16"
    n, k = emb.out_features, emb.in_features
    assert n % 16 == 0  # whole 16-row tiles
    assert emb.nbytes() == n * k // 256 * 210  # the file's bytes: 6.5625 bits per weight
    proj = ckpt.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(proj, cq.BlockQuantWeight) and proj.fmt == "q4_k_x16"  # Q4_K: 16-row tiles
    monkeypatch.setenv(SUPER_BLOCKS_ENV, "0")
    repacked = read_gguf_checkpoint(path, torch.bfloat16).tensors["model.embed_tokens.weight"]
    assert isinstance(repacked, cq.BlockQuantWeight) and not repacked.super_blocks
    dense = cq.dequantize_reference(repacked)
    assert torch.equal(cq.dequantize_reference(emb), dense)

    kernel = cq.load_qlinear_kernel()
    assert torch.equal(kernel.dequantize_rows(emb), dense)
    rows = torch.tensor([7, 0, n - 1])
    assert torch.equal(BlockQuantEmbedding(emb)(rows), dense[rows])
    _served_paths_match(emb, dense, kernel)  # the tiles
    index = torch.arange(0, n, 3)
    index = index[:-1] if index.numel() % 2 == 0 else index
    head = emb.select_rows(index)  # a row subset of odd N: the file's row-major super-blocks
    assert head.fmt == "q6_k" and head.super_blocks
    _served_paths_match(head, dense[index], kernel)


def _served_paths_match(head, dense_head: torch.Tensor, kernel) -> None:  # type: ignore[no-untyped-def]
    """Every path that serves super-blocks `head` ([N, K] of dense values `dense_head`) gives W @ x within
    its tolerance: fp32 compute exact up to fp32 slack, int8 activations within activation_error_bound."""
    from server.quant import cpu_qgemv_q8 as q8
    from server.quant import cpu_qlinear as cq
    from server.quant.block_linear import BlockQuantLinear

    k = head.in_features
    wabs = dense_head.abs().reshape(head.out_features, k // 256, 256).sum(-1)  # [N', K / 256]
    fast = q8.load_q8_gemv_kernel(kernel)
    if head.fmt.endswith("_x16") and fast.isa == "vnni" and fast.gemm_max_rows is None:
        # under bf16 the tiles' int8 kernel takes prefill-sized M too (a 2,048-token step of Phi-4-mini
        # Q4_K_M 1.45x faster than dequantize + bf16 GEMM), as the int8 batched path does; with that
        # path off, the bf16 GEMM from 256 rows as for other weights
        lin = BlockQuantLinear(head, kernel=kernel)
        lin.gemm_dtype = torch.bfloat16
        assert lin.gemm_min_rows > 1 << 20, head.fmt
        with q8.int8_gemm(False):
            assert lin.gemm_min_rows == 256, head.fmt
    for m in (1, 3, 5, 16, 300):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        exact = x @ dense_head.t()
        slack = 2e-5 * (x.abs() @ dense_head.abs().t()) + 1e-5
        dx = x.reshape(m, k // 256, 256).abs().amax(-1) / 127.0  # activation_error_bound, W dequantized once
        int8_bound = (dx / 2) @ wabs.t()
        assert ((kernel.linear(x, head) - exact).abs() <= slack).all()  # fp32 compute: fp32 activations
        # the decode graph's entry (the int8 library's C entry) hands it to qlinear's, then here
        via_entry = cq.call_linear(
            fast.lib.kubeinfer_qgemv_q8,
            "qgemv_q8",
            x,
            head,
            None,
            torch.empty(m, head.out_features),
            torch.bfloat16,
        )
        assert ((via_entry - exact).abs() <= int8_bound + slack).all()
        stay = head.fmt.endswith("_x16") and fast.isa == "vnni" and fast.gemm_max_rows is None
        check_gemm_dtypes(head, x, dense_head, slack, int8_bound + slack, kernel, stay)


def test_gguf_q4_k_held_as_16_row_tiles(
    tiny_model_factory,  # type: ignore[no-untyped-def]
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Q4_K file's projections are held as q4_k_x16 tiles (4.625 bits per weight, no int8 packed copy:
    the repack held 6.0 plus an 8.5-bit copy), the same values as the repack, and every serving path (the
    qlinear entry, the int8 library's entry, BlockQuantLinear at decode and prefill sizes in fp32 and bf16,
    an embedding lookup) gives W @ x within its tolerance; a fused q/k/v stays tiles; N not a multiple of
    16 keeps the repack; KUBEINFER_KQUANT_BLOCKS=0 repacks everything."""
    from gguf_models import write_tiny_gguf

    from server.quant import cpu_qgemv_q8 as q8
    from server.quant import cpu_qlinear as cq
    from server.quant.block_linear import BlockQuantEmbedding, BlockQuantLinear
    from server.quant.gguf_checkpoint import SUPER_BLOCKS_ENV, read_gguf_checkpoint

    hf = tiny_model_factory("llama", tie=False, hidden=256)
    path = write_tiny_gguf(hf, tmp_path / "tiny-q4k.gguf", "Q4_K", tokenizer=False)
    monkeypatch.setenv(SUPER_BLOCKS_ENV, "1")
    ckpt = read_gguf_checkpoint(path, torch.bfloat16)
    monkeypatch.setenv(SUPER_BLOCKS_ENV, "0")
    repacked = read_gguf_checkpoint(path, torch.bfloat16)
    prefix = "model.layers.0.self_attn."
    parts = [ckpt.tensors[prefix + p + "_proj.weight"] for p in ("q", "k", "v")]
    for name, w in ckpt.tensors.items():
        if not (isinstance(w, cq.BlockQuantWeight) and w.fmt in ("q4_k", "q4_k_x16")):
            continue
        old = repacked.tensors[name]
        assert isinstance(old, cq.BlockQuantWeight)
        if w.out_features % 16:  # no whole tiles: the repack
            assert not w.super_blocks and w.fmt == "q4_k", name
            continue
        assert w.fmt == "q4_k_x16", name
        assert w.nbytes() == w.out_features * w.in_features * 4.625 / 8, name
        assert torch.equal(cq.dequantize_reference(w), cq.dequantize_reference(old)), name
    kernel = cq.load_qlinear_kernel()
    held = [p for p in parts if isinstance(p, cq.BlockQuantWeight) and p.fmt == "q4_k_x16"]
    assert len(held) == 3
    fused = BlockQuantLinear.fuse([BlockQuantLinear(p, kernel=kernel) for p in held])
    assert fused is not None and fused.weight_q.fmt == "q4_k_x16"
    fused.gemm_dtype = torch.bfloat16
    assert fused.pack_int8(q8.load_q8_gemv_kernel(kernel)) == 0  # no int8 copy: the tiles serve batches
    w = fused.weight_q
    dense = cq.dequantize_reference(w)
    assert torch.equal(kernel.dequantize_rows(w), dense)
    rows = torch.tensor([7, 0, w.out_features - 1])
    assert torch.equal(BlockQuantEmbedding(w)(rows), dense[rows])
    _served_paths_match(w, dense, kernel)


@pytest.mark.parametrize("kind", ["Q5_K", "IQ4_XS", "Q3_K", "Q2_K"])
def test_gguf_tile_only_types_held_as_16_row_tiles(
    tiny_model_factory,  # type: ignore[no-untyped-def]
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
) -> None:
    """A file of Q5_K / IQ4_XS / Q3_K / Q2_K projections is held as their tiles (TILE_ONLY_BITS: within
    1/8 bit of the file's, where the repack held 10.0 / 9.0 / 6.0 / 8.0), the same values as the repack
    (KUBEINFER_KQUANT_BLOCKS=0), q/k rows permuted before tiling; a fused q/k/v stays tiles; every serving
    path gives W @ x within its tolerance."""
    from gguf_models import random_block_model, write_tiny_gguf

    from server.quant import cpu_qgemv_q8 as q8
    from server.quant import cpu_qlinear as cq
    from server.quant.block_linear import BlockQuantEmbedding, BlockQuantLinear
    from server.quant.gguf_checkpoint import SUPER_BLOCKS_ENV, read_gguf_checkpoint

    template = tiny_model_factory("llama", tie=False, hidden=256)
    raw = random_block_model(template, tmp_path / "hf", {"*": kind, "model.embed_tokens.weight": "F32"})
    path = write_tiny_gguf(tmp_path / "hf", tmp_path / "tiny.gguf", "F32", raw=raw, tokenizer=False)
    monkeypatch.setenv(SUPER_BLOCKS_ENV, "1")
    ckpt = read_gguf_checkpoint(path, torch.bfloat16)
    monkeypatch.setenv(SUPER_BLOCKS_ENV, "0")
    repacked = read_gguf_checkpoint(path, torch.bfloat16)
    fmt = kind.lower()
    held = 0
    for name, w in ckpt.tensors.items():
        if not isinstance(w, cq.BlockQuantWeight):
            continue
        old = repacked.tensors[name]
        assert isinstance(old, cq.BlockQuantWeight) and old.fmt == fmt and not old.super_blocks
        assert w.fmt == qk.TILED[fmt] and w.out_features % 16 == 0, name
        assert w.nbytes() == w.out_features * w.in_features * TILE_ONLY_BITS[fmt] / 8, name
        assert torch.equal(cq.dequantize_reference(w), cq.dequantize_reference(old)), name
        held += 1
    assert held == 15  # two layers' seven projections and the untied head
    kernel = cq.load_qlinear_kernel()
    prefix = "model.layers.1.self_attn."
    parts = [ckpt.tensors[prefix + p + "_proj.weight"] for p in ("q", "k", "v")]
    fused = BlockQuantLinear.fuse([BlockQuantLinear(p, kernel=kernel) for p in parts])  # type: ignore[arg-type]
    assert fused is not None and fused.weight_q.fmt == qk.TILED[fmt]
    fused.gemm_dtype = torch.bfloat16
    assert fused.pack_int8(q8.load_q8_gemv_kernel(kernel)) == 0  # no int8 copy: the tiles serve batches
    w = fused.weight_q
    dense = cq.dequantize_reference(w)
    assert torch.equal(kernel.dequantize_rows(w), dense)
    rows = torch.tensor([7, 0, w.out_features - 1])
    assert torch.equal(BlockQuantEmbedding(w)(rows), dense[rows])
    _served_paths_match(w, dense, kernel)


def test_tile_only_types_repacked_where_the_library_cannot_be_built(
    tiny_model_factory,  # type: ignore[no-untyped-def]
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """KUBEINFER_KQUANT_BLOCKS=1 forced where the compiled library cannot be built: Q5_K has no torch re-lay
    into tiles, so it is repacked exactly (the values gguf-py gives), not a load failure."""
    from gguf_models import random_block_model, write_tiny_gguf

    from server.quant import cpu_qlinear as cq
    from server.quant.gguf_checkpoint import SUPER_BLOCKS_ENV, read_gguf_checkpoint

    template = tiny_model_factory("llama", tie=False, hidden=256)
    raw = random_block_model(template, tmp_path / "hf", {"*": "Q5_K", "model.embed_tokens.weight": "F32"})
    path = write_tiny_gguf(tmp_path / "hf", tmp_path / "tiny.gguf", "F32", raw=raw, tokenizer=False)
    monkeypatch.setenv(SUPER_BLOCKS_ENV, "1")
    monkeypatch.setattr(qk, "try_load_qk_native_kernel", lambda cache_dir=None: None)
    ckpt = read_gguf_checkpoint(path, torch.bfloat16)
    held = [w for w in ckpt.tensors.values() if isinstance(w, cq.BlockQuantWeight)]
    assert len(held) == 15 and all(w.fmt == "q5_k" and not w.super_blocks for w in held)


# ------------------------------------------------------------------ the avx2 path as an AVX2-only CPU builds it

# KUBEINFER_CPU_DISABLE for an AVX2-only CPU (AMD Zen 2/3, Intel Haswell..Skylake client): the library built
# with -mno-avx512f and the rest (its own cache entry), so its avx2 path holds no AVX-512 instruction
AVX2_ONLY = "avx512f,avx512_bf16,avx512_vnni,avx_vnni,amx_tile,amx_bf16"
# every tile format: the k-quants (file type, tiles through interleave) and the 32-value ones (qlinear's)
ALL_TILES = ["Q4_K", "Q6_K", "Q5_K", "IQ4_XS", "Q3_K", "Q2_K", "Q8_0", "Q5_0", "IQ4_NL", "Q5_1"]
# qk_native.cpp's FMT_Q8_0_X16, FMT_Q5_0_X16, FMT_IQ4_NL_X16, FMT_Q5_1_X16
Q32_CODES = {"q8_0_x16": 4, "q5_0_x16": 5, "iq4_nl_x16": 14, "q5_1_x16": 15}
FP16_AT = {"Q4_K": (0, 2), "Q6_K": (208,), "Q5_K": (0, 2), "IQ4_XS": (0,), "Q3_K": (108,), "Q2_K": (80, 82)}
FP16_AT |= {"Q8_0": (0,), "Q5_0": (0,), "IQ4_NL": (0,), "Q5_1": (0, 2)}


@pytest.fixture(scope="module")
def avx2_kernel() -> qk.QKNativeKernel:
    """The library as an AVX2-only CPU builds and loads it (its own build, loaded fresh: a kernel keeps the
    path it was loaded with); skipped where this CPU has no AVX2 (+FMA, F16C)."""
    from server.config import default_cache_dir

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KUBEINFER_CPU_DISABLE", AVX2_ONLY)
        if qk.usable_path() != "avx2":
            pytest.skip("no usable AVX2 here")
        kernel = qk.load_qk_native_kernel(default_cache_dir() / "avx2-only")
    assert kernel.isa == "avx2" and kernel.path != qk.load_qk_native_kernel().path
    return kernel


def gguf_blocks(kind: str, n: int, k: int, seed: int, fill: int | None = None) -> np.ndarray:
    """[N, K / block * bytes] GGUF blocks of `kind`: random bytes (fill None) or every byte `fill`, the fp16
    scales (FP16_AT) set to 1e-3."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    if fill is not None:
        b[:] = fill
    for off in FP16_AT[kind]:
        b[:, off : off + 2] = np.full((b.shape[0], 1), 1e-3, np.float16).view(np.uint8)
    return b.reshape(n, -1)


def tile_weight(kind: str, raw: np.ndarray, n: int, k: int):  # type: ignore[no-untyped-def]
    """(the tiles, the weight they hold as its reference takes it): KQuantBlocks for the k-quants, qlinear's
    BlockQuantWeight (the 32-value tiles, and the row-major weight) for Q8_0 / Q5_0 / IQ4_NL / Q5_1."""
    from server.quant import cpu_qlinear as cq
    from server.quant.gguf_repack import from_gguf_repacked

    if kind in ("Q8_0", "Q5_0", "IQ4_NL", "Q5_1"):
        rows = (
            cq.from_gguf_blocks(raw, "q8_0", n, k) if kind == "Q8_0" else from_gguf_repacked(raw, kind, n, k)
        )
        return cq.interleave_q8_x16(rows), rows
    w = qk.from_gguf(raw, kind.lower(), n, k)
    return qk.load_qk_native_kernel().interleave(w), w


def run_tiles(
    kernel: qk.QKNativeKernel, tiles, x: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """x [M, K] (rows may be strided) through `kernel`'s kubeinfer_qk_linear over the tiles -> [M, N]; the
    32-value tiles called directly (QKNativeKernel.linear takes the k-quants only)."""
    if isinstance(tiles, qk.KQuantBlocks):
        return kernel.linear(x, tiles, out=out)
    m, n = x.shape[0], tiles.out_features
    out = torch.empty(m, n) if out is None else out
    rc = kernel.lib.kubeinfer_qk_linear(
        Q32_CODES[tiles.fmt], tiles.q.data_ptr(), n, tiles.in_features, x.data_ptr(), m, x.stride(0),
        out.data_ptr(), out.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    assert rc == 0
    return out


def assert_reference(y: torch.Tensor, x: torch.Tensor, kind: str, ref_w, label: str) -> None:  # type: ignore[no-untyped-def]
    """y against W @ x^ within the fp32 slack: the k-quants' 256-value activations, the 32-value tiles'
    ggml Q8_0 ones (cpu_qgemv_q8's references)."""
    if isinstance(ref_w, qk.KQuantBlocks):
        slack = fp32_slack(x, ref_w)
        err = (y - qk.linear_reference(x, ref_w)).abs()
    else:
        from server.quant import cpu_qgemv_q8 as q8m
        from server.quant import cpu_qlinear as cq

        dense = cq.dequantize_reference(ref_w)
        slack = 2e-5 * (q8m.dequantize_activations_reference(x).abs() @ dense.abs().t()) + 1e-5
        err = (y - q8m.linear_reference(x, ref_w, None)).abs()
    assert (err <= slack).all(), f"{label}: max excess {(err - slack).max().item():.3g}"


@pytest.fixture
def vnni_kernel() -> Iterator[qk.QKNativeKernel | None]:
    """This CPU's own library on its vnni path (None where it has none), restored after."""
    kernel = qk.load_qk_native_kernel()
    default = kernel.isa
    yield kernel if kernel.set_path("vnni") == "vnni" else None
    kernel.set_path(default)


@pytest.mark.parametrize("kind", ALL_TILES)
@pytest.mark.parametrize("threads", [1, 2])
def test_avx2_build_matches_the_references_and_vnni_bit_for_bit(
    avx2_kernel: qk.QKNativeKernel, vnni_kernel: qk.QKNativeKernel | None, kind: str, threads: int
) -> None:
    """Every tile format on the AVX2-only build: W @ x^ within the vnni path's slack at odd and even M (a
    tile pass of 8 rows, and the rows past it), rows of x and y strided, a zero block of x; and the same
    floats as the vnni path, bit for bit (the same int8 activations, integer sums and fp32 ops)."""
    n, k = 48, 768
    tiles, ref_w = tile_weight(kind, gguf_blocks(kind, n, k, seed=len(kind)), n, k)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in (1, 3, 8, 9, 17):
            big = torch.randn(m, k + 40, generator=torch.Generator().manual_seed(m)) * 3.0
            x = big[:, 13 : 13 + k]  # rows strided
            if m > 1:
                x[1, 256:512] = 0.0
            out = torch.full((m, n + 7), 7.0)
            y = run_tiles(avx2_kernel, tiles, x, out[:, 5 : 5 + n])
            assert torch.equal(out[:, :5], torch.full((m, 5), 7.0)) and torch.equal(
                out[:, 5 + n :], torch.full((m, 2), 7.0)
            )
            assert_reference(y, x, kind, ref_w, f"avx2 {kind} M={m} threads={threads}")
            if vnni_kernel is not None:
                assert torch.equal(y, run_tiles(vnni_kernel, tiles, x.contiguous())), f"{kind} M={m}"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", ALL_TILES)
@pytest.mark.parametrize("fill", [0x00, 0xFF, 0x80, 0x7F])
def test_avx2_extreme_values_do_not_saturate(
    avx2_kernel: qk.QKNativeKernel, vnni_kernel: qk.QKNativeKernel | None, kind: str, fill: int
) -> None:
    """Every value at a format's extreme (every byte 0x00 / 0xFF / 0x80 / 0x7F: IQ4_XS's and IQ4_NL's levels
    -127 and 113, held + 128 up to 241; Q8_0's -128 and 127; Q6_K's 63; Q5_1's 31; the largest scales) against activations
    at +-127 of one sign, the other, and signs alternating: AVX2's u8 x s8 pair sums (maddubs) saturate
    int16 past 32767, which 241 * 127 * 2 would, so the avx2 path must give what the references and the
    vnni path give."""
    n, k = 16, 512
    tiles, ref_w = tile_weight(kind, gguf_blocks(kind, n, k, seed=1, fill=fill), n, k)
    alt = torch.where(torch.arange(k) % 2 == 0, 1.0, -1.0)
    x = torch.stack([torch.full((k,), 3.0), torch.full((k,), -3.0), 3.0 * alt, -3.0 * alt])
    y = run_tiles(avx2_kernel, tiles, x)
    assert_reference(y, x, kind, ref_w, f"avx2 {kind} fill={fill:#x}")
    if vnni_kernel is not None:
        assert torch.equal(y, run_tiles(vnni_kernel, tiles, x)), f"{kind} fill={fill:#x}"
