"""Block-quantized experts (server/models/moe/quant.py) through qlinear's CPU kernel per expert, against
the same MoE block over the dequantized weights (cpu_qlinear.dequantize_reference)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_cpu_qlinear import make_weight

from server.models.moe import BlockQuantExperts, ExpertWeights, FusedMoE, MoEConfig
from server.quant import cpu_qlinear as cq
from server.quant.cpu_qlinear import BlockQuantWeight, QLinearKernel

E, H, INTER = 4, 256, 256  # k-quants need K in whole 256-value super-blocks


@pytest.fixture(scope="module")
def kernel() -> QLinearKernel:
    return cq.load_qlinear_kernel()


def _block(
    fmt: str, bias: bool
) -> tuple[MoEConfig, list[BlockQuantWeight], list[BlockQuantWeight], ExpertWeights]:
    cfg = MoEConfig("gpt_oss" if bias else "qwen3_moe", E, 2, H, INTER, expert_bias=bias)
    w13 = [make_weight(fmt, 2 * INTER, H, seed=e) for e in range(E)]
    w2 = [make_weight(fmt, H, INTER, seed=100 + e) for e in range(E)]
    g = torch.Generator().manual_seed(7)
    dense = ExpertWeights(
        router=torch.randn(E, H, generator=g) * 0.1,
        router_bias=None,
        w13=torch.stack([cq.dequantize_reference(w) for w in w13]),
        w2=torch.stack([cq.dequantize_reference(w) for w in w2]),
        b13=torch.randn(E, 2 * INTER, generator=g) if bias else None,
        b2=torch.randn(E, H, generator=g) if bias else None,
    )
    return cfg, w13, w2, dense


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "int8", "q4_k", "q6_k"])
@pytest.mark.parametrize("tokens", [1, 9])
def test_quantized_experts_match_their_dequantized_weights(
    kernel: QLinearKernel, fmt: str, tokens: int
) -> None:
    bias = fmt == "q8_0"
    cfg, w13, w2, dense = _block(fmt, bias)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
    quant = FusedMoE(cfg, dense, experts=BlockQuantExperts(w13, w2, dense.b13, dense.b2, kernel))
    ref = FusedMoE(cfg, dense, gemm_dtype=torch.float32)
    with torch.no_grad():
        got, want = quant(x), ref(x)
    # qlinear's fp32 sums in another order than torch's matmul over the same dequantized values.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())


def test_one_token_reads_only_its_chosen_experts(kernel: QLinearKernel) -> None:
    cfg, w13, w2, dense = _block("q4_0", False)
    x = torch.randn(1, H)
    chosen = set(FusedMoE(cfg, dense, gemm_dtype=torch.float32).route(x).ids[0].tolist())

    # Unchosen experts' weights replaced by NaN scales: reading any of them would poison the output.
    def poisoned(w: BlockQuantWeight) -> BlockQuantWeight:
        return BlockQuantWeight(
            w.q,
            torch.full_like(w.scales, float("nan")),
            w.mins,
            w.fmt,
            w.bits,
            w.group_size,
            w.zero_point,
            w.in_features,
            w.out_features,
        )

    p13 = [w if e in chosen else poisoned(w) for e, w in enumerate(w13)]
    p2 = [w if e in chosen else poisoned(w) for e, w in enumerate(w2)]
    out = FusedMoE(cfg, dense, experts=BlockQuantExperts(p13, p2, kernel=kernel))(x)
    assert torch.isfinite(out).all()


def test_round_to_nearest_quantize_and_shape_checks() -> None:
    cfg, _, _, dense = _block("q8_0", False)
    experts = BlockQuantExperts.quantize(dense, "q8_0")  # no kernel: the torch reference path
    x = torch.randn(5, H)
    with torch.no_grad():
        got = FusedMoE(cfg, dense, experts=experts)(x)
        want = FusedMoE(cfg, dense, gemm_dtype=torch.float32)(x)
    # q8_0 of already-quantized values: a half-step of 1/127 of each block's max at most.
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()
    assert experts.nbytes() < 0.3 * 4 * 3 * E * INTER * H  # q8_0: 34 bytes per 32 values, fp32: 128
    with pytest.raises(ValueError, match="do not chain"):
        BlockQuantExperts(experts.w13, experts.w13)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_gguf_stacked_experts_split_per_expert(kernel: QLinearKernel, fmt: str) -> None:
    """llama.cpp's ffn_*_exps tensors: E consecutive [N, K] matrices; each expert dequantizes as gguf-py
    dequantizes the whole tensor, and the block runs like its dequantized twin."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from gguf_models import quantize_q4_k

    def gguf(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:  # [E, N, K] -> (bytes, gguf-py's dequant)
        flat = w.reshape(-1, w.shape[-1]).numpy()
        if fmt == "q8_0":
            raw = quantize(flat, GGMLQuantizationType.Q8_0)
            return raw, dequantize(raw, GGMLQuantizationType.Q8_0)
        raw = quantize_q4_k(flat)
        return raw, dequantize(raw, GGMLQuantizationType.Q4_K)

    g = torch.Generator().manual_seed(11)
    cfg = MoEConfig("mixtral", E, 2, H, INTER)
    (gate, gate_ref), (up, up_ref), (down, down_ref) = (
        gguf(torch.randn(E, n, k, generator=g) * 0.1) for n, k in ((INTER, H), (INTER, H), (H, INTER))
    )
    experts = BlockQuantExperts.from_gguf((gate, fmt), (up, fmt), (down, fmt), cfg, kernel)
    w13_ref = torch.cat(
        [torch.from_numpy(gate_ref).reshape(E, INTER, H), torch.from_numpy(up_ref).reshape(E, INTER, H)], 1
    )
    w2_ref = torch.from_numpy(down_ref).reshape(E, H, INTER)
    for e in range(E):
        torch.testing.assert_close(cq.dequantize_reference(experts.w13[e]), w13_ref[e], rtol=0, atol=1e-6)
        torch.testing.assert_close(cq.dequantize_reference(experts.w2[e]), w2_ref[e], rtol=0, atol=1e-6)
    dense = ExpertWeights(
        torch.randn(E, H, generator=g) * 0.1, None, w13_ref.float(), w2_ref.float(), None, None
    )
    x = torch.randn(6, H, generator=g)
    with torch.no_grad():
        got = FusedMoE(cfg, dense, experts=experts)(x)
        want = FusedMoE(cfg, dense, gemm_dtype=torch.float32)(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())
    with pytest.raises(ValueError, match="bytes"):  # a row short
        BlockQuantExperts.from_gguf((gate[:-1], fmt), (up, fmt), (down, fmt), cfg)
