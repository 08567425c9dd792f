"""The int8-activation decode GEMV (server/quant/csrc/qgemv_q8.cpp) against its torch references, on every
code path this CPU runs, its dispatch by the usable CPU features, its fallback to qlinear, the serving
switch, and greedy decoding of the embedded model against the fp32-activation path.

Tolerances:
- against `linear_reference` (W @ x^ in float64, x^ the activation as Q8 rounds it, bit for bit the
  kernel's own rounding): fp32 accumulation only, |err| <= 1e-5 * (|W| @ |x^|) + 1e-6. The kernel sums
  exact int32 block dots scaled in fp32 over K / 32 <= 48 blocks here: the relative error of such a sum
  is under (K / 32 + 4) * 2^-24 ~ 3e-6;
- against fp32 activations (qlinear's `linear_reference`): each x_k moves by at most half its block's
  step d_b / 2, so |err| <= sum_b (d_b / 2) sum_{k in b} |W[n, k]| (`activation_error_bound`), plus the
  fp32 slack above.
"""

from __future__ import annotations

import ctypes
import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from server import native
from server.cpu_features import CpuFeatures
from server.quant import cpu_qgemv_q8 as q8
from server.quant import cpu_qlinear as cq
from server.quant.block_linear import BlockQuantLinear
from server.quant.cpu_qlinear import BlockQuantWeight, QLinearKernel

sys.path.insert(0, str(Path(__file__).parent))
from test_cpu_qlinear import make_weight


@pytest.fixture(scope="module")
def kernel() -> QLinearKernel:
    return cq.load_qlinear_kernel()


@pytest.fixture()
def fast(kernel: QLinearKernel) -> Iterator[q8.Q8GemvKernel]:
    """The kernel taking both kinds of call (the GEMV and the batched path, any M even where AMX hands
    large batches to oneDNN); restored after each test."""
    k = q8.load_q8_gemv_kernel(kernel)
    k.set_modes(gemv=True, gemm=True)
    yield dataclasses.replace(k, gemm_max_rows=None)
    k.set_path(q8.path_for(native.usable_cpu_features()))
    k.set_modes(q8.default_gemv_enabled(), q8.GEMM_DEFAULT_ENABLED, gemv_fp32=False)  # the defaults again


def _available(fast: q8.Q8GemvKernel) -> list[str]:
    best = q8.PATHS.index(q8.path_for(native.usable_cpu_features()))
    return [p for p in q8.PATHS if q8.PATHS.index(p) <= best]


def _check(y: torch.Tensor, x: torch.Tensor, w: BlockQuantWeight, bias: torch.Tensor | None) -> None:
    ref = q8.linear_reference(x, w, bias)
    xh = q8.dequantize_activations_reference(x).double()
    scale = xh.abs() @ cq.dequantize_reference(w).double().abs().t()
    assert ((y.double() - ref.double()).abs() <= 1e-5 * scale + 1e-6).all()
    fp32 = cq.linear_reference(x.double(), w, bias).double()
    bound = q8.activation_error_bound(x, w)
    assert ((y.double() - fp32).abs() <= bound + 1e-5 * scale + 1e-6).all()


# K: under one 8-block chunk (96), 2 chunks plus 2 leftover blocks (576), SmolLM2's down (1536).
@pytest.mark.parametrize("path", q8.PATHS)
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "q4_k", "int4", "q6_k"])  # q6_k: K in 256s
@pytest.mark.parametrize("n,k", [(37, 96), (13, 576), (9, 1536)])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_int8_gemv_matches_the_references(
    fast: q8.Q8GemvKernel, path: str, fmt: str, n: int, k: int, m: int
) -> None:
    if path not in _available(fast):
        pytest.skip(f"this CPU (or KUBEINFER_CPU_DISABLE) does not allow the {path} path")
    assert fast.set_path(path) == path
    w = make_weight(fmt, n, k, seed=n + k + m)  # q4_k: fp32 scales and mins; int4: group 32, fp32
    x = torch.randn(m, w.in_features) * torch.linspace(0.1, 4.0, w.in_features)  # unequal block scales
    bias = torch.randn(n) if m % 2 else None
    _check(fast.linear(x, w, bias), x, w, bias)


