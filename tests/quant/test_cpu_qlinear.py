"""The block-quantized CPU kernel (server/quant/csrc/qlinear.cpp) against its plain-torch references, and
the block formats against gguf-py's own quantizers and dequantizers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_models import quantize_q4_k, quantize_q6_k

from server.quant import cpu_qlinear as cq
from server.quant.block_linear import GEMM_MIN_ROWS, BlockQuantEmbedding, BlockQuantLinear
from server.quant.cpu_qlinear import BlockQuantWeight, QLinearKernel

K_QUANTIZERS = {"q4_k": quantize_q4_k, "q6_k": quantize_q6_k}


@pytest.fixture(scope="module")
def kernel() -> QLinearKernel:
    return cq.load_qlinear_kernel()


def make_weight(fmt: str, n: int, k: int, seed: int = 0, group: int = 32) -> BlockQuantWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.1
    if fmt in K_QUANTIZERS:  # K rounded up to whole 256-value super-blocks
        kk = -(-k // cq.QK_K) * cq.QK_K
        w = torch.randn(n, kk, generator=g) * 0.1
        return cq.from_gguf_k_blocks(K_QUANTIZERS[fmt](w.numpy()), fmt, n, kk)
    if fmt in cq.GGUF_BLOCK_BYTES:
        return cq.quantize_block(w, fmt)
    if fmt == "int8":
        s = (w.abs().amax(1) / 127).clamp(min=1e-8)
        return cq.from_int8(torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8), s)
    q = torch.randint(0, 16, (k, n), generator=g)
    z = torch.randint(0, 16, (k // group, n), generator=g)
    s = (torch.rand(k // group, n, generator=g) * 0.02 + 0.001).half()
    return cq.from_int4(q, z, s, group)


# (N, K): ragged N (not a multiple of the kernel's 4-row tiles), K with 8-block chunks plus leftover
# blocks (576 = 2 x 8 x 32 + 2 x 32), a K under one chunk, and SmolLM2's MLP shapes.
SHAPES = [(37, 64), (8, 320), (13, 576), (5, 1536), (192, 576)]
FORMATS = ["q4_0", "q4_1", "q8_0", "int8", "int4", "q4_k", "q6_k"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", SHAPES)
# M: the GEMV path (1..GEMV_MAX_ROWS), 8-row tiles only (7), a 16-row block (16), blocks plus a ragged
# rest (23), and, with K = 1536, several chunks of packed x (the chunk is 32 rows there).
@pytest.mark.parametrize("m", [1, 2, 7, 16, 23, 70])
def test_linear_matches_the_torch_reference(kernel: QLinearKernel, fmt: str, n: int, k: int, m: int) -> None:
    w = make_weight(fmt, n, k, seed=n * k + m)
    k = w.in_features  # k-quants: whole super-blocks
    x = torch.randn(m, k)
    bias = torch.randn(n)
    y = kernel.linear(x, w, bias)
    ref = cq.linear_reference(x.double(), w, bias).float()  # fp64 sums: the kernel's error alone
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * (k**0.5))


@pytest.mark.parametrize("k", [33, 100, 7])
@pytest.mark.parametrize("m", [1, 3, 5, 19])
def test_int8_per_channel_takes_any_k(kernel: QLinearKernel, k: int, m: int) -> None:
    """Per-channel int8 has one group of K values: an odd K ends in values handled one by one."""
    w = make_weight("int8", 11, k, seed=k)
    x = torch.randn(m, k)
    torch.testing.assert_close(kernel.linear(x, w), cq.linear_reference(x, w), rtol=1e-5, atol=1e-5)
    assert torch.equal(kernel.dequantize_rows(w), cq.dequantize_reference(w))


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 5, 17])
def test_int4_group_sizes(kernel: QLinearKernel, group: int, m: int) -> None:
    w = make_weight("int4", 21, 256, group=group)
    x = torch.randn(m, 256)
    torch.testing.assert_close(kernel.linear(x, w), cq.linear_reference(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [2, 3, 4, 6, 9])
def test_gemv_and_batched_paths_agree(kernel: QLinearKernel, fmt: str, m: int) -> None:
    """Every small M through both paths (the GEMV one re-reading W per row, the dequantized-panel GEMM)."""
    w = make_weight(fmt, 29, 320, seed=m)
    x = torch.randn(m, w.in_features)
    ref = cq.linear_reference(x.double(), w).float()
    try:
        for rows in (m, m - 1):  # m rows through the GEMV path, then through the batched one
            kernel.set_gemv_max_rows(rows)
            torch.testing.assert_close(kernel.linear(x, w), ref, rtol=1e-4, atol=1e-4 * 320**0.5)
    finally:
        kernel.set_gemv_max_rows(cq.GEMV_MAX_ROWS)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantized_rows_equal_the_reference_bit_for_bit(kernel: QLinearKernel, fmt: str) -> None:
    w = make_weight(fmt, 50, 576)
    assert torch.equal(kernel.dequantize_rows(w), cq.dequantize_reference(w))
    rows = torch.tensor([49, 0, 7, 7, 3])
    assert torch.equal(kernel.dequantize_rows(w, rows), cq.dequantize_reference(w, rows))
    assert torch.equal(kernel.dequantize_rows(w, start=10, count=4), cq.dequantize_reference(w)[10:14])


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_dequantized_to_bf16_are_the_fp32_rows_rounded(kernel: QLinearKernel, fmt: str) -> None:
    """Straight to bf16 (the bf16 prefill GEMM's operand, block_linear._dequant_gemm): the fp32 rows
    rounded to nearest even, bit for bit; refused (False, out untouched) where this CPU has no bf16 path
    or W's groups are not whole 32-blocks."""
    w = make_weight(fmt, 50, 576)
    k = w.in_features  # K-quants: 768, whole super-blocks
    out = torch.full((50 + 3, k), 7.0, dtype=torch.bfloat16)
    taken = kernel.dequantize_rows_bf16(w, 0, 50, out[:50])
    whole_blocks = w.group_size % 32 == 0 and w.in_features % 32 == 0
    assert taken == (kernel.bf16 and whole_blocks) == kernel.bf16_dequant_supported(w)
    if taken:
        assert torch.equal(out[:50], kernel.dequantize_rows(w).bfloat16())
        part = torch.empty(4, k, dtype=torch.bfloat16)
        assert kernel.dequantize_rows_bf16(w, 10, 4, part)
        assert torch.equal(part, kernel.dequantize_rows(w, start=10, count=4).bfloat16())
    else:
        assert bool((out[:50] == 7.0).all())
    assert bool((out[50:] == 7.0).all())
    with pytest.raises(IndexError):
        kernel.dequantize_rows_bf16(w, 48, 3, out[:3])
    with pytest.raises(ValueError, match="bf16"):
        kernel.dequantize_rows_bf16(w, 0, 2, torch.empty(2, k))


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("ties", [False, True])
def test_block_formats_are_ggufs(fmt: str, ties: bool) -> None:
    """Our quantizer writes the bytes gguf-py's does, and our dequantization equals gguf-py's; with
    `ties`, rows whose scaled values fall exactly halfway (ggml rounds them away from zero)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    w = (torch.randn(24, 256) * 0.1).numpy()
    if ties:  # q8_0: amax 127 gives d = 1, so each x.5 is a tie; the others see x.5 steps too
        w = (torch.randint(-254, 255, (24, 256)).float() / 2).numpy()
        w[:, ::32] = 127.0
    qtype = GGMLQuantizationType[fmt]
    raw = quantize(w, qtype)  # [24, 8 * block_bytes] uint8
    theirs = cq.from_gguf_blocks(raw, fmt.lower(), 24, 256)
    ours = cq.quantize_block(torch.from_numpy(w), fmt.lower())
    for a, b in zip(theirs.tensors(), ours.tensors(), strict=True):
        assert torch.equal(a, b)
    expected = torch.from_numpy(dequantize(raw, qtype).astype(np.float32))
    assert torch.equal(cq.dequantize_reference(theirs), expected)


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("source", ["quantized", "random_bytes"])
def test_k_quants_equal_ggufs_dequantization(kernel: QLinearKernel, fmt: str, source: str) -> None:
    """Q4_K / Q6_K repacked at load dequantize to gguf-py's values bit for bit, from our quantizer's
    bytes and from arbitrary bytes (every scale, min and 6-bit value pattern; finite fp16 super-scales)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    n, k = 10, 512
    if source == "quantized":
        raw = K_QUANTIZERS[fmt.lower()]((torch.randn(n, k) * 0.1).numpy())
    else:
        size = cq.GGUF_SUPER_BLOCK_BYTES[fmt.lower()]
        raw = np.random.default_rng(0).integers(0, 256, (n * k // 256, size), dtype=np.uint8)
        offsets = (0, 2) if fmt == "Q4_K" else (size - 2,)  # d (and dmin): finite fp16
        for o in offsets:
            d = np.random.default_rng(o).uniform(-1e-3, 1e-3, len(raw)).astype(np.float16)
            raw[:, o : o + 2] = d[:, None].view(np.uint8)
        raw = raw.reshape(n, -1)
    expected = torch.from_numpy(dequantize(raw, GGMLQuantizationType[fmt]).astype(np.float32))
    w = cq.from_gguf_k_blocks(raw, fmt.lower(), n, k)
    assert w.nbytes() == n * k * (6 if fmt == "Q4_K" else 10) // 8  # bits per weight after repacking
    assert torch.equal(cq.dequantize_reference(w), expected)
    assert torch.equal(kernel.dequantize_rows(w), expected)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    ref = (x.double() @ expected.double().t()).float()
    torch.testing.assert_close(kernel.linear(x, w), ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()))
    with pytest.raises(ValueError, match="super-blocks"):
        cq.from_gguf_k_blocks(raw, fmt.lower(), n, 320)


def test_isa_is_chosen_from_the_cpu_at_run_time(kernel: QLinearKernel) -> None:
    """The AVX-512 micro-kernel is compiled into every x86-64 build but selected only where the CPU has
    avx512f (never on an AVX2-only machine, where it cannot run)."""
    import platform
    from pathlib import Path

    if platform.machine() != "x86_64" or kernel.isa == "portable":
        pytest.skip("x86-64 AVX2 builds only")
    assert kernel.lib.kubeinfer_qlinear_has_avx512_path() == 1
    flags = next(
        ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")
    ).split()
    assert kernel.isa == ("avx512" if "avx512f" in flags else "avx2")


def test_select_and_concat_rows_keep_values() -> None:
    w = make_weight("q4_1", 12, 64)
    perm = torch.randperm(12)
    assert torch.equal(cq.dequantize_reference(w.select_rows(perm)), cq.dequantize_reference(w)[perm])
    both = BlockQuantWeight.concat_rows([w, w.select_rows(perm)])
    assert torch.equal(
        cq.dequantize_reference(both),
        torch.cat([cq.dequantize_reference(w), cq.dequantize_reference(w)[perm]]),
    )
    with pytest.raises(ValueError, match="one format"):
        BlockQuantWeight.concat_rows([w, make_weight("q8_0", 4, 64)])


def test_launchers_refuse_bad_arguments(kernel: QLinearKernel) -> None:
    w = make_weight("q4_0", 8, 64)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        kernel.linear(torch.randn(2, 32), w)
    with pytest.raises(TypeError, match="fp32"):
        kernel.linear(torch.randn(2, 64, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="bias"):
        kernel.linear(torch.randn(2, 64), w, torch.randn(7))
    with pytest.raises(ValueError, match="out must be"):
        kernel.linear(torch.randn(2, 64), w, out=torch.empty(2, 9))
    with pytest.raises(IndexError, match="row index out of range"):
        kernel.dequantize_rows(w, torch.tensor([8]))
    with pytest.raises(IndexError, match="out of range"):
        kernel.dequantize_rows(w, start=6, count=3)
    with pytest.raises(ValueError, match="multiples of 32"):
        BlockQuantWeight(w.q, w.scales, None, "q4_0", 4, 32, 8, 48, 8)
    with pytest.raises(ValueError, match="q must be"):
        BlockQuantWeight(w.q[:, :16].contiguous(), w.scales, None, "q4_0", 4, 32, 8, 64, 8)


@pytest.mark.parametrize("m", [3, 20])
def test_strided_rows_of_x_and_out(kernel: QLinearKernel, m: int) -> None:
    """x and out may be views with a row stride (slices of wider activations)."""
    w = make_weight("q8_0", 9, 64)
    x = torch.randn(m, 100)[:, 10:74]
    wide_out = torch.full((m, 15), 7.0)
    kernel.linear(x, w, out=wide_out[:, 3:12])
    ref = cq.linear_reference(x.contiguous(), w)
    torch.testing.assert_close(wide_out[:, 3:12], ref, rtol=1e-5, atol=1e-5)
    assert bool((wide_out[:, :3] == 7).all() and (wide_out[:, 12:] == 7).all())


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "int4"])
@pytest.mark.parametrize("m", [1, 4, GEMM_MIN_ROWS + 3])
def test_block_quant_linear_module(fmt: str, m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The drop-in module over each path (GEMV, tiled, dequantize + GEMM in slices) and the torch fallback."""
    import server.quant.block_linear as bl

    monkeypatch.setattr(bl, "SLICE_BYTES", 64 * 4 * 16)  # several slices even for this small weight
    w = make_weight(fmt, 70, 256)
    bias = torch.randn(70)
    lin = BlockQuantLinear(w, bias)
    assert (lin.in_features, lin.out_features) == (256, 70)
    x = torch.randn(2, m, 256)  # leading dims kept, like nn.Linear
    ref = cq.linear_reference(x.reshape(-1, 256), w, bias).reshape(2, m, 70)
    torch.testing.assert_close(lin(x), ref, rtol=1e-4, atol=1e-4)
    lin.kernel = None
    torch.testing.assert_close(lin(x), ref, rtol=1e-4, atol=1e-4)
    assert lin.weight_nbytes() == w.nbytes() + 70 * 4


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "q4_k"])
def test_bf16_dequant_gemm_within_bf16_rounding(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 prefill GEMM against the fp64 reference: x and W each rounded to bf16 (relative error
    <= 2^-9), the result rounded once more (2^-9 of |y|); independent errors over K grow like sqrt(K)."""
    import server.quant.block_linear as bl

    monkeypatch.setattr(bl, "SLICE_BYTES", 64 * 4 * 16)  # several slices
    w = make_weight(fmt, 70, 512)
    k = w.in_features
    lin = BlockQuantLinear(w, torch.randn(70))
    assert lin.kernel is not None and lin.bias is not None
    x = torch.randn(GEMM_MIN_ROWS + 3, k)
    ref = cq.linear_reference(x.double(), w, lin.bias.double()).float()
    y = lin._dequant_gemm(x, w, lin.kernel, torch.bfloat16)
    assert y.dtype == torch.float32 and y.shape == ref.shape
    err = (y - ref).abs().max().item()
    scale = (x.abs().mean() * cq.dequantize_reference(w).abs().mean()).item()
    assert err <= 4 * 2**-8 * scale * k**0.5 + 2**-8 * ref.abs().max().item(), err
    assert not torch.equal(y, lin._dequant_gemm(x, w, lin.kernel))  # it did compute in bf16
    # W dequantized straight to bf16 where the kernel can: the same values as rounding each fp32 slice
    monkeypatch.setattr(cq.QLinearKernel, "bf16_dequant_supported", lambda *a: False)
    assert torch.equal(y, lin._dequant_gemm(x, w, lin.kernel, torch.bfloat16))


def test_fused_module_computes_the_parts_side_by_side() -> None:
    a, b = (
        BlockQuantLinear(make_weight("q4_1", 12, 64, seed=1)),
        BlockQuantLinear(make_weight("q4_1", 4, 64, seed=2)),
    )
    fused = BlockQuantLinear.fuse([a, b])
    assert fused is not None
    x = torch.randn(3, 64)
    torch.testing.assert_close(fused(x), torch.cat([a(x), b(x)], dim=1), rtol=1e-5, atol=1e-5)
    assert BlockQuantLinear.fuse([a, BlockQuantLinear(make_weight("q8_0", 4, 64))]) is None


def test_block_quant_embedding_dequantizes_only_the_rows_it_looks_up() -> None:
    w = make_weight("q8_0", 100, 64)
    emb = BlockQuantEmbedding(w)
    ids = torch.tensor([[3, 99], [0, 3]])
    out = emb(ids)
    assert out.shape == (2, 2, 64)
    assert torch.equal(out.reshape(4, 64), cq.dequantize_reference(w)[ids.reshape(-1)])
    with pytest.raises(IndexError, match="token id out of range"):
        emb(torch.tensor([100]))
