"""The fp8 CPU kernel (server/quant/csrc/fp8.cpp) against the float64 reference, on each code path this CPU
runs (AVX-512, AVX2 and scalar forced by set_path), and `Fp8Linear` serving decode batches through it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from server import native
from server.quant import cpu_fp8
from server.quant.layers import Fp8Linear


@pytest.fixture(scope="module")
def kernel() -> Iterator[cpu_fp8.Fp8Kernel]:
    k = cpu_fp8.load_fp8_kernel()
    yield k
    k.set_path(cpu_fp8.path_for(native.usable_cpu_features()))  # the path a server would run


def _available() -> list[str]:
    best = cpu_fp8.PATHS.index(cpu_fp8.path_for(native.usable_cpu_features()))
    return list(cpu_fp8.PATHS[: best + 1])


def _codes(n: int, k: int, seed: int) -> torch.Tensor:  # -> [N, K] float8_e4m3fn, every code but NaN
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # NaN codes are refused at load (check_codes)
    return codes.view(torch.float8_e4m3fn)


def _check(
    y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """fp32 sums in another order than the float64 reference: within 1e-5 of sum_k |x_k w_k s| (a rounding
    per term of at most 2**-24; K <= 2,080 here)."""
    ref = cpu_fp8.linear_reference(x, w, scale, bias).double()
    bound = (x.double().abs() @ w.double().abs().t()) * scale.double().abs()
    assert ((y.double() - ref).abs() <= 1e-5 * bound + 1e-6).all()


@pytest.mark.parametrize("path", cpu_fp8.PATHS)
@pytest.mark.parametrize("n,k", [(37, 96), (9, 2080), (5, 23), (3, 7)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 13, 16, 33, 64])
def test_linear_matches_the_reference(kernel: cpu_fp8.Fp8Kernel, path: str, n: int, k: int, m: int) -> None:
    """M = 1..64 (every remainder of the 4-row tile), K with tails after the 16- and 8-code loads (23, 7),
    N split across threads unevenly."""
    if path not in _available():
        pytest.skip(f"this CPU (or KUBEINFER_CPU_DISABLE) does not allow the {path} path")
    assert kernel.set_path(path) == path
    w = _codes(n, k, seed=n + k + m)
    scale = torch.rand(n) * 0.01 + 1e-4
    x = torch.randn(m, k) * torch.linspace(0.1, 3.0, k)
    bias = torch.randn(n) if m % 2 else None
    _check(kernel.linear(x, w, scale, bias), x, w, scale, bias)


@pytest.mark.parametrize("path", cpu_fp8.PATHS)
def test_every_code_decodes_exactly(kernel: cpu_fp8.Fp8Kernel, path: str) -> None:
    """x = the identity: y[i, n] = W[n, i] * 1.0 with one nonzero term, so the decode itself must be exact for
    all 254 codes that are numbers (zeros, the subnormals 2**-9..7 * 2**-9, normals up to 448, both signs),
    each at a position that the vector loads reach and one that only the tail reaches."""
    if path not in _available():
        pytest.skip(f"this CPU does not allow the {path} path")
    kernel.set_path(path)
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 254 codes
    k = 17  # 16 by vector loads, the 17th by the tail
    w = torch.zeros(codes.numel(), k, dtype=torch.uint8)
    w[:, 3] = codes
    w[:, 16] = codes
    w8 = w.view(torch.float8_e4m3fn)
    y = kernel.linear(torch.eye(k), w8, torch.ones(codes.numel()))
    assert torch.equal(y, w8.float().t())


def test_strided_rows_and_out(kernel: cpu_fp8.Fp8Kernel) -> None:
    """x rows further apart than K (a slice of a wider buffer) and an `out` view into a wider tensor."""
    kernel.set_path(cpu_fp8.path_for(native.usable_cpu_features()))
    w, scale = _codes(12, 64, seed=3), torch.rand(12)
    wide = torch.randn(5, 100)
    x = wide[:, :64]
    out = torch.full((5, 20), 7.0)
    y = kernel.linear(x, w, scale, out=out[:, 4:16])
    _check(y, x, w, scale, None)
    assert torch.equal(out[:, :4], torch.full((5, 4), 7.0)) and torch.equal(
        out[:, 16:], torch.full((5, 4), 7.0)
    )


def test_the_launcher_refuses_what_the_kernel_cannot_take(kernel: cpu_fp8.Fp8Kernel) -> None:
    w, scale = _codes(4, 32, seed=0), torch.ones(4)
    with pytest.raises(TypeError, match="weight must be float8_e4m3fn"):
        kernel.linear(torch.randn(1, 32), w.view(torch.uint8), scale)
    with pytest.raises(TypeError, match="x must be float32"):
        kernel.linear(torch.randn(1, 32, dtype=torch.bfloat16), w, scale)
    with pytest.raises(ValueError, match=r"x must be \[M, 32\]"):
        kernel.linear(torch.randn(1, 31), w, scale)
    with pytest.raises(ValueError, match="unit stride"):
        kernel.linear(torch.randn(32, 2).t(), w, scale)
    with pytest.raises(ValueError, match=r"scale must be a contiguous float32 \[4\]"):
        kernel.linear(torch.randn(1, 32), w, torch.ones(5))
    with pytest.raises(ValueError, match="out must be float32"):
        kernel.linear(torch.randn(2, 32), w, scale, out=torch.empty(2, 3))


def test_nan_codes_are_refused_at_load() -> None:
    w = _codes(4, 32, seed=1).view(torch.uint8).clone()
    w[2, 5] = 0xFF
    with pytest.raises(ValueError, match="NaN codes"):
        Fp8Linear(w.view(torch.float8_e4m3fn), torch.ones(4), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_serves_decode_batches_through_the_kernel(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to MAX_ROWS rows the layer calls the kernel (fp32 sums: closer to the float64 reference than the
    converted weight's GEMM in the activations' dtype); a prefill-sized batch takes the converted weight."""
    torch.manual_seed(0)
    layer = Fp8Linear.quantize(torch.randn(48, 80) * 0.05, torch.randn(48))
    calls: list[int] = []
    kernel = cpu_fp8.load_fp8_kernel()
    linear = kernel.linear

    def counting(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return linear(x, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_fp8.Fp8Kernel, "linear", lambda self, x, *a, **kw: counting(x, *a, **kw))
    for rows in (1, 5, cpu_fp8.MAX_ROWS, cpu_fp8.MAX_ROWS + 1):
        x = torch.randn(rows, 80).to(dtype)
        y = layer(x)
        assert y.dtype == dtype and y.shape == (rows, 48)
        ref = cpu_fp8.linear_reference(x.float(), layer.weight, layer.scale, layer.bias)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        assert torch.allclose(y.float(), ref, rtol=tol, atol=tol), (rows, (y.float() - ref).abs().max())
    assert calls == [1, 5, cpu_fp8.MAX_ROWS]
    x3 = torch.randn(2, 3, 80)  # [B, T, K]: the rows flattened
    assert torch.allclose(layer(x3), layer(x3.reshape(6, 80)).reshape(2, 3, 48), atol=1e-6)


def test_out_overlapping_an_input_is_refused(kernel: cpu_fp8.Fp8Kernel) -> None:
    """N == K lets `out` be x itself: the kernel's threads would read rows others are writing."""
    w, scale = _codes(32, 32, seed=2), torch.ones(32)
    x = torch.randn(3, 32)
    with pytest.raises(ValueError, match="out must not overlap x"):
        kernel.linear(x, w, scale, out=x)
    buf = torch.randn(3, 64)
    with pytest.raises(ValueError, match="out must not overlap x"):
        kernel.linear(buf[:, :32], w, scale, out=buf[:, 16:48])
    with pytest.raises(ValueError, match="out must not overlap x"):  # interleaved rows: refused too
        kernel.linear(buf[:, :32], w, scale, out=buf[:, 32:])
    _check(kernel.linear(buf[:, :32], w, scale, out=torch.empty(3, 32)), buf[:, :32], w, scale, None)


def test_a_kernel_that_cannot_be_built_is_asked_once_not_per_forward(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    asked: list[object] = []

    def unavailable(cache_dir: object = None) -> None:
        asked.append(cache_dir)

    monkeypatch.setattr(cpu_fp8, "try_load_fp8_kernel", unavailable)
    layer = Fp8Linear.quantize(torch.randn(8, 32), None)
    assert not layer.cpu_kernel and len(asked) == 1
    x = torch.randn(2, 32)
    ref = torch.nn.functional.linear(x, layer.weight.float()) * layer.scale
    for _ in range(3):
        torch.testing.assert_close(layer(x), ref)
    assert len(asked) == 1
    # and the loader itself keeps its failure: a failed build is not retried
    monkeypatch.undo()
    builds: list[int] = []

    def failing(cache_dir: object = None) -> cpu_fp8.Fp8Kernel:
        builds.append(1)
        raise native.KernelBuildError("no compiler")

    monkeypatch.setattr(cpu_fp8, "load_fp8_kernel", failing)
    try:
        assert cpu_fp8.try_load_fp8_kernel(tmp_path) is None  # type: ignore[arg-type]
        assert cpu_fp8.try_load_fp8_kernel(tmp_path) is None  # type: ignore[arg-type]
        assert builds == [1]
    finally:
        cpu_fp8.try_load_fp8_kernel.cache_clear()


def test_other_float8_weights_and_the_previous_path_keep_torch_conversion(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An e5m2 checkpoint's weight (not e4m3 codes) and `cpu_kernel=False` (quant.cpu_repack.previous_cpu_path)
    never reach the kernel."""
    called: list[int] = []
    monkeypatch.setattr(cpu_fp8.Fp8Kernel, "linear", lambda self, x, *a, **kw: called.append(1))
    w = torch.randn(8, 32) * 0.1
    e5m2 = Fp8Linear(w.to(torch.float8_e5m2), torch.ones(8), None)
    previous = Fp8Linear.quantize(w, None, cpu_kernel=False)
    x = torch.randn(2, 32)
    for layer in (e5m2, previous):
        assert not layer.cpu_kernel
        ref = torch.nn.functional.linear(x, layer.weight.float()) * layer.scale
        torch.testing.assert_close(layer(x), ref)
    assert not called
