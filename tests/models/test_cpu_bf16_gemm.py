"""server/models/cpu_bf16_gemm.py: the panel layout, both kernel paths against an fp64 reference, the
launcher's refusals, and the drop-in Linear against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from server.models.cpu_bf16_gemm import (
    Bf16PanelLinear,
    Bf16Panels,
    error_bound,
    linear_reference,
    load_bf16_gemm_kernel,
    panels_reference,
)


@pytest.fixture(scope="module")
def kernel():  # type: ignore[no-untyped-def]
    k = load_bf16_gemm_kernel()
    fast = k.isa
    yield k
    k.set_path(fast)


def _paths(kernel) -> list[str]:  # type: ignore[no-untyped-def]
    return ["scalar", "avx512bf16"] if kernel.set_path("avx512bf16") == "avx512bf16" else ["scalar"]


@pytest.mark.parametrize(("n", "k"), [(1, 2), (17, 7), (48, 64), (100, 130), (257, 96)])
def test_pack_matches_the_torch_layout(kernel, n: int, k: int) -> None:  # type: ignore[no-untyped-def]
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * k)).bfloat16()
    assert torch.equal(kernel.pack(w).panels, panels_reference(w))
    # a strided view packs as its contiguous copy
    wide = torch.randn(n, k + 5).bfloat16()
    assert torch.equal(kernel.pack(wide[:, :k]).panels, panels_reference(wide[:, :k].contiguous()))


@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 16, 33, 64])
@pytest.mark.parametrize(
    ("n", "k", "bias"), [(16, 64, False), (50, 33, True), (129, 256, True), (300, 96, False)]
)
def test_linear_within_the_fp32_summation_bound(kernel, m: int, n: int, k: int, bias: bool) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g) if bias else None
    panels = kernel.pack(w)
    ref = linear_reference(x, w, b)
    bound = error_bound(x, w) + 1e-6
    for path in _paths(kernel):
        kernel.set_path(path)
        got = kernel.linear(x, panels, b, torch.float32)
        assert got.shape == (m, n)
        assert bool(((got - ref).abs() <= bound).all()), path
        # bf16 output: the fp32 result rounded to nearest even
        assert torch.equal(kernel.linear(x, panels, b), got.bfloat16()), path
        # fp32 output of bf16 values (a bf16 model's logits): that bf16 result widened, bit for bit
        widened = kernel.linear(x, panels, b, torch.float32, bf16_values=True)
        assert widened.dtype == torch.float32 and torch.equal(widened, got.bfloat16().float()), path


def test_strided_rows_of_x_are_read_by_their_stride(kernel) -> None:  # type: ignore[no-untyped-def]
    w = torch.randn(40, 64).bfloat16()
    big = torch.randn(6, 100).bfloat16()
    x = big[:, 10:74]  # row stride 100
    panels = kernel.pack(w)
    torch.testing.assert_close(
        kernel.linear(x, panels, out_dtype=torch.float32),
        kernel.linear(x.contiguous(), panels, out_dtype=torch.float32),
        rtol=0,
        atol=0,
    )


def test_bad_arguments_are_refused(kernel) -> None:  # type: ignore[no-untyped-def]
    w = torch.randn(32, 64).bfloat16()
    panels = kernel.pack(w)
    with pytest.raises(TypeError):
        kernel.linear(torch.randn(2, 64), panels)  # fp32 x
    with pytest.raises(ValueError):
        kernel.linear(torch.randn(2, 63).bfloat16(), panels)
    with pytest.raises(ValueError):
        kernel.linear(torch.randn(2, 64).bfloat16(), panels, torch.randn(31))
    with pytest.raises(TypeError):
        kernel.linear(torch.randn(2, 64).bfloat16(), panels, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="bf16_values"):  # only an fp32 out is rounded by it
        kernel.linear(torch.randn(2, 64).bfloat16(), panels, bf16_values=True)
    with pytest.raises(TypeError):
        kernel.pack(torch.randn(4, 4))
    with pytest.raises(ValueError):
        kernel.pack(torch.randn(0, 4).bfloat16())
    with pytest.raises(ValueError):
        Bf16Panels(panels.panels, 65, 32)  # the wrong K for these panels
    with pytest.raises(ValueError):
        kernel.set_path("amx")
    assert kernel.linear(torch.empty(0, 64, dtype=torch.bfloat16), panels).shape == (0, 32)


@pytest.mark.parametrize("lead", [(3,), (2, 5)])
def test_the_drop_in_linear_agrees_with_f_linear(kernel, lead: tuple[int, ...]) -> None:  # type: ignore[no-untyped-def]
    """Against F.linear in bf16 (oneDNN's kernel, another summation order): at most one bf16 ulp of the
    output apart, and the same fp32-rounded values before that rounding (checked above)."""
    lin = nn.Linear(96, 70, bias=True, dtype=torch.bfloat16)
    x = torch.randn(*lead, 96).bfloat16()
    got = Bf16PanelLinear(lin, kernel)(x)
    want = F.linear(x, lin.weight, lin.bias)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    ulp = want.float().abs().clamp_min(2.0**-126) * 2.0**-7
    assert bool(((got.float() - want.float()).abs() <= ulp + 2.0**-8 * (96 / 64)).all())
    # the logits' entry (LlamaForCausalLM.compute_logits): the same values, widened by the GEMM
    flat = x.reshape(-1, 96)
    widened = Bf16PanelLinear(lin, kernel).widened(flat)
    assert widened.dtype == torch.float32 and torch.equal(widened, got.reshape(-1, 70).float())


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("m", [9, 16, 23, 64, 65])
def test_rows_in_k_chunks_sum_as_one_pass_per_tile(kernel, m: int, threads: int) -> None:  # type: ignore[no-untyped-def]
    """9-64 rows walk each block's K in chunks of 512 pairs, the tiles' partial sums kept between chunks
    (bf16_gemm.cpp run_chunked): K of several chunks and a short last one, blocks split unevenly over the
    threads. The fp32 sums keep K's order, so the result is bit for bit each 8-row tile's own whole-K pass
    (1-8 rows take run_whole) and within the fp32 bound of the fp64 reference."""
    n, k = 16 * 3 * 5 + 7, 2 * (2 * 512 + 300) + 1  # 247 columns: 6 blocks, the last short; K odd
    g = torch.Generator().manual_seed(m * 10 + threads)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g)
    panels = kernel.pack(w)
    ref = linear_reference(x, w, b)
    bound = error_bound(x, w) + 1e-6
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for path in _paths(kernel):
            kernel.set_path(path)
            got = kernel.linear(x, panels, b, torch.float32)
            tiles = torch.cat([kernel.linear(x[r : r + 8], panels, b, torch.float32) for r in range(0, m, 8)])
            assert torch.equal(got, tiles), path
            assert bool(((got - ref).abs() <= bound).all()), path
    finally:
        torch.set_num_threads(before)


def test_rows_past_a_group_of_x_sum_as_one_pass_per_tile(kernel) -> None:  # type: ignore[no-untyped-def]
    """At many rows whose x outgrows 8 MB (bf16_gemm.cpp X_GROUP_BYTES: 512 rows at K = 8192) the blocks
    walk the rows group by group; groups hold whole 8-row tiles, so the result is bit for bit each tile's
    own pass, and within the fp32 bound of the fp64 reference."""
    m, n, k = 1100, 40, 8192  # 3 groups of 368, 368 and 364 rows (at most 512: 8 MB)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    panels = kernel.pack(w)
    got = kernel.linear(x, panels, out_dtype=torch.float32)
    tiles = torch.cat([kernel.linear(x[r : r + 8], panels, out_dtype=torch.float32) for r in range(0, m, 8)])
    assert torch.equal(got, tiles)
    assert bool(((got - linear_reference(x, w)).abs() <= error_bound(x, w) + 1e-6).all())
