"""The kernel's bf16 batched path (server/quant/csrc/qlinear.cpp, "batched path in bf16"): decode batches
of 4..255 rows of a layer whose gemm_dtype is bf16, on a CPU with usable AVX512-BF16.

What each test compares, and how close:
- every format, M in {4, 5, 8, 15, 16, 17, 31, 64, 255}, ragged N, with a bias: the kernel against x and the
  dequantized W rounded to bf16 (torch's round to nearest even) and multiplied in fp64: within fp32
  summation's bound, K * 2^-24 * sum_k |x_k w_k| (+ the bias's rounding), far tighter than bf16's own
  rounding, so an fp32 result (or a wrong rounding) fails it;
- odd K (per-channel int8): the pad of the last k-pair contributes nothing;
- the GEMV (M <= 3 under bf16), and every M with the path forced off (KUBEINFER_CPU_DISABLE=avx512_bf16), give
  the fp32 kernel's result bit for bit; a descriptor with an unknown compute value is refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_cpu_qlinear import FORMATS, make_weight

from server import native
from server.cpu_features import DISABLE_ENV
from server.quant import cpu_qlinear as cq
from server.quant.cpu_qlinear import BlockQuantWeight, QLinearKernel


@pytest.fixture(scope="module")
def kernel() -> QLinearKernel:
    return cq.load_qlinear_kernel()


@pytest.fixture
def bf16_kernel(kernel: QLinearKernel) -> QLinearKernel:
    if not kernel.bf16:
        pytest.skip("no usable AVX512-BF16 here (or KUBEINFER_CPU_DISABLE turned it off)")
    return kernel


def bf16_reference(
    x: torch.Tensor, w: BlockQuantWeight, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(round_bf16(x) @ round_bf16(W)^T + bias in fp64, the fp32-summation error bound) [M, N] each."""
    xb = x.bfloat16().double()
    wb = cq.dequantize_reference(w).bfloat16().double()
    ref = xb @ wb.t()
    magnitude = xb.abs() @ wb.abs().t()
    if bias is not None:
        ref = ref + bias.double()
        magnitude = magnitude + bias.double().abs()
    k = w.in_features
    return ref, (k + 1) * 2.0**-24 * magnitude + 1e-30


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(37, 64), (13, 576)])
@pytest.mark.parametrize("m", [4, 5, 8, 15, 16, 17, 31, 64, 255])
def test_bf16_batched_path_is_the_bf16_product_in_fp32_sums(
    bf16_kernel: QLinearKernel, fmt: str, n: int, k: int, m: int
) -> None:
    w = make_weight(fmt, n, k, seed=n * k + m)
    k = w.in_features  # k-quants: whole super-blocks
    g = torch.Generator().manual_seed(m)
    x, bias = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    y = bf16_kernel.linear(x, w, bias, compute=torch.bfloat16)
    ref, bound = bf16_reference(x, w, bias)
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    # the fp32 kernel is not within that bound: the test tells the paths apart
    err32 = (bf16_kernel.linear(x, w, bias).double() - ref).abs()
    assert bool((err32 > bound).any())


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("m", [100, 255])
def test_bf16_several_chunks_of_packed_x(bf16_kernel: QLinearKernel, fmt: str, m: int) -> None:
    """K = 4096: four 16-row blocks per chunk of packed x, so pairs of blocks, single blocks and 8-row
    blocks all occur across chunks."""
    w = make_weight(fmt, 13, 4096, seed=m)
    x = torch.randn(m, 4096)
    y = bf16_kernel.linear(x, w, compute=torch.bfloat16)
    ref, bound = bf16_reference(x, w, None)
    assert bool(((y.double() - ref).abs() <= bound).all())


@pytest.mark.parametrize("k", [7, 33, 100])
@pytest.mark.parametrize("m", [5, 19])
def test_bf16_odd_k_pads_the_last_pair(bf16_kernel: QLinearKernel, k: int, m: int) -> None:
    w = make_weight("int8", 11, k, seed=k)
    x = torch.randn(m, k)
    y = bf16_kernel.linear(x, w, compute=torch.bfloat16)
    ref, bound = bf16_reference(x, w, None)
    assert bool(((y.double() - ref).abs() <= bound).all())


def test_bf16_strided_x_and_out(bf16_kernel: QLinearKernel) -> None:
    w = make_weight("q4_0", 24, 64, seed=3)
    big, out = torch.randn(20, 100), torch.full((20, 30), 7.0)
    x = big[:, 10:74]
    y = bf16_kernel.linear(x, w, out=out[:, 2:26], compute=torch.bfloat16)
    ref, bound = bf16_reference(x, w, None)
    assert bool(((y.double() - ref).abs() <= bound).all())
    assert bool((out[:, :2] == 7).all() and (out[:, 26:] == 7).all())


def test_gemv_rows_stay_fp32_bit_for_bit(kernel: QLinearKernel) -> None:
    """M <= BF16_GEMV_MAX_ROWS is bound by the weight's bytes: compute=bf16 changes nothing there."""
    w = make_weight("q4_1", 40, 576, seed=1)
    for m in range(1, cq.BF16_GEMV_MAX_ROWS + 1):
        x = torch.randn(m, 576)
        assert torch.equal(kernel.linear(x, w, compute=torch.bfloat16), kernel.linear(x, w))


def test_forced_off_runs_fp32_bit_for_bit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """KUBEINFER_CPU_DISABLE=avx512_bf16: a fresh load (its own cache) never takes the bf16 path; the same
    call gives the fp32 result bit for bit."""
    if not native.is_x86_64():
        pytest.skip("x86-64 only")
    monkeypatch.setenv(DISABLE_ENV, "avx512_bf16")
    forced = cq.load_qlinear_kernel(tmp_path)
    assert not forced.bf16 and forced.lib.kubeinfer_qlinear_bf16_enabled() == 0
    assert forced.lib.kubeinfer_qlinear_has_bf16_path() == (1 if forced.isa != "portable" else 0)
    for fmt in ("q4_0", "q6_k", "int8"):
        w = make_weight(fmt, 37, 256, seed=2)
        for m in (5, 16, 70):
            x = torch.randn(m, w.in_features)
            assert torch.equal(forced.linear(x, w, compute=torch.bfloat16), forced.linear(x, w))


def test_unknown_compute_value_is_refused(kernel: QLinearKernel) -> None:
    import ctypes

    w = make_weight("q8_0", 8, 64)
    x, y = torch.randn(8, 64), torch.empty(8, 8)
    desc = cq.weight_descriptor(w)
    for bad in (-1, 3):
        desc.compute = bad
        rc = kernel.lib.kubeinfer_qlinear(ctypes.byref(desc), x.data_ptr(), 8, 64, None, y.data_ptr(), 8, 1)
        assert rc == 1
    # compute int8 (gemm_dtype int8): this library has no int8 path and computes fp32, bit for bit
    desc.compute = cq.COMPUTE_INT8
    assert (
        kernel.lib.kubeinfer_qlinear(ctypes.byref(desc), x.data_ptr(), 8, 64, None, y.data_ptr(), 8, 1) == 0
    )
    assert torch.equal(y, kernel.linear(x, w))
    with pytest.raises(ValueError, match="float32, bfloat16 or int8"):
        cq.weight_descriptor(w, torch.float16)
