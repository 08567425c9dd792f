"""The MXFP4 CPU kernel (server/quant/csrc/mxfp4.cpp) against the dequantize + float64 reference, on each
code path this CPU runs (AVX-512, AVX2 forced by set_path and by KUBEINFER_CPU_DISABLE, scalar)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from server import native
from server.cpu_features import CpuFeatures
from server.quant import cpu_mxfp4 as mx


@pytest.fixture(scope="module")
def kernel() -> Iterator[mx.Mxfp4Kernel]:
    k = mx.load_mxfp4_kernel()
    yield k
    k.set_path(mx.path_for(native.usable_cpu_features()))  # the path a server would run


def _available() -> list[str]:
    best = mx.PATHS.index(mx.path_for(native.usable_cpu_features()))
    return list(mx.PATHS[: best + 1])


def _weight(n: int, k: int, seed: int, lo: int = 118, hi: int = 131) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 32, 16), generator=g, dtype=torch.uint8)  # every code
    scales = torch.randint(lo, hi, (n, k // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def _check(
    y: torch.Tensor, x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """fp32 sums in another order than the float64 reference: within 1e-5 of sum_k |x_k w_k| (K <= 2880:
    a rounding per term of at most 2**-24 leaves ~1.7e-4 in the worst case, ~3e-6 typically)."""
    ref = mx.linear_reference(x, blocks, scales, bias).double()
    scale = x.double().abs() @ mx.dequantize_mxfp4(blocks, scales).double().abs().t()
    assert ((y.double() - ref).abs() <= 1e-5 * scale + 1e-6).all()


@pytest.mark.parametrize("path", mx.PATHS)
@pytest.mark.parametrize("n,k", [(37, 96), (9, 2880), (4, 32)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 13, 16, 33, 64])
def test_linear_matches_the_reference(kernel: mx.Mxfp4Kernel, path: str, n: int, k: int, m: int) -> None:
    """M = 1..64 (every remainder of the 8-, 4- and 2-row tiles), N with a partial 4-row tile (37, 9), K of
    one block up to gpt-oss-20b's 2880."""
    if path not in _available():
        pytest.skip(f"this CPU (or KUBEINFER_CPU_DISABLE) does not allow the {path} path")
    assert kernel.set_path(path) == path
    blocks, scales = _weight(n, k, seed=n + k + m)
    x = torch.randn(m, k) * torch.linspace(0.1, 3.0, k)
    bias = torch.randn(n) if m % 2 else None
    _check(kernel.linear(x, blocks, scales, bias), x, blocks, scales, bias)


