"""The k-quant tiles' amx path (server/quant/csrc/qk_native.cpp, "amx path"): bf16 layers' batches over
Q4_K / Q6_K 16-row tiles on AMX-BF16 tiles, against round_bf16(x) @ round_bf16(W)^T.

Tolerance: the B tiles hold W as dequantize_reference gives it rounded to bf16 (round to nearest even, as
torch rounds), x is rounded the same way, the products of two bf16 are exact in fp32 and only the fp32 sums
differ from the float64 reference: |err| <= 1e-5 * (|x_bf16| @ |W_bf16|^T) + 1e-6 (K <= 2,304 terms; fp32
summation's worst case ~K * 2^-24 ~ 1.4e-4 is loose, the observed ~5e-8 relative).

The path runs only where AMX-BF16 is usable (an Intel Xeon of Sapphire Rapids or later, with Linux granting
the tile data); elsewhere these tests skip but the routing tests still check that nothing takes it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from server.native import usable_cpu_features
from server.quant import cpu_qk_native as qk
from server.quant import cpu_qlinear as cq
from server.quant.block_linear import BlockQuantLinear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_cpu_qk_native import quantized_blocks, random_blocks


@pytest.fixture(scope="module")
def kernel() -> qk.QKNativeKernel:
    return qk.load_qk_native_kernel()


@pytest.fixture
def amx(kernel: qk.QKNativeKernel) -> Iterator[qk.QKNativeKernel]:
    """The kernel with the amx path on from AMX_MIN_ROWS rows; skips where AMX-BF16 is not usable."""
    if not usable_cpu_features().amx_bf16:
        pytest.skip("AMX-BF16 is not usable on this CPU")
    before = kernel.amx_min_rows
    assert kernel.set_amx(qk.AMX_MIN_ROWS) == qk.AMX_MIN_ROWS
    yield kernel
    kernel.set_amx(before)


def bf16_slack(x: torch.Tensor, w: qk.KQuantBlocks) -> torch.Tensor:  # -> [M, N]
    wb = qk.dequantize_reference(w).bfloat16().float()
    return 1e-5 * (x.bfloat16().float().abs() @ wb.abs().t()) + 1e-6


def assert_bf16_product(y: torch.Tensor, x: torch.Tensor, w: qk.KQuantBlocks, label: str) -> None:
    err = (y - qk.linear_bf16_reference(x, w)).abs()
    slack = bf16_slack(x, w)
    assert (err <= slack).all(), f"{label}: max excess {(err - slack).max().item():.3g}"


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
@pytest.mark.parametrize("m", [1, 15, 16, 33, 64, 65, 130])
@pytest.mark.parametrize("make", [random_blocks, quantized_blocks])
def test_matches_the_bf16_product(amx: qk.QKNativeKernel, fmt: str, m: int, make) -> None:
    """Any M: one group of rows (dequantized super-block by super-block) and several (the column tile's B
    tiles made first), rows padded to 16; every scale, min and high-bit pattern (random_blocks)."""
    tiles = amx.interleave(make(fmt, 48, 1024, seed=m))
    x = torch.randn(m, 1024, generator=torch.Generator().manual_seed(300 + m)) * 3.0
    x[0, :7] = 0.0
    assert_bf16_product(amx.linear_bf16(x, tiles), x, tiles, f"{fmt} M={m}")


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
@pytest.mark.parametrize("m", [40, 300])
def test_blocks_of_rows_and_k(amx: qk.QKNativeKernel, fmt: str, m: int) -> None:
    """K past one block (2,048 + 256: the C tiles carried across K blocks through y, partial rows too) and,
    at 300 rows, two blocks of rows (256 rows of a 2,048-column bf16 x fill the 1 MB block)."""
    tiles = amx.interleave(quantized_blocks(fmt, 32, 2304, seed=m))
    x = torch.randn(m, 2304, generator=torch.Generator().manual_seed(400 + m))
    assert_bf16_product(amx.linear_bf16(x, tiles), x, tiles, f"{fmt} M={m} K=2304")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_and_strided_io(amx: qk.QKNativeKernel, threads: int) -> None:
    """Column tiles split over threads (more threads than tiles too), x rows strided, y a view: nothing
    written outside it."""
    tiles = amx.interleave(quantized_blocks("q4_k", 32, 512, seed=5))
    big = torch.randn(40, 600)
    x = big[:, 9:521]
    out = torch.full((40, 40), 7.0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        amx.linear_bf16(x, tiles, out=out[:, 4:36])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out[:, :4], torch.full((40, 4), 7.0)) and torch.equal(
        out[:, 36:], torch.full((40, 4), 7.0)
    )
    assert_bf16_product(out[:, 4:36], x, tiles, f"threads={threads}")


def test_bad_arguments_and_off(kernel: qk.QKNativeKernel) -> None:
    tiles = kernel.interleave(random_blocks("q4_k", 16, 256, seed=0))
    with pytest.raises(ValueError, match="amx path takes"):
        kernel.linear_bf16(torch.zeros(1, 256), random_blocks("q4_k", 16, 256, seed=0))
    with pytest.raises(TypeError):
        kernel.linear_bf16(torch.zeros(1, 256, dtype=torch.float64), tiles)
    with pytest.raises(ValueError, match="must be"):
        kernel.linear_bf16(torch.zeros(1, 512), tiles)
    with pytest.raises(ValueError, match="min_rows"):
        kernel.set_amx(-1)
    before = kernel.amx_min_rows
    try:
        assert kernel.set_amx(0) == 0
        with pytest.raises(RuntimeError, match="amx path is off"):
            kernel.linear_bf16(torch.zeros(40, 256), tiles)
    finally:
        kernel.set_amx(before)


def test_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    amx_here = usable_cpu_features().amx_bf16
    monkeypatch.delenv(qk.AMX_ENV, raising=False)
    assert qk.default_amx_min_rows() == (qk.AMX_MIN_ROWS if amx_here else 0)
    monkeypatch.setenv(qk.AMX_ENV, "0")
    assert qk.default_amx_min_rows() == 0
    monkeypatch.setenv(qk.AMX_ENV, "48")
    assert qk.default_amx_min_rows() == (48 if amx_here else 0)
    for bad in ("yes", "-3", "1.5"):
        monkeypatch.setenv(qk.AMX_ENV, bad)
        with pytest.raises(ValueError, match=qk.AMX_ENV):
            qk.default_amx_min_rows()
    monkeypatch.setenv(qk.AMX_ENV, "")
    monkeypatch.setenv("KUBEINFER_CPU_DISABLE", "amx")
    assert qk.default_amx_min_rows() == 0


def test_the_start_up_line_says_what_runs() -> None:
    kernel = qk.try_load_qk_native_kernel(None)  # the one amx_tiles_text() reads (its cache_dir)
    assert kernel is not None
    before = kernel.amx_min_rows
    try:
        kernel.set_amx(0)
        assert qk.amx_tiles_text() == ""
        if kernel.set_amx(40):
            assert "40+ rows" in qk.amx_tiles_text() and qk.AMX_ENV in qk.amx_tiles_text()
    finally:
        kernel.set_amx(before)


def tiled_layer(
    fmt: str, n: int, k: int, gemm_dtype: torch.dtype
) -> tuple[BlockQuantLinear, qk.KQuantBlocks]:
    """A layer over 16-row tiles as the loader holds a GGUF k-quant (cpu_qlinear.interleave_x16)."""
    raw = quantized_blocks(fmt, n, k, seed=11)
    w = cq.interleave_x16(
        cq.BlockQuantWeight(raw.blocks, torch.empty(n, 0), None, fmt, cq.KQUANT_BITS, 256, 0, k, n)
    )
    layer = BlockQuantLinear(w, kernel=cq.load_qlinear_kernel())
    layer.gemm_dtype = gemm_dtype
    return layer, qk.KQuantBlocks(w.q, w.fmt, k, n)


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_bf16_layers_batches_take_it_and_nothing_else_does(amx: qk.QKNativeKernel, fmt: str) -> None:
    """Through the serving entry point (BlockQuantLinear -> qlinear's descriptor -> kubeinfer_qk_qlinear):
    a bf16 layer's batch of AMX_MIN_ROWS rows or more gives the bf16 product, fewer rows the int8
    kernels' W @ x^ (bit for bit the direct int8 call), and an fp32 layer never takes the bf16 path."""
    layer, tiles = tiled_layer(fmt, 64, 512, torch.bfloat16)
    big = torch.randn(qk.AMX_MIN_ROWS, 512, generator=torch.Generator().manual_seed(1))
    assert_bf16_product(layer(big), big, tiles, f"{fmt} bf16 layer, {qk.AMX_MIN_ROWS} rows")
    assert not torch.equal(layer(big), amx.linear(big, tiles))  # not the int8 kernels' result
    small = big[: qk.AMX_MIN_ROWS - 1]
    assert torch.equal(layer(small), amx.linear(small, tiles))
    fp32_layer, _ = tiled_layer(fmt, 64, 512, torch.float32)
    y = fp32_layer(big)
    exact = big.double() @ qk.dequantize_reference(tiles).double().t()
    # fp32 activations (the parity tests' compute): far closer than bf16 rounding of x would allow
    assert (y.double() - exact).abs().max() < 1e-4 * exact.abs().max()
    assert (qk.linear_bf16_reference(big, tiles).double() - exact).abs().max() > 1e-3 * exact.abs().max()
