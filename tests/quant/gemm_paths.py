"""A block-quantized weight through BlockQuantLinear under each gemm_dtype (server/quant/gemm_dtype.py), for
the tile tests of test_cpu_qk_native.py and test_q8_tiles.py."""

from __future__ import annotations

import pytest
import torch

from server.quant.block_linear import BlockQuantLinear
from server.quant.cpu_qlinear import BlockQuantWeight, QLinearKernel


def check_gemm_dtypes(
    w: BlockQuantWeight,
    x: torch.Tensor,  # [M, K] fp32
    dense: torch.Tensor,  # [N, K] fp32: w's values
    fp32_bound: torch.Tensor,  # [M, N]: fp32 activations' slack against x @ dense^T
    int8_bound: torch.Tensor,  # [M, N]: int8 activations' (activation_error_bound, slack included)
    kernel: QLinearKernel,
    tiles_stay: bool,  # the tiles keep their int8 kernel at every M under bf16 and int8 here
) -> None:
    """Under fp32, bf16 and int8 the layer gives x @ dense^T within its bound: fp32 activations exact up to
    fp32 slack; bf16 and int8 ones within the int8 bound in the kernel, and from `gemm_min_rows` through
    dequantize + GEMM (bf16 operands under bf16: 1% of |x| @ |W|; fp32 under int8). Where both stay in the
    kernel, int8 runs the int8 kernels bf16 runs, bit for bit; with `tiles_stay`, int8 keeps them at every M."""
    m = x.shape[0]
    exact = x @ dense.t()
    in_kernel = {}
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        lin = BlockQuantLinear(w, kernel=kernel)
        lin.gemm_dtype = dtype
        bound = fp32_bound if dtype == torch.float32 else int8_bound
        if m >= lin.gemm_min_rows:
            bound = 1e-2 * (x.abs() @ dense.abs().t()) if dtype == torch.bfloat16 else fp32_bound
        y = lin(x)
        assert ((y - exact).abs() <= bound).all(), (m, dtype)
        if m < lin.gemm_min_rows:
            in_kernel[dtype] = y
    if torch.bfloat16 in in_kernel and torch.int8 in in_kernel:
        assert torch.equal(in_kernel[torch.int8], in_kernel[torch.bfloat16]), m
    if tiles_stay:
        assert torch.int8 in in_kernel, m


def decode_graph_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row count of every decode-graph step run from now on (DecodeGraph.run spied)."""
    from server.models.decode_graph import DecodeGraph

    rows: list[int] = []
    run = DecodeGraph.run

    def spy(self, h, tables, meta):  # type: ignore[no-untyped-def]
        rows.append(h.shape[0])
        return run(self, h, tables, meta)

    monkeypatch.setattr(DecodeGraph, "run", spy)
    return rows
