"""The compiled fused layer ops (server/models/cpu_fused.py): each against its plain-torch reference and
the model's own torch path, their argument checks, and the model running them once prepared for serving."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from server.models.cpu_fused import (
    FusedOps,
    load_fused_ops,
    torch_add_rms_norm,
    torch_add_rms_norm_bf16,
    torch_gelu_tanh_mul,
    torch_head_rms_norm,
    torch_residual_norm,
    torch_rotary,
    torch_silu_mul,
)
from server.models.llama import RMSNorm, apply_rotary

# fp32 ops over a few hundred values: only summation order and exp's last bits differ.
TOL = {"atol": 2e-5, "rtol": 2e-5}


@pytest.fixture(scope="module")
def ops() -> FusedOps:
    return load_fused_ops()


@pytest.mark.parametrize("rows", [1, 3, 130])  # decode, a few rows, prefill-sized (the threaded path)
@pytest.mark.parametrize("dim", [8, 576, 1001])  # 1001: not a multiple of any vector width
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_reference_and_the_models_norm(
    ops: FusedOps, rows: int, dim: int, with_delta: bool
) -> None:
    g = torch.Generator().manual_seed(rows * dim)
    x = torch.randn(rows, dim, generator=g) * 3
    delta = torch.randn(rows, dim, generator=g) if with_delta else None
    norm = RMSNorm(dim, 1e-5)
    norm.weight.data = torch.randn(dim, generator=g)
    x_ref = x.clone()
    want = torch_add_rms_norm(x_ref, delta, norm.weight.detach(), 1e-5)
    got = ops.add_rms_norm(x, delta, norm.weight.detach(), 1e-5)
    torch.testing.assert_close(x, x_ref, atol=0, rtol=0)  # the residual add is one fp32 add per value
    torch.testing.assert_close(got, want, **TOL)
    with torch.no_grad():
        torch.testing.assert_close(got, norm(x_ref), **TOL)


@pytest.mark.parametrize("rows", [1, 130])  # one thread, the threaded path
@pytest.mark.parametrize("dim", [576, 1001])
@pytest.mark.parametrize("delta_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_mixed_dtypes_are_the_fp32_kernel_widened_and_rounded(
    ops: FusedOps, rows: int, dim: int, delta_dtype: torch.dtype | None, out_dtype: torch.dtype
) -> None:
    # Around a bf16 GEMM (server/models/llama.py's _forward_fused) a bf16 delta goes in and a bf16 operand
    # comes out: bit-identical to widening the delta, the fp32 kernel, and rounding its out.
    g = torch.Generator().manual_seed(rows + dim)
    x = torch.randn(rows, dim, generator=g) * 3
    delta = None if delta_dtype is None else torch.randn(rows, dim, generator=g).to(delta_dtype)
    w = torch.randn(dim, generator=g)
    x_ref = x.clone()
    want = ops.add_rms_norm(x_ref, None if delta is None else delta.float(), w, 1e-5).to(out_dtype)
    got = ops.add_rms_norm(x, delta, w, 1e-5, out_dtype=out_dtype)
    assert got.dtype == out_dtype
    assert torch.equal(x, x_ref) and torch.equal(got, want)
    out = torch.full((rows, dim + 5), float("nan"), dtype=out_dtype)[:, 2 : dim + 2]  # a strided out
    x2 = x_ref.clone()
    ops.add_rms_norm(x2, delta, w, 1e-5, out=out, out_dtype=out_dtype)
    want2 = ops.add_rms_norm(x_ref, None if delta is None else delta.float(), w, 1e-5).to(out_dtype)
    assert torch.equal(out, want2)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:  # the most bf16 steps apart two same-signed tensors are
    return int((a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max())


@pytest.mark.parametrize("rows", [1, 130])  # one thread, the threaded path
@pytest.mark.parametrize("dim", [8, 576, 1001])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_over_a_bf16_stream(ops: FusedOps, rows: int, dim: int, with_delta: bool) -> None:
    # A bf16 model's stream (llama.py's _forward_fused): x becomes the rounded x + delta; the norm is the
    # fp32 kernel's arithmetic on that widened x, rounded once (torch's RMSNorm rounds twice: one ulp).
    g = torch.Generator().manual_seed(rows * dim + 7)
    x = (torch.randn(rows, dim, generator=g) * 3).bfloat16()
    delta = torch.randn(rows, dim, generator=g).bfloat16() if with_delta else None
    norm = RMSNorm(dim, 1e-5).bfloat16()
    norm.weight.data = torch.randn(dim, generator=g).bfloat16()
    w = norm.applied_weight()
    assert w.dtype == torch.float32 and torch.equal(w, norm.weight.float())
    x_ref = x.clone()
    want = torch_add_rms_norm_bf16(x_ref, delta, w, 1e-5)
    got = ops.add_rms_norm(x, delta, w, 1e-5, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(x, x_ref)  # one rounded add per value
    assert torch.equal(got, ops.add_rms_norm(x_ref.float(), None, w, 1e-5).bfloat16())
    assert _ulps(got, want) <= 1  # fp32 sums in another order, then one rounding
    with torch.no_grad():
        assert _ulps(got, norm(x_ref)) <= 1
    out = torch.full((rows, dim + 5), float("nan"), dtype=torch.bfloat16)[:, 2 : dim + 2]  # a strided out
    x2 = x_ref.clone()
    ops.add_rms_norm(x2, None, w, 1e-5, out=out, out_dtype=torch.bfloat16)
    assert torch.equal(out, got) and torch.equal(x2, x_ref)


@pytest.mark.parametrize("rows", [1, 200])
@pytest.mark.parametrize("heads,d,r", [(12, 64, 64), (6, 16, 12), (3, 128, 64)])
def test_rotary_and_head_norm_over_a_bf16_stream(
    ops: FusedOps, rows: int, heads: int, d: int, r: int
) -> None:
    # In place on a bf16 projection output: the fp32 kernels' arithmetic on widened values, rounded once.
    g = torch.Generator().manual_seed(rows + heads * d + r)
    qkv = (torch.randn(rows, (heads + 2) * d, generator=g) * 2).bfloat16()
    x = qkv[:, : heads * d].view(rows, heads, d)  # a view into the fused projection's output
    angles = torch.randn(rows, r // 2, generator=g) * 10
    cos = torch.cat([angles.cos(), angles.cos()], -1).bfloat16().float()  # the stream's rounded tables
    sin = torch.cat([-angles.sin(), angles.sin()], -1).bfloat16().float()
    before = qkv.clone()
    wide = x.float()
    ops.rotary(wide, cos, sin)
    ref = x.clone()
    torch_rotary(ref, cos, sin)
    ops.rotary(x, cos, sin)
    assert torch.equal(x, wide.bfloat16()) and _ulps(x, ref) <= 1
    assert torch.equal(x[..., r:], before[:, : heads * d].view(rows, heads, d)[..., r:])
    assert torch.equal(qkv[:, heads * d :], before[:, heads * d :])  # the heads past x untouched
    w = torch.randn(d, generator=g)
    wide = x.float()
    ops.head_rms_norm(wide, w, 1e-6)
    ref = x.clone()
    torch_head_rms_norm(ref, w, 1e-6)
    ops.head_rms_norm(x, w, 1e-6)
    assert torch.equal(x, wide.bfloat16()) and _ulps(x, ref) <= 1
    assert torch.equal(qkv[:, heads * d :], before[:, heads * d :])


@pytest.mark.parametrize("rows", [1, 3, 64])  # 64 x 128,256: the threaded path
@pytest.mark.parametrize("cols", [1, 5, 16, 37, 1000, 128256])  # under, at and past the 16 lanes
def test_argmax_rows_is_torchs_argmax(ops: FusedOps, rows: int, cols: int) -> None:
    g = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols + 3, generator=g)[:, :cols]  # a row stride past the row
    assert torch.equal(ops.argmax_rows(x), x.argmax(-1))
    # ties (the first of equal maxima, also across lanes), +-0, infinities and NaNs as torch orders them
    x = torch.randint(-3, 3, (rows, cols), generator=g).float()
    assert torch.equal(ops.argmax_rows(x), x.argmax(-1))
    special = [float("-inf"), float("inf"), float("nan"), -0.0, 0.0, -float("nan")]
    for row in range(rows):
        for v in special[: min(cols, len(special))]:
            x[row, int(torch.randint(cols, (1,), generator=g))] = v
    assert torch.equal(ops.argmax_rows(x), x.argmax(-1))
    for fill in (float("-inf"), -0.0, 0.0, float("nan")):
        x = torch.full((rows, cols), fill)
        x[:, cols // 2] = 0.0 if fill == -0.0 else x[:, cols // 2]  # +0 after -0: the first -0 wins
        assert torch.equal(ops.argmax_rows(x), x.argmax(-1)), fill
    with pytest.raises(ValueError, match="V > 0"):
        ops.argmax_rows(torch.empty(2, 0))
    with pytest.raises(TypeError, match="fp32"):
        ops.argmax_rows(x.bfloat16())


def test_add_rms_norm_strided_rows_and_out(ops: FusedOps) -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 64, generator=g)
    x = base[:, :32]  # row stride 64
    delta = torch.randn(4, 96, generator=g)[:, 10:42]
    w = torch.randn(32, generator=g)
    out = torch.full((4, 48), float("nan"))[:, :32]
    x_ref = x.clone()
    want = torch_add_rms_norm(x_ref, delta, w, 1e-6)
    ops.add_rms_norm(x, delta, w, 1e-6, out=out)
    torch.testing.assert_close(out, want, **TOL)
    torch.testing.assert_close(base[:, :32], x_ref, atol=0, rtol=0)
    assert not base[:, 32:].isnan().any()


@pytest.mark.parametrize("rows", [1, 5, 200])
@pytest.mark.parametrize("heads,d", [(1, 2), (12, 64), (5, 128)])
def test_rotary_matches_reference_and_apply_rotary(ops: FusedOps, rows: int, heads: int, d: int) -> None:
    g = torch.Generator().manual_seed(rows + heads * d)
    x = torch.randn(rows, heads, d, generator=g)
    angles = torch.randn(rows, d // 2, generator=g) * 10
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([-angles.sin(), angles.sin()], -1)
    want = apply_rotary(x, cos[:, None], sin[:, None])
    ref = x.clone()
    torch_rotary(ref, cos, sin)
    torch.testing.assert_close(ref, want, atol=0, rtol=0)
    ops.rotary(x, cos, sin)
    torch.testing.assert_close(x, want, **TOL)


def test_rotary_on_a_view_into_qkv_leaves_v_alone(ops: FusedOps) -> None:
    g = torch.Generator().manual_seed(1)
    t, hq, hkv, d = 3, 4, 2, 16
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    before = qkv.clone()
    angles = torch.randn(t, d // 2, generator=g)
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([-angles.sin(), angles.sin()], -1)
    ops.rotary(qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d), cos, sin)
    want = apply_rotary(before[:, : (hq + hkv) * d].view(t, hq + hkv, d), cos[:, None], sin[:, None])
    torch.testing.assert_close(qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d), want, **TOL)
    torch.testing.assert_close(qkv[:, (hq + hkv) * d :], before[:, (hq + hkv) * d :], atol=0, rtol=0)


@pytest.mark.parametrize("rows", [1, 3, 300])  # 300: the threaded path
@pytest.mark.parametrize("heads,d", [(1, 8), (16, 128), (3, 37)])
def test_head_rms_norm_matches_reference_and_the_models_norm(
    ops: FusedOps, rows: int, heads: int, d: int
) -> None:
    g = torch.Generator().manual_seed(rows * heads + d)
    x = torch.randn(rows, heads, d, generator=g) * 3
    norm = RMSNorm(d, 1e-6)
    norm.weight.data = torch.randn(d, generator=g)
    with torch.no_grad():
        want = norm(x)  # per head, over D (Qwen3's q_norm / k_norm)
    ref = x.clone()
    torch_head_rms_norm(ref, norm.weight.detach(), 1e-6)
    torch.testing.assert_close(ref, want, **TOL)
    ops.head_rms_norm(x, norm.weight.detach(), 1e-6)
    torch.testing.assert_close(x, want, **TOL)


def test_head_rms_norm_on_a_view_into_qkv_touches_its_heads_only(ops: FusedOps) -> None:
    g = torch.Generator().manual_seed(2)
    t, hq, hkv, d = 3, 4, 2, 16
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    before = qkv.clone()
    w = torch.randn(d, generator=g)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)  # row stride (hq + 2 hkv) d
    ops.head_rms_norm(k, w, 1e-6)
    want = before[:, hq * d : (hq + hkv) * d].view(t, hkv, d).clone()
    torch_head_rms_norm(want, w, 1e-6)
    torch.testing.assert_close(k, want, **TOL)
    untouched = torch.cat((qkv[:, : hq * d], qkv[:, (hq + hkv) * d :]), dim=1)
    torch.testing.assert_close(untouched, torch.cat((before[:, : hq * d], before[:, (hq + hkv) * d :]), 1))
    with pytest.raises(ValueError, match="dense"):
        ops.head_rms_norm(torch.randn(1, 4, 8).transpose(1, 2), torch.randn(4), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        ops.head_rms_norm(torch.randn(1, 2, 8), torch.randn(7), 1e-6)
    with pytest.raises(TypeError, match="fp32"):
        ops.head_rms_norm(torch.randn(1, 2, 8).double(), torch.randn(8), 1e-6)


@pytest.mark.parametrize("rows", [1, 4, 100])
@pytest.mark.parametrize("inter", [1, 37, 1536])
def test_silu_mul_matches_reference(ops: FusedOps, rows: int, inter: int) -> None:
    g = torch.Generator().manual_seed(rows * inter)
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 4
    gate_up[0, 0] = -100.0  # exp overflows in the denominator: silu -> -0, not NaN
    gate_up[-1, min(1, inter - 1)] = 100.0
    want = torch_silu_mul(gate_up)
    gate, up = gate_up.chunk(2, -1)
    torch.testing.assert_close(want, F.silu(gate).mul_(up), atol=0, rtol=0)
    got = ops.silu_mul(gate_up)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("rows", [1, 4, 100])
@pytest.mark.parametrize("inter", [1, 37, 1536, 2500])  # 2500: more than one of the kernel's chunks
def test_silu_mul_bf16_is_the_fp32_kernel_rounded(ops: FusedOps, rows: int, inter: int) -> None:
    # The bf16 GEMM's result goes straight into silu_mul (server/models/llama.py's MLP): bit-identical to
    # widening it, the fp32 kernel, and rounding for the down projection, as before.
    g = torch.Generator().manual_seed(rows * inter + 1)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).bfloat16()
    gate_up[0, 0] = -100.0
    gate_up[-1, min(1, inter - 1)] = 100.0
    gate_up[-1, -1] = float("nan")
    want = ops.silu_mul(gate_up.float()).bfloat16()
    got = ops.silu_mul(gate_up)
    assert got.dtype == torch.bfloat16
    assert got[-1, -1].isnan()  # a NaN stays a NaN (its payload is -ffast-math's business)
    got[-1, -1] = want[-1, -1] = 0
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    torch.testing.assert_close(got[:, :-1], torch_silu_mul(gate_up)[:, :-1], atol=1e-30, rtol=1.6e-2)
    out = torch.empty(rows, inter + 3, dtype=torch.bfloat16)[:, :inter]  # a strided out
    ops.silu_mul(gate_up, out=out)
    out[-1, -1] = 0
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("rows", [1, 200])
@pytest.mark.parametrize("heads,d,r", [(6, 16, 12), (3, 128, 64), (2, 96, 2)])  # Phi-3's partial rotary
def test_partial_rotary_matches_apply_rotary_and_leaves_the_tail(
    ops: FusedOps, rows: int, heads: int, d: int, r: int
) -> None:
    g = torch.Generator().manual_seed(rows + heads * d + r)
    x = torch.randn(rows, heads, d, generator=g)
    angles = torch.randn(rows, r // 2, generator=g) * 10
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([-angles.sin(), angles.sin()], -1)
    want = apply_rotary(x, cos[:, None], sin[:, None])
    ref = x.clone()
    torch_rotary(ref, cos, sin)
    torch.testing.assert_close(ref, want, atol=0, rtol=0)
    tail = x[..., r:].clone()
    ops.rotary(x, cos, sin)
    torch.testing.assert_close(x, want, **TOL)
    assert torch.equal(x[..., r:], tail)  # the channels past R are not touched


@pytest.mark.parametrize("rows", [1, 130])
@pytest.mark.parametrize("post", [False, True])  # OLMo 2 / Gemma 2-3's post-norm on the sub-block output
@pytest.mark.parametrize("mult", [1.0, 0.22])  # Granite's residual multiplier
@pytest.mark.parametrize("with_next", [False, True])  # no next norm: OLMo 2's sub-blocks read x itself
def test_residual_norm_matches_reference(
    ops: FusedOps, rows: int, post: bool, mult: float, with_next: bool
) -> None:
    dim = 576
    g = torch.Generator().manual_seed(rows + int(post) + int(mult * 100) + int(with_next))
    x = torch.randn(rows, dim, generator=g) * 3
    delta = torch.randn(rows, dim, generator=g)
    post_w = (torch.randn(dim, generator=g), 1e-6) if post else None
    next_w = (torch.randn(dim, generator=g), 1e-5) if with_next else None
    x_ref, d_ref = x.clone(), delta.clone()
    want = torch_residual_norm(x_ref, d_ref, post_w, mult, next_w)
    got = ops.residual_norm(x, delta, post_w, mult, next_w)
    torch.testing.assert_close(x, x_ref, **TOL)
    if with_next:
        assert got is not None and want is not None
        torch.testing.assert_close(got, want, **TOL)
    else:
        assert got is None
    if not post and mult == 1.0 and with_next:
        # the Llama layer's step: add_rms_norm's very row loop, bit for bit
        x3 = torch.randn(rows, dim, generator=g)
        x4 = x3.clone()
        a = ops.residual_norm(x3, delta.clone(), None, 1.0, next_w)
        assert next_w is not None
        b = ops.add_rms_norm(x4, delta.clone(), next_w[0], next_w[1])
        assert a is not None and torch.equal(a, b) and torch.equal(x3, x4)


@pytest.mark.parametrize("rows", [1, 130])
@pytest.mark.parametrize("post", [False, True])
@pytest.mark.parametrize("mult", [1.0, 0.22])
@pytest.mark.parametrize("with_next", [False, True])
def test_residual_norm_over_a_bf16_stream(
    ops: FusedOps, rows: int, post: bool, mult: float, with_next: bool
) -> None:
    # A bf16 model of any placement (llama.py's _forward_fused, narrow): the post-normed delta, x and out
    # each rounded once from the fp32 row functions' values on the widened stream.
    dim = 576
    g = torch.Generator().manual_seed(rows + int(post) + int(mult * 100) + int(with_next) + 5)
    x = (torch.randn(rows, dim, generator=g) * 3).bfloat16()
    delta = torch.randn(rows, dim, generator=g).bfloat16()
    post_w = (torch.randn(dim, generator=g), 1e-6) if post else None
    next_w = (torch.randn(dim, generator=g), 1e-5) if with_next else None
    x_ref, d_ref = x.clone(), delta.clone()
    want = torch_residual_norm(x_ref, d_ref, post_w, mult, next_w)
    x_wide, d_wide = x.float(), delta.float()
    if post_w is not None:  # the fp32 kernel's post-norm, rounded: the delta the add reads
        d_wide = ops.add_rms_norm(d_wide, None, *post_w).bfloat16().float()
    got = ops.residual_norm(x, delta, post_w, mult, next_w)
    assert torch.equal(delta, d_wide.bfloat16())  # the post-normed delta, in place
    assert _ulps(delta, d_ref) <= 1
    assert torch.equal(x, (x_wide + mult * d_wide).bfloat16()) and _ulps(x, x_ref) <= 1
    if next_w is None:
        assert got is None and want is None
        return
    assert got is not None and want is not None and got.dtype == torch.bfloat16
    assert torch.equal(got, ops.add_rms_norm(x.float(), None, *next_w).bfloat16())
    assert _ulps(got, torch_add_rms_norm(x.float(), None, *next_w).bfloat16()) <= 1


@pytest.mark.parametrize("rows", [1, 100])
@pytest.mark.parametrize("inter", [1, 37, 2500])
def test_gelu_tanh_mul_matches_reference_and_bf16_is_it_rounded(ops: FusedOps, rows: int, inter: int) -> None:
    g = torch.Generator().manual_seed(rows * inter + 7)
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 4
    gate_up[0, 0] = -100.0  # the exp's argument clamped: gelu -> -0, not NaN
    gate_up[-1, min(1, inter - 1)] = 100.0
    want = torch_gelu_tanh_mul(gate_up)
    got = ops.act_mul(gate_up, "gelu_tanh")
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, **TOL)
    b = gate_up.bfloat16()
    assert torch.equal(
        ops.act_mul(b, "gelu_tanh").view(torch.int16),
        ops.act_mul(b.float(), "gelu_tanh").bfloat16().view(torch.int16),
    )
    with pytest.raises(ValueError, match="activation"):
        ops.act_mul(gate_up, "relu")


def test_launchers_refuse_what_would_read_stray_memory(ops: FusedOps) -> None:
    x, w = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(TypeError, match="fp32"):
        ops.add_rms_norm(x.double(), None, w, 1e-5)
    with pytest.raises(ValueError, match="weight"):
        ops.add_rms_norm(x, None, torch.randn(7), 1e-5)
    with pytest.raises(ValueError, match="delta"):
        ops.add_rms_norm(x, torch.randn(3, 8), w, 1e-5)
    with pytest.raises(ValueError, match="unit stride"):
        ops.add_rms_norm(torch.randn(8, 2).t(), None, w, 1e-5)
    with pytest.raises(ValueError, match="out"):
        ops.add_rms_norm(x, None, w, 1e-5, out=torch.empty(2, 9))
    with pytest.raises(ValueError, match="out: 1 rows"):
        ops.add_rms_norm(x, None, w, 1e-5, out=torch.empty(1, 8))
    with pytest.raises(TypeError, match="bf16"):  # out must be in out_dtype
        ops.add_rms_norm(x, None, w, 1e-5, out=torch.empty(2, 8), out_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="out_dtype"):
        ops.add_rms_norm(x, None, w, 1e-5, out_dtype=torch.float16)
    with pytest.raises(TypeError, match="fp32"):  # fp32 or bf16 deltas only
        ops.add_rms_norm(x, torch.randn(2, 8, dtype=torch.float16), w, 1e-5)
    with pytest.raises(ValueError, match="out: 1 rows"):
        ops.silu_mul(torch.randn(2, 8), out=torch.empty(1, 4))
    with pytest.raises(ValueError, match="even"):
        ops.rotary(torch.randn(1, 2, 3), torch.randn(1, 3), torch.randn(1, 3))
    with pytest.raises(ValueError, match="dense"):
        ops.rotary(torch.randn(1, 4, 8).transpose(1, 2), torch.randn(1, 4), torch.randn(1, 4))
    with pytest.raises(ValueError, match="cos"):
        ops.rotary(torch.randn(2, 1, 4), torch.randn(1, 4), torch.randn(2, 4))
    with pytest.raises(ValueError, match="not even"):
        ops.silu_mul(torch.randn(2, 5))
    with pytest.raises(TypeError, match="fp32"):
        ops.silu_mul(torch.randn(2, 4, dtype=torch.float16))
    with pytest.raises(TypeError, match="bf16"):  # bf16 in, bf16 out
        ops.silu_mul(torch.randn(2, 8, dtype=torch.bfloat16), out=torch.empty(2, 4))
    with pytest.raises(ValueError, match="unit stride"):
        ops.silu_mul(torch.randn(8, 2, dtype=torch.bfloat16).t())
    xb = x.bfloat16()
    with pytest.raises(TypeError, match="bf16"):  # a bf16 stream adds a bf16 delta
        ops.add_rms_norm(xb, torch.randn(2, 8), w, 1e-5, out_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="out_dtype"):  # and its norm is bf16
        ops.add_rms_norm(xb, None, w, 1e-5)
    with pytest.raises(ValueError, match="weight"):  # fp32 weights, as applied_weight gives them
        ops.add_rms_norm(xb, None, w.bfloat16(), 1e-5, out_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="fp32 or bf16"):
        ops.rotary(torch.randn(1, 2, 4, dtype=torch.float16), torch.randn(1, 4), torch.randn(1, 4))
    with pytest.raises(TypeError, match="fp32 or bf16"):
        ops.head_rms_norm(torch.randn(1, 2, 4, dtype=torch.float16), torch.randn(4), 1e-6)