@pytest.mark.parametrize("path", mx.PATHS)
def test_every_code_and_scale_decodes_exactly(kernel: mx.Mxfp4Kernel, path: str) -> None:
    """x = rows of the identity: y[i, n] = W[n, i] with one nonzero term, so the decode itself must be
    exact, for all 16 codes (both nibbles) and scales 0..250 (2**-127, a subnormal, up to 2**123)."""
    if path not in _available():
        pytest.skip(f"this CPU does not allow the {path} path")
    kernel.set_path(path)
    blocks, scales = _weight(8, 64, seed=1, lo=0, hi=251)
    scales[0, 0] = 0
    blocks[0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # every code, low and high nibble
    x = torch.eye(64)
    y = kernel.linear(x, blocks, scales)
    assert torch.equal(y, mx.dequantize_mxfp4(blocks, scales).t())


def test_strided_rows_and_out(kernel: mx.Mxfp4Kernel) -> None:
    """x rows further apart than K (a slice of a wider buffer) and an `out` view into a wider tensor."""
    kernel.set_path(mx.path_for(native.usable_cpu_features()))
    blocks, scales = _weight(12, 64, seed=3)
    wide = torch.randn(5, 100)
    x = wide[:, 10:74]
    out = torch.full((5, 20), 7.0)
    got = kernel.linear(x, blocks, scales, out=out[:, 4:16])
    _check(got, x.contiguous(), blocks, scales, None)
    assert torch.equal(out[:, :4], torch.full((5, 4), 7.0)) and torch.equal(
        out[:, 16:], torch.full((5, 4), 7.0)
    )
    assert kernel.linear(torch.empty(0, 64), blocks, scales).shape == (0, 12)


def test_bad_arguments_are_refused_by_name(kernel: mx.Mxfp4Kernel) -> None:
    blocks, scales = _weight(6, 64, seed=4)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        kernel.linear(torch.randn(2, 48), blocks[:, :1].contiguous(), scales[:, :1].contiguous())
    with pytest.raises(ValueError, match="x must be"):
        kernel.linear(torch.randn(2, 96), blocks, scales)  # K of x is not the weight's
    with pytest.raises(ValueError, match="blocks must be"):
        kernel.linear(x, blocks.reshape(6, 4, 8), scales)
    with pytest.raises(ValueError, match="blocks must be"):
        kernel.linear(x, blocks, scales[:, :1].contiguous())
    with pytest.raises(TypeError, match="uint8"):
        kernel.linear(x, blocks.to(torch.int8), scales)
    with pytest.raises(TypeError, match="float32"):
        kernel.linear(x.double(), blocks, scales)
    with pytest.raises(ValueError, match="contiguous"):
        kernel.linear(x, blocks.transpose(0, 1).contiguous().transpose(0, 1), scales)
    with pytest.raises(ValueError, match="bias"):
        kernel.linear(x, blocks, scales, torch.randn(5))
    with pytest.raises(ValueError, match="out must be"):
        kernel.linear(x, blocks, scales, out=torch.empty(2, 5))
    with pytest.raises(ValueError, match="unit stride"):
        kernel.linear(torch.randn(64, 2).t(), blocks, scales)


def test_path_follows_the_usable_features(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert mx.path_for(CpuFeatures(avx2=True, fma=True, avx512f=True)) == "avx512"
    assert mx.path_for(CpuFeatures(avx2=True, fma=True)) == "avx2"
    assert mx.path_for(CpuFeatures(avx2=True)) == "scalar"
    assert mx.path_for(CpuFeatures()) == "scalar"
    here = native.usable_cpu_features()
    assert mx.load_mxfp4_kernel().isa == mx.path_for(here)
    if not here.avx512f:
        pytest.skip("this CPU has no usable AVX-512 to turn off")
    # KUBEINFER_CPU_DISABLE=avx512: a fresh build without AVX-512 code generation (-mno-avx512f) loads
    # and runs the AVX2 path, and is still right.
    monkeypatch.setenv("KUBEINFER_CPU_DISABLE", "avx512")
    off = mx.load_mxfp4_kernel(tmp_path)
    assert off.isa == "avx2"
    blocks, scales = _weight(19, 160, seed=5)
    x = torch.randn(6, 160)
    _check(off.linear(x, blocks, scales), x, blocks, scales, None)


def test_gguf_blocks_move_exactly_into_our_layout() -> None:
    """ggml's block_mxfp4 (the e8m0 byte, then low nibbles = elements 0-15, high = 16-31), written by
    gguf-py's quantizer, reads back to gguf-py's own dequantization bit for bit; a wrong size is refused."""
    import gguf
    import numpy as np

    w = torch.randn(3, 5, 96, generator=torch.Generator().manual_seed(6)).numpy() * 4
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    raw = gguf.quants.quantize(w.reshape(-1, 96), mxfp4)  # [15, 3 * 17] uint8
    ref = gguf.quants.dequantize(raw, mxfp4).reshape(3, 5, 96)
    blocks, scales = mx.from_gguf_mxfp4(torch.from_numpy(raw), (3, 5, 96))
    assert blocks.shape == (3, 5, 3, 16) and scales.shape == (3, 5, 3)
    assert np.array_equal(mx.dequantize_mxfp4(blocks, scales).numpy(), ref)
    with pytest.raises(ValueError, match="do not hold"):
        mx.from_gguf_mxfp4(torch.from_numpy(raw), (3, 5, 64))
    with pytest.raises(ValueError, match="32-value blocks"):
        mx.from_gguf_mxfp4(torch.from_numpy(raw), (3, 5, 48))
