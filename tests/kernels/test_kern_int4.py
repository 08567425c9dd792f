"""int4_gemm on AWQ and (repacked) GPTQ checkpoints, and the packing helpers against the formats."""

from __future__ import annotations

import pytest
import torch
from kubeinfer_kernels import int4_gemm
from kubeinfer_kernels.reference import AWQ_ORDER as AWQ
from kubeinfer_kernels.reference import (
    AwqWeights,
    dequantize_awq,
    dequantize_gptq,
    dequantize_int4,
    gptq_to_awq,
    int4_gemm_ref,
    pack_awq,
    pack_cols,
    pack_gptq,
    pack_rows,
    quantize_int4,
    unpack_cols,
    unpack_rows,
)

K_DIM, N_DIM = 256, 96  # N not a multiple of the 64-wide N tile
# Relative to the largest output: one output rounding plus, on GPUs, the dequantized weight rounded to
# the activation dtype before the tensor-core dot.
GEMM_TOL: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _as_int32(word: int) -> int:
    return word - 2**32 if word >= 2**31 else word


def test_awq_packing_follows_the_awq_nibble_order() -> None:
    # Columns 0..7 hold 1..8; AWQ puts column [0,2,4,6,1,3,5,7][j] in nibble j: 1,3,5,7,2,4,6,8.
    values = torch.arange(1, 9, dtype=torch.int32)[None, :]
    assert pack_cols(values, AWQ).item() == _as_int32(0x86427531)
    assert torch.equal(unpack_cols(torch.tensor([[_as_int32(0x86427531)]], dtype=torch.int32), AWQ), values)


def test_gptq_packing_is_natural_order_along_k() -> None:
    values = torch.arange(1, 9, dtype=torch.int32)[:, None]  # rows k = 0..7 of one column
    assert pack_rows(values).item() == _as_int32(0x87654321)
    assert torch.equal(unpack_rows(pack_rows(values)), values)


def test_pack_unpack_round_trip() -> None:
    values = torch.randint(0, 16, (16, 24), dtype=torch.int32)
    assert torch.equal(unpack_cols(pack_cols(values, AWQ), AWQ), values)
    assert torch.equal(unpack_cols(pack_cols(values)), values)
    assert torch.equal(unpack_rows(pack_rows(values)), values)