@pytest.mark.parametrize("path", q8.PATHS)
@pytest.mark.parametrize("k", [32, 96, 224, 288])  # blocks: one, 3 (tail only), 7 (4 + 3), 9 (8 + 1)
@pytest.mark.parametrize("m", [1, 3])
def test_8_bit_weights_in_16_value_groups(fast: q8.Q8GemvKernel, path: str, k: int, m: int) -> None:
    """Q6_K's repacked layout (q - 32 as int8, an fp32 scale per 16, no min) at K that leave blocks past
    the 4-block loop, extreme values and an unequal scale per half of every 32-block."""
    if path not in _available(fast):
        pytest.skip(f"this CPU (or KUBEINFER_CPU_DISABLE) does not allow the {path} path")
    assert fast.set_path(path) == path
    g = torch.Generator().manual_seed(k + m)
    n = 11
    q = torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8)
    q[0, :] = -32
    q[1, :] = 31
    scales = torch.rand(n, k // 16, generator=g) * torch.tensor([1e-3, 1.0]).repeat(k // 32)
    w = BlockQuantWeight(q, scales, None, "q6_k", 8, 16, 0, k, n)
    assert fast.supports(w, m)
    x = torch.randn(m, k, generator=g) * torch.linspace(0.1, 4.0, k)
    bias = torch.randn(n, generator=g)
    _check(fast.linear(x, w, bias), x, w, bias)


@pytest.mark.parametrize("path", q8.PATHS)
def test_q8_0_weights_of_minus_128_and_zero_blocks(fast: q8.Q8GemvKernel, path: str) -> None:
    """A GGUF file may hold -128 (ggml's quantizer never writes it): |w| = 128 must still multiply right;
    an all-zero block of x has d = 0 and contributes nothing."""
    if path not in _available(fast):
        pytest.skip(f"this CPU does not allow the {path} path")
    fast.set_path(path)
    w = make_weight("q8_0", 11, 288, seed=3)
    q = w.q.clone()
    q[:, ::3] = -128
    w = BlockQuantWeight(q, w.scales, None, "q8_0", 8, 32, 0, 288, 11)
    x = torch.randn(3, 288) * 3
    x[1, 64:96] = 0.0
    _check(fast.linear(x, w), x, w, None)
    if path == "vnni":  # the batched path: -128 + 128 = 0 as its u8 operand, the zero point 128 undoes it
        xb = torch.randn(9, 288) * 3
        xb[4, 32:64] = 0.0
        _check(fast.linear(xb, w, compute=torch.bfloat16), xb, w, None)


def test_the_paths_agree_with_each_other(fast: q8.Q8GemvKernel) -> None:
    paths = _available(fast)
    w = make_weight("q4_1", 64, 1536, seed=7)
    x = torch.randn(1, 1536)
    outs = {}
    for p in paths:
        fast.set_path(p)
        outs[p] = fast.linear(x, w)
    for p in paths[1:]:
        torch.testing.assert_close(outs[p], outs[paths[0]], rtol=1e-5, atol=1e-5)


def test_path_follows_the_usable_features(
    monkeypatch: pytest.MonkeyPatch, kernel: QLinearKernel, tmp_path: Path
) -> None:
    full = CpuFeatures(
        avx2=True, fma=True, f16c=True, avx512f=True, avx512bw=True, avx512vl=True, avx512_vnni=True
    )
    assert q8.path_for(full) == "vnni"
    assert q8.path_for(CpuFeatures(avx2=True, fma=True, f16c=True)) == "avx2"
    assert q8.path_for(CpuFeatures(avx2=True, fma=True, f16c=True, avx512f=True, avx512_vnni=True)) == "avx2"
    assert q8.path_for(CpuFeatures()) == "scalar"
    here = native.usable_cpu_features()
    if not here.avx512_vnni:
        pytest.skip("this CPU has no usable AVX512-VNNI to turn off")
    # KUBEINFER_CPU_DISABLE=avx512_vnni: a fresh load (its own cache) runs the AVX2 path, and still right.
    monkeypatch.setenv("KUBEINFER_CPU_DISABLE", "avx512_vnni")
    assert q8.path_for(native.usable_cpu_features()) == "avx2"
    off = q8.load_q8_gemv_kernel(kernel, tmp_path)
    assert off.isa == "avx2"
    w = make_weight("q4_1", 24, 576, seed=1)
    x = torch.randn(1, 576)
    _check(off.linear(x, w), x, w, None)
    monkeypatch.setenv("KUBEINFER_CPU_DISABLE", "avx2")
    assert q8.path_for(native.usable_cpu_features()) == "scalar"


def test_launcher_refuses_what_the_kernel_does_not_take(fast: q8.Q8GemvKernel) -> None:
    w = make_weight("q4_1", 8, 64)
    with pytest.raises(ValueError, match=r"1\.\.4 rows"):
        fast.linear(torch.randn(5, 64), w)  # compute fp32: not the batched path
    with pytest.raises(ValueError, match="32-value groups"):
        fast.linear(torch.randn(1, 64), make_weight("int8", 8, 64))  # one group of K
    with pytest.raises(ValueError, match="32-value groups"):  # 4-bit in 16-value groups (Q3_K, Q2_K)
        fast.linear(torch.randn(1, 64), make_weight("int4", 8, 64, group=16))
    with pytest.raises(TypeError):
        fast.linear(torch.randn(1, 64).double(), w)
    with pytest.raises(ValueError, match="x must be"):
        fast.linear(torch.randn(1, 32), w)
    with pytest.raises(ValueError, match="bias"):
        fast.linear(torch.randn(1, 64), w, torch.randn(7))
    with pytest.raises(ValueError, match="out must be"):
        fast.linear(torch.randn(1, 64), w, out=torch.empty(1, 9))


@pytest.mark.parametrize(
    "fmt,m",
    [("q4_1", 1), ("q4_1", 3), ("q4_1", 5), ("q6_k", 1), ("int8", 2), ("int4", 1)],
)
def test_the_entry_point_matches_the_python_choice(
    kernel: QLinearKernel, fast: q8.Q8GemvKernel, fmt: str, m: int
) -> None:
    """kubeinfer_qgemv_q8 (what the decode graph calls) takes what `supports` says and hands the rest
    to qlinear: bit for bit what small_m_linear (BlockQuantLinear's call) returns."""
    w = make_weight(fmt, 20, 256, seed=m, group=64)  # int4 with group 64: not ours
    x = torch.randn(m, w.in_features)
    desc = cq.weight_descriptor(w)
    assert bool(fast.lib.kubeinfer_qgemv_q8_supports(ctypes.byref(desc), m)) == fast.supports(w, m)
    assert fast.supports(w, m) == (fmt in ("q4_1", "q6_k") and m <= 4)
    y = torch.empty(m, 20)
    rc = fast.lib.kubeinfer_qgemv_q8(
        ctypes.byref(desc), x.data_ptr(), m, x.stride(0), None, y.data_ptr(), 20, 2
    )
    assert rc == 0
    want = fast.linear(x, w) if fast.supports(w, m) else kernel.linear(x, w)
    assert torch.equal(y, want)
    with q8.int8_gemv(True):
        assert torch.equal(q8.small_m_linear(kernel, x, w, None), want)


def test_the_switch(monkeypatch: pytest.MonkeyPatch, kernel: QLinearKernel, fast: q8.Q8GemvKernel) -> None:
    monkeypatch.setenv(q8.GEMM_ENABLE_ENV, "0")  # the batched path's own switch: test_the_gemm_switch
    monkeypatch.setenv(q8.ENABLE_ENV, "0")
    assert not q8.int8_gemv_enabled()
    w = make_weight("q4_1", 16, 576, seed=5)
    lin = BlockQuantLinear(w, kernel=kernel)
    x = torch.randn(1, 576)
    assert torch.equal(lin(x), kernel.linear(x, w))
    fp32_address = ctypes.cast(kernel.lib.kubeinfer_qlinear, ctypes.c_void_p).value
    assert q8.decode_qlinear_address(kernel) == fp32_address
    monkeypatch.setenv(q8.ENABLE_ENV, "1")
    assert q8.int8_gemv_enabled()
    assert torch.equal(lin(x), fast.linear(x, w))
    assert q8.decode_qlinear_address(kernel) == fast.entry_address
    with q8.int8_gemv(False):
        assert torch.equal(lin(x), kernel.linear(x, w))
    monkeypatch.delenv(q8.ENABLE_ENV)
    assert q8.int8_gemv_enabled() == q8.default_gemv_enabled()  # unset: the default (next test)
    monkeypatch.setenv(q8.ENABLE_ENV, "yes")
    with pytest.raises(ValueError, match=q8.ENABLE_ENV):
        q8.int8_gemv_enabled()


def test_the_start_log_names_the_int8_paths(
    monkeypatch: pytest.MonkeyPatch, kernel: QLinearKernel, fast: q8.Q8GemvKernel
) -> None:
    monkeypatch.setenv(q8.ENABLE_ENV, "0")
    monkeypatch.setenv(q8.GEMM_ENABLE_ENV, "0")
    assert q8.int8_paths_text() == ""
    monkeypatch.setenv(q8.GEMM_ENABLE_ENV, "1")
    text = q8.int8_paths_text()
    if fast.isa != "vnni":
        assert text == ""
    else:
        limit = q8.load_q8_gemv_kernel(kernel).gemm_max_rows
        assert text.startswith("batches of " + ("5+" if limit is None else f"5-{limit}") + " rows of 4/8-bit")
    monkeypatch.setenv(q8.ENABLE_ENV, "1")
    assert q8.int8_paths_text().endswith(f"every layer's decode rows 1-4 ({q8.ENABLE_ENV}=0 keeps fp32)")


@pytest.mark.parametrize("path", ["scalar", "avx2", "vnni"])
def test_the_gemv_default_follows_the_path_and_the_layer_dtype(
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    kernel: QLinearKernel,
    fast: q8.Q8GemvKernel,
    path: str,
) -> None:
    """KUBEINFER_INT8_GEMV unset: the GEMV takes the decode rows of bf16 and int8 layers where the vnni or
    the avx2 path runs (AVX512-VNNI usable, with or without AMX; or AVX2 with FMA and F16C) and nothing else;
    fp32 layers keep fp32 activations unless the switch says 1 (the Python launchers and the decode graph's
    C entry alike)."""
    monkeypatch.delenv(q8.ENABLE_ENV, raising=False)
    here = native.usable_cpu_features()
    avx2 = path != "scalar"
    monkeypatch.setattr(
        q8,
        "usable_cpu_features",
        lambda *_: dataclasses.replace(
            here,
            avx512_vnni=path == "vnni",
            avx2=avx2,
            fma=avx2,
            f16c=avx2,
            amx_tile=False,
            amx_int8=False,
            amx_bf16=False,
        ),
    )
    q8._gemv_default_for.cache_clear()  # cached per KUBEINFER_CPU_DISABLE value
    request.addfinalizer(q8._gemv_default_for.cache_clear)
    # the 512-bit VNNI path needs AVX512VL/BW too: without them here, the avx2 path's
    if path == "vnni" and q8.path_for(dataclasses.replace(here, avx512_vnni=True)) != "vnni":
        pytest.skip("no AVX512VL/BW here")
    if path == "avx2" and not (here.avx2 and here.fma and here.f16c):
        pytest.skip("no AVX2 here")
    on = path != "scalar"
    assert q8.int8_gemv_enabled() is on
    w = make_weight("q4_1", 24, 576, seed=6)
    x = torch.randn(1, 576)
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        lin = BlockQuantLinear(w, kernel=kernel)
        lin.gemm_dtype = dtype
        int8 = on and dtype != torch.float32
        want = fast.linear(x, w, compute=dtype) if int8 else kernel.linear(x, w, compute=dtype)
        assert torch.equal(lin(x), want)
        q8.active_kernel(kernel)  # the modes the decode graph's entry runs with
        desc = cq.weight_descriptor(w, dtype)
        assert bool(fast.lib.kubeinfer_qgemv_q8_supports(ctypes.byref(desc), 1)) == int8
    monkeypatch.setenv(q8.ENABLE_ENV, "1")  # said explicitly: fp32 layers too
    lin = BlockQuantLinear(w, kernel=kernel)
    assert torch.equal(lin(x), fast.linear(x, w))


def _vnni(fast: q8.Q8GemvKernel) -> None:
    if fast.isa != "vnni":
        pytest.skip("the batched int8 path runs on AVX512-VNNI; this CPU (or KUBEINFER_CPU_DISABLE) has none")


# The batched path: N with a ragged 16-column group (37, 200) and whole groups (64); K of 1 block, 3 blocks
# (the scales' 8-block transpose never runs), 18 (two 8-block pieces and 2 left) and 48; M of one short
# row block (5), whole 8-row blocks (8, 16), blocks plus a rest (9, 23), and more than one 256-row pass (300).
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q4_k", "int4", "q8_0"])
@pytest.mark.parametrize("n,k", [(37, 32), (64, 96), (200, 576), (16, 1536)])
@pytest.mark.parametrize("m", [5, 8, 9, 16, 23, 300])
def test_batched_int8_matches_the_references(fast: q8.Q8GemvKernel, fmt: str, n: int, k: int, m: int) -> None:
    _vnni(fast)
    # q4_0: zero point 8, no mins; q4_1/q4_k/int4: mins; q8_0: s8 values through the u8 operand (+128)
    w = make_weight(fmt, n, k, seed=n + k + m)
    if fmt == "q4_k" and w.in_features != k:
        pytest.skip("q4_k needs whole 256-value super-blocks")
    assert fast.supports(w, m, torch.bfloat16) and not fast.supports(w, m, torch.float32)
    x = torch.randn(m, w.in_features) * torch.linspace(0.1, 4.0, w.in_features)  # unequal block scales
    bias = torch.randn(n) if m % 2 else None
    _check(fast.linear(x, w, bias, compute=torch.bfloat16), x, w, bias)


def test_batched_int8_reads_strided_rows_and_writes_only_its_columns(fast: q8.Q8GemvKernel) -> None:
    _vnni(fast)
    w = make_weight("q4_1", 40, 576, seed=11)
    big = torch.randn(17, 600)
    x = big[:, :576]  # rows 600 apart
    out = torch.full((17, 50), 7.0)
    y = fast.linear(x, w, out=out[:, :40], compute=torch.bfloat16)
    _check(y, x.contiguous(), w, None)
    assert (out[:, 40:] == 7.0).all()  # the ragged group's missing columns are not stored


@pytest.mark.parametrize(
    "fmt,m,compute,takes",
    [
        ("q4_1", 16, torch.bfloat16, True),
        ("q4_1", 16, torch.float32, False),  # fp32 layers keep fp32 activations
        ("q8_0", 16, torch.bfloat16, True),  # 8-bit weights in 32-blocks (the LM head)
        ("q8_0", 16, torch.float32, False),
        ("int8", 16, torch.bfloat16, False),  # one group of K
        ("q4_1", 4, torch.bfloat16, True),  # the GEMV's rows (its own mode)
    ],
)
def test_the_batched_entry_point_takes_what_supports_says(
    kernel: QLinearKernel, fast: q8.Q8GemvKernel, fmt: str, m: int, compute: torch.dtype, takes: bool
) -> None:
    """kubeinfer_qgemv_q8 (the decode graph's call) takes the batched calls `supports` names and hands the
    rest to qlinear (bf16 batched path or fp32), bit for bit what the Python launchers return."""
    _vnni(fast)
    w = make_weight(fmt, 48, 576, seed=m)
    x = torch.randn(m, 576)
    desc = cq.weight_descriptor(w, compute)
    assert fast.supports(w, m, compute) == takes
    assert bool(fast.lib.kubeinfer_qgemv_q8_supports(ctypes.byref(desc), m)) == takes
    y = torch.empty(m, 48)
    rc = fast.lib.kubeinfer_qgemv_q8(ctypes.byref(desc), x.data_ptr(), m, 576, None, y.data_ptr(), 48, 2)
    assert rc == 0
    want = fast.linear(x, w, compute=compute) if takes else kernel.linear(x, w, compute=compute)
    assert torch.equal(y, want)
    fast.set_modes(gemv=True, gemm=False)  # the batched mode off: qlinear serves every batch
    if m > q8.MAX_ROWS:
        assert not fast.supports(w, m, compute)
        rc = fast.lib.kubeinfer_qgemv_q8(ctypes.byref(desc), x.data_ptr(), m, 576, None, y.data_ptr(), 48, 2)
        assert rc == 0 and torch.equal(y, kernel.linear(x, w, compute=compute))


def test_the_gemm_switch(monkeypatch: pytest.MonkeyPatch, kernel: QLinearKernel) -> None:
    """KUBEINFER_INT8_GEMM (default on): a bf16 layer's batches of 5+ rows, prefill-sized ones included,
    take the int8 path; off, the bf16 ones (qlinear's batched path, then dequantize + GEMM)."""
    fast = q8.load_q8_gemv_kernel(kernel)
    _vnni(fast)
    monkeypatch.delenv(q8.ENABLE_ENV, raising=False)
    monkeypatch.delenv(q8.GEMM_ENABLE_ENV, raising=False)
    assert q8.int8_gemm_enabled() == q8.GEMM_DEFAULT_ENABLED is True
    w = make_weight("q4_1", 64, 576, seed=2)
    lin = BlockQuantLinear(w, kernel=kernel)
    lin.gemm_dtype = torch.bfloat16
    for m in (16, 300):
        x = torch.randn(m, 576)
        if m <= (fast.gemm_max_rows or m):  # AMX: 300 rows go to oneDNN (test_amx_...)
            assert lin.int8_kernel(m) is not None and not lin.bf16_gemm(m)
            assert torch.equal(lin(x), fast.linear(x, w, compute=torch.bfloat16))
        monkeypatch.setenv(q8.GEMM_ENABLE_ENV, "0")
        assert lin.int8_kernel(m) is None
        bf16 = lin(x)
        if m < lin.gemm_min_rows:
            assert torch.equal(bf16, kernel.linear(x, w, compute=torch.bfloat16))
        else:
            assert lin.bf16_gemm(m)
            torch.testing.assert_close(
                bf16,
                x.bfloat16().float() @ cq.dequantize_reference(w).bfloat16().float().t(),
                rtol=2e-2,
                atol=2e-2,
            )
        monkeypatch.delenv(q8.GEMM_ENABLE_ENV)
    lin.gemm_dtype = torch.float32  # fp32 layers: never int8 activations for batches
    assert lin.int8_kernel(16) is None
    monkeypatch.setenv(q8.GEMM_ENABLE_ENV, "on")
    with pytest.raises(ValueError, match=q8.GEMM_ENABLE_ENV):
        q8.int8_gemm_enabled()


def test_amx_hands_prefill_sized_batches_to_the_bf16_gemm(
    monkeypatch: pytest.MonkeyPatch, kernel: QLinearKernel, fast: q8.Q8GemvKernel, tmp_path: Path
) -> None:
    """Where AMX-BF16 is usable, batches of AMX_GEMM_MAX_ROWS + 1 = BF16_GEMM_MIN_ROWS rows and more go
    to dequantize + oneDNN's bf16 GEMM (faster there, docs/benchmarks.md), smaller ones stay int8; with no
    AMX (or AMX turned off by KUBEINFER_CPU_DISABLE) the int8 path takes every batch."""
    from server.quant import block_linear

    _vnni(fast)
    amx = CpuFeatures(
        avx512f=True, avx512bw=True, avx512vl=True, avx512_vnni=True, amx_tile=True, amx_bf16=True
    )
    assert q8.gemm_max_rows_for(amx) == q8.AMX_GEMM_MAX_ROWS == block_linear.BF16_GEMM_MIN_ROWS - 1
    assert q8.gemm_max_rows_for(dataclasses.replace(amx, amx_tile=False, amx_bf16=False)) is None
    here = native.usable_cpu_features()
    assert q8.load_q8_gemv_kernel(kernel).gemm_max_rows == q8.gemm_max_rows_for(here)
    monkeypatch.setenv("KUBEINFER_CPU_DISABLE", "amx")
    assert q8.load_q8_gemv_kernel(kernel, tmp_path).gemm_max_rows is None
    monkeypatch.delenv("KUBEINFER_CPU_DISABLE")

    limited = dataclasses.replace(fast, gemm_max_rows=q8.AMX_GEMM_MAX_ROWS)
    monkeypatch.setattr(block_linear, "active_kernel", lambda _kernel: limited)
    w = make_weight("q4_1", 64, 576, seed=3)
    lin = BlockQuantLinear(w, kernel=kernel)
    lin.gemm_dtype = torch.bfloat16
    small, large = q8.AMX_GEMM_MAX_ROWS, q8.AMX_GEMM_MAX_ROWS + 1
    assert lin.int8_kernel(small) is limited and not lin.bf16_gemm(small)
    assert lin.int8_kernel(large) is None and lin.bf16_gemm(large)
    x = torch.randn(large, 576)
    assert torch.equal(lin(x[:small]), fast.linear(x[:small], w, compute=torch.bfloat16))
    with pytest.raises(ValueError, match="up to 255 rows"):
        limited.linear(x, w, compute=torch.bfloat16)
    torch.testing.assert_close(
        lin(x), x.bfloat16().float() @ cq.dequantize_reference(w).bfloat16().float().t(), rtol=2e-2, atol=2e-2
    )


def test_decode_graph_stays_bit_identical_with_int8(tiny_model_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The graph records kubeinfer_qgemv_q8 and the Python path calls small_m_linear: the same kernels,
    the same results, bit for bit (a tiny Q4_1 model, rows joining a step apart: M = 1..3)."""
    from gguf_models import write_tiny_gguf
    from test_decode_graph import _generate

    from server.config import EngineConfig, ModelConfig
    from server.engine import LLMEngine
    from server.models.decode_graph import DecodeGraph

    gguf = write_tiny_gguf(tiny_model_factory("llama", tie=True), tmp_path / "tiny-Q4_1.gguf", "Q4_1")
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(gguf), cache_dir=tmp_path / "cache")))
    with q8.int8_gemv(True):
        want = _generate(engine, graph=False)
        got = _generate(engine, graph=True)
        entry = engine.loaded.model._decode_graph
        assert entry is not None and isinstance(entry[1], DecodeGraph)
        fast = q8.try_load_q8_gemv_kernel(cq.load_qlinear_kernel())
        assert fast is not None and entry[1].model_struct.qlinear == fast.entry_address
    assert got == want
    # The graph replays with the modes it recorded, whatever the switches say now: run() restores them
    # before its C call (the Python path's calls set theirs again after it).
    recorded = entry[1].entry
    assert recorded.q8 is not None and recorded.modes[0]
    restored: list[bool] = []
    real_restore = q8.DecodeEntry.restore

    def spy(self: q8.DecodeEntry) -> None:
        real_restore(self)
        restored.append(self.q8 is not None and self.q8.modes[0])

    with q8.int8_gemv(False), pytest.MonkeyPatch.context() as mp:
        mp.setattr(q8.DecodeEntry, "restore", spy)
        _generate(engine, graph=True)
    assert restored and all(restored)
    with q8.int8_gemv(False):
        engine.loaded.model._decode_graph = None
        fp32 = _generate(engine, graph=True)
    assert fp32[1] != want[1]  # the logprobs: the switch changed the arithmetic


def test_the_decode_entry_restores_the_modes_it_recorded(
    kernel: QLinearKernel, fast: q8.Q8GemvKernel
) -> None:
    with q8.int8_gemv(True), q8.int8_gemm(True):
        entry = q8.decode_entry(kernel)
    assert entry.address == fast.entry_address and entry.modes == (True, True, True)
    w = make_weight("q4_1", 24, 576, seed=8)
    desc = cq.weight_descriptor(w, torch.float32)
    fast.set_modes(False, False, False)
    assert not fast.lib.kubeinfer_qgemv_q8_supports(ctypes.byref(desc), 1)
    entry.restore()
    # the C side's modes are what runs (`fast` may be another Python instance over the same library)
    assert entry.q8 is not None and entry.q8.modes == [True, True, True]
    assert fast.lib.kubeinfer_qgemv_q8_supports(ctypes.byref(desc), 1)
    with q8.int8_gemv(False), q8.int8_gemm(False):
        off = q8.decode_entry(kernel)
    assert off.q8 is None and off.address == ctypes.cast(kernel.lib.kubeinfer_qlinear, ctypes.c_void_p).value
    off.restore()  # nothing to restore: qlinear has no modes


# The bound on greedy decoding (one user, so every decode step is the M = 1 GEMV; the parity prompts):
# the int8 path's tokens equal the fp32 path's up to the first step where the fp32 path's two most
# likely tokens are within GAP_NATS of each other, and on the common prefix the chosen token's logprob
# moves by at most LOGPROB_NATS. Measured here (16 prompts x 24 tokens, 2026-12-01): at most 0.17 nats
# of logprob movement; every divergence came at a top-2 gap of 0.017-0.165 nats. So a flip needs a
# gap under ~2 x 0.17: GAP_NATS and LOGPROB_NATS leave margin above what was seen, not a derived bound.
GAP_NATS = 0.5
LOGPROB_NATS = 0.25
BATCHED_LOGPROB_NATS = 0.4  # test_embedded_model_batched_int8_greedy_stays_within_the_bound_of_bf16


@pytest.mark.slow
def test_embedded_model_int8_greedy_stays_within_the_bound_of_fp32() -> None:
    from server.config import CacheConfig, EngineConfig, ModelConfig
    from server.engine import LLMEngine
    from server.request import SamplingParams

    sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from test_engine_parity import NEW_TOKENS, PROMPTS

    engine = LLMEngine(EngineConfig(model=ModelConfig(), cache=CacheConfig()))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)

    def generate(prompt: list[int], int8: bool) -> tuple[list[int], list[tuple[float, float]]]:
        with q8.int8_gemv(int8):
            engine.loaded.model._decode_graph = None  # records the entry point of the switch's state
            engine.add_request("r", prompt, params)
            tokens, lps = [], []
            while engine.has_unfinished():
                for out in engine.step():
                    tokens += out.new_token_ids
                    lps += [
                        (lp.chosen.logprob, lp.top[0].logprob - lp.top[-1].logprob) for lp in out.new_logprobs
                    ]
        return tokens, lps

    identical = 0
    for text in PROMPTS:
        prompt = engine.tokenizer.encode(text)
        want, want_lps = generate(prompt, int8=False)
        got, got_lps = generate(prompt, int8=True)
        near_tie = next((i for i, (_, gap) in enumerate(want_lps) if gap < GAP_NATS), len(want))
        first = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), len(want))
        assert first >= near_tie, (text, first, near_tie)
        for (a, _), (b, _) in zip(want_lps[:first], got_lps[:first], strict=True):
            assert abs(a - b) <= LOGPROB_NATS, (text, a, b)
        identical += first == len(want)
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    print(f"{identical} of {len(PROMPTS)} prompts identical for {NEW_TOKENS} tokens")


@pytest.mark.slow
def test_embedded_model_batched_int8_greedy_stays_within_the_bound_of_bf16() -> None:
    """The parity prompts together (their prefills and every decode batch of 5+ rows on the batched int8
    path where it runs) against the same with it off (bf16 operands): the GEMV's bound on near-ties, and
    BATCHED_LOGPROB_NATS on the chosen tokens' logprobs (every layer's prompt rows are quantized here, not
    one decode row: measured 2026-12-02 on an AMD EPYC with AVX-512: 5 of 8 prompts identical for 24
    tokens, the divergences at near-ties, logprobs moved by at most 0.218 nats)."""
    from server.config import CacheConfig, EngineConfig, ModelConfig
    from server.engine import LLMEngine
    from server.request import SamplingParams

    sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from test_engine_parity import NEW_TOKENS, PROMPTS

    engine = LLMEngine(EngineConfig(model=ModelConfig(), cache=CacheConfig()))
    fast = q8.try_load_q8_gemv_kernel(cq.load_qlinear_kernel())
    if fast is None or fast.isa != "vnni" or engine.gemm_dtype != torch.bfloat16:
        pytest.skip("the batched int8 path runs where AVX512-VNNI and bf16 GEMMs are both usable")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [engine.tokenizer.encode(text) for text in PROMPTS]

    def generate(int8: bool) -> dict[str, tuple[list[int], list[tuple[float, float]]]]:
        out: dict[str, tuple[list[int], list[tuple[float, float]]]] = {}
        with q8.int8_gemm(int8):
            engine.loaded.model._decode_graph = None  # records the entry point in the switch's state
            q8.active_kernel(cq.load_qlinear_kernel())
            for i, p in enumerate(prompts):
                engine.add_request(str(i), p, params)
            while engine.has_unfinished():
                for o in engine.step():
                    toks, lps = out.setdefault(o.request_id, ([], []))
                    toks += o.new_token_ids
                    lps += [
                        (lp.chosen.logprob, lp.top[0].logprob - lp.top[-1].logprob) for lp in o.new_logprobs
                    ]
        return out

    want, got = generate(int8=False), generate(int8=True)
    identical, moved = 0, 0.0
    for key, (w_toks, w_lps) in want.items():
        g_toks, g_lps = got[key]
        near_tie = next((i for i, (_, gap) in enumerate(w_lps) if gap < GAP_NATS), len(w_toks))
        first = next((i for i, (a, b) in enumerate(zip(w_toks, g_toks, strict=True)) if a != b), len(w_toks))
        assert first >= near_tie, (PROMPTS[int(key)], first, near_tie)
        for (a, _), (b, _) in zip(w_lps[:first], g_lps[:first], strict=True):
            moved = max(moved, abs(a - b))
            assert abs(a - b) <= BATCHED_LOGPROB_NATS, (PROMPTS[int(key)], a, b)
        identical += first == len(w_toks)
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    print(
        f"{identical} of {len(PROMPTS)} prompts identical for {NEW_TOKENS} tokens; logprobs moved <= {moved:.3f}"
    )


# The packed copy (Q8GemvKernel.pack): M read in place (5..64 rows), unpacked per group (65, 300: more
# than 8 row blocks in a 256-row pass, and two passes), ragged and whole column groups, 4- and 8-bit W.
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q4_k", "int4", "q8_0"])
@pytest.mark.parametrize("n,k", [(37, 32), (200, 576), (16, 1536)])
@pytest.mark.parametrize("m", [5, 16, 64, 65, 300])
def test_packed_weights_give_the_same_results_bit_for_bit(
    fast: q8.Q8GemvKernel, fmt: str, n: int, k: int, m: int
) -> None:
    _vnni(fast)
    w = make_weight(fmt, n, k, seed=n + k + m)
    if fmt == "q4_k" and w.in_features != k:
        pytest.skip("q4_k needs whole 256-value super-blocks")
    packed = fast.pack(w)
    assert packed is not w and packed.packed is not None and w.packed is None
    assert packed.packed.numel() == fast.packed_bytes(w) and packed.packed.data_ptr() % 64 == 0
    assert packed.nbytes() == w.nbytes() + fast.packed_bytes(w)
    assert fast.pack(packed) is packed  # packed once
    x = torch.randn(m, w.in_features) * torch.linspace(0.1, 4.0, w.in_features)
    bias = torch.randn(n) if m % 2 else None
    want = fast.linear(x, w, bias, compute=torch.bfloat16)
    _check(want, x, w, bias)
    assert torch.equal(fast.linear(x, packed, bias, compute=torch.bfloat16), want)
    desc = cq.weight_descriptor(packed, torch.bfloat16)  # the decode graph's call reads it too
    assert desc.packed == packed.packed.data_ptr()
    y = torch.empty(m, n)
    rc = fast.lib.kubeinfer_qgemv_q8(
        ctypes.byref(desc),
        x.data_ptr(),
        m,
        x.stride(0),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        n,
        2,
    )
    assert rc == 0 and torch.equal(y, want)


def test_pack_leaves_what_the_batched_path_cannot_take(kernel: QLinearKernel, fast: q8.Q8GemvKernel) -> None:
    """No copy for weights the batched path never reads (one group of K) or on a CPU path other than vnni;
    a packed weight's other calls (the GEMV, qlinear's fallback) read the GGUF layout as before."""
    _vnni(fast)
    w = make_weight("int8", 48, 576)
    assert fast.packed_bytes(w) == 0 and fast.pack(w) is w
    w = make_weight("q4_1", 48, 576, seed=3)
    packed = fast.pack(w)
    x = torch.randn(3, 576)
    assert torch.equal(fast.linear(x, packed), fast.linear(x, w))  # the GEMV
    assert torch.equal(
        kernel.linear(x, packed, compute=torch.bfloat16), kernel.linear(x, w, compute=torch.bfloat16)
    )
    assert fast.set_path("avx2") == "avx2"
    assert fast.packed_bytes(w) == 0 and fast.pack(w) is w


def test_a_module_packs_once_and_drops_the_copy_with_its_buffers(kernel: QLinearKernel) -> None:
    """BlockQuantLinear.pack_int8: the copy goes with the registered buffers it was made from; replaced
    buffers (load_state_dict(assign=True), as the loader does) run unpacked, never a stale copy."""
    fast = q8.load_q8_gemv_kernel(kernel)
    _vnni(fast)
    w = make_weight("q4_1", 48, 576, seed=5)
    lin = BlockQuantLinear(w, kernel=kernel)
    lin.gemm_dtype = torch.bfloat16
    added = lin.pack_int8(fast)
    assert added == fast.packed_bytes(w) and lin.weight_q.packed is not None
    assert lin.pack_int8(fast) == 0 and lin.weight_nbytes() == w.nbytes() + added
    other = make_weight("q4_1", 48, 576, seed=6)
    lin.load_state_dict({"q": other.q, "scales": other.scales, "mins": other.mins}, strict=False, assign=True)
    assert lin.weight_q.packed is None
    x = torch.randn(16, 576)
    with q8.int8_gemm(True):
        assert torch.equal(lin(x), fast.linear(x, other, compute=torch.bfloat16))