@pytest.mark.parametrize("group_size", [32, 128])
def test_awq_and_gptq_dequantize_to_the_same_weight(group_size: int) -> None:
    w = torch.randn(K_DIM, N_DIM)
    quant = quantize_int4(w, group_size)
    assert int(quant.zeros.min()) >= 1  # GPTQ v1 cannot represent a zero of 0
    expected = dequantize_int4(quant)
    awq = pack_awq(quant)
    gptq = pack_gptq(quant)
    assert gptq.qweight.shape == (K_DIM // 8, N_DIM) and awq.qweight.shape == (K_DIM, N_DIM // 8)
    # GPTQ v1 stores zero - 1.
    assert torch.equal(unpack_cols(gptq.qzeros), quant.zeros - 1)
    torch.testing.assert_close(dequantize_awq(awq.qweight, awq.qzeros, awq.scales, group_size), expected)
    torch.testing.assert_close(dequantize_gptq(gptq.qweight, gptq.qzeros, gptq.scales, gptq.g_idx), expected)
    repacked = gptq_to_awq(gptq.qweight, gptq.qzeros, gptq.scales, gptq.g_idx, group_size)
    assert repacked.g_idx is None  # trivial g_idx dropped
    assert torch.equal(repacked.qweight, awq.qweight) and torch.equal(repacked.qzeros, awq.qzeros)
    # Half a step from rounding, plus up to half a step where the rounded zero pushes a group's extreme
    # past the 0..15 clamp.
    step = quant.scales.float()[quant.g_idx.long()]
    assert ((expected - w).abs() <= step + 1e-6).all()


def _weights(layout: str, group_size: int) -> AwqWeights:
    w = torch.randn(K_DIM, N_DIM) * 0.1
    if layout == "gptq-act-order":
        # desc_act: channels are grouped in order of importance, so groups are scattered over K.
        g_idx = (torch.randperm(K_DIM) // group_size).to(torch.int32)
    else:
        g_idx = None
    quant = quantize_int4(w, group_size, g_idx)
    if layout == "awq":
        return pack_awq(quant)
    gptq = pack_gptq(quant)
    return gptq_to_awq(gptq.qweight, gptq.qzeros, gptq.scales, gptq.g_idx, group_size)


@pytest.mark.parametrize("layout", ["awq", "gptq", "gptq-act-order"])
@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_gemm_matches_reference(group_size: int, m: int, layout: str, device: torch.device) -> None:
    weights = _weights(layout, group_size)
    assert (weights.g_idx is not None) == (layout == "gptq-act-order")
    x = torch.randn(m, K_DIM, dtype=torch.float16)
    args = [
        t.to(device) if t is not None else None for t in (weights.qweight, weights.qzeros, weights.scales)
    ]
    g_idx = None if weights.g_idx is None else weights.g_idx.to(device)
    out = int4_gemm(x.to(device), args[0], args[1], args[2], group_size, g_idx)
    ref = int4_gemm_ref(x.to(device), args[0], args[1], args[2], group_size, g_idx)
    assert out.shape == (m, N_DIM) and out.dtype == torch.float16
    tol = GEMM_TOL[torch.float16]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol * ref.float().abs().max().item(), rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_int4_gemm_other_activation_dtypes(dtype: torch.dtype, device: torch.device) -> None:
    weights = _weights("gptq-act-order", 64)
    assert weights.g_idx is not None
    x = torch.randn(5, K_DIM).to(dtype).to(device)
    tensors = (weights.qweight.to(device), weights.qzeros.to(device), weights.scales.to(device))
    out = int4_gemm(x, *tensors, 64, weights.g_idx.to(device))
    ref = int4_gemm_ref(x, *tensors, 64, weights.g_idx.to(device))
    tol = GEMM_TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol * ref.float().abs().max().item(), rtol=tol)


def test_int4_gemm_rejects_bad_arguments(device: torch.device) -> None:
    weights = _weights("awq", 32)
    qw, qz, sc = (t.to(device) for t in (weights.qweight, weights.qzeros, weights.scales))
    x = torch.randn(2, K_DIM, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="qweight"):
        int4_gemm(x[:, :128], qw, qz, sc, 32)
    with pytest.raises(ValueError, match="qzeros"):
        int4_gemm(x, qw, qz, sc, 64)  # group size disagrees with the zeros' rows
    with pytest.raises(TypeError, match="qweight"):
        int4_gemm(x, qw.to(torch.int64), qz, sc, 32)
    with pytest.raises(ValueError, match="g_idx"):
        int4_gemm(x, qw, qz, sc, 32, torch.zeros(8, dtype=torch.int32, device=device))


def test_gptq_zero_of_zero_cannot_be_repacked() -> None:
    quant = quantize_int4(torch.randn(64, 8), 32)
    zero0 = type(quant)(quant.intweight, torch.zeros_like(quant.zeros), quant.scales, quant.g_idx, 32)
    gptq = pack_gptq(zero0)
    with pytest.raises(ValueError, match="zero point"):
        gptq_to_awq(gptq.qweight, gptq.qzeros, gptq.scales, gptq.g_idx, 32)


def test_packing_agrees_with_server_quant_formats() -> None:
    # Two independent implementations of the on-disk formats (server/quant/formats.py is the loader's).
    from server.quant.formats import Int4Weights, awq_encode, gptq_encode

    quant = quantize_int4(torch.randn(K_DIM, N_DIM) * 0.1, 64)
    w = Int4Weights(quant.intweight, quant.zeros, quant.scales, quant.g_idx, 64)
    awq, server_awq = pack_awq(quant), awq_encode(w)
    assert torch.equal(awq.qweight, server_awq.qweight) and torch.equal(awq.qzeros, server_awq.qzeros)
    gptq, server_gptq = pack_gptq(quant), gptq_encode(w)
    assert torch.equal(gptq.qweight, server_gptq.qweight) and torch.equal(gptq.qzeros, server_gptq.qzeros)
