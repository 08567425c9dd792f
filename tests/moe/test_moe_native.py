"""The fused routed-experts call (server/models/moe/native.py, csrc/moe_experts.cpp) against the per-expert
loop it replaces (FusedMoE._grouped, KUBEINFER_MOE_FUSED=0), on the same quantized experts: outputs
equal within fp32 rounding of the activation (its exp is C's, the loop's torch's), and the call is the
path FusedMoE takes where the kernels build."""

from __future__ import annotations

import pytest
import torch
from hf_blocks import PREFIX, E, H, checkpoint_tensors, hf_block

from server.models.moe import FusedMoE, MoEConfig, Mxfp4Experts, Mxfp4Tensor, load_expert_weights
from server.models.moe.native import ENABLE_ENV, try_load_moe_experts_kernel
from server.models.moe.quant import BlockQuantExperts
from server.quant.cpu_mxfp4 import try_load_mxfp4_kernel
from server.quant.cpu_qlinear import try_load_qlinear_kernel

KINDS = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")
# |fused - loop| <= RTOL * max|loop| per output: the activation's exp differs by an ulp or so, and that
# difference is carried through one down GEMM and a weighted sum of top_k outputs.
RTOL = 2e-6

needs_kernels = pytest.mark.skipif(
    try_load_qlinear_kernel() is None or try_load_moe_experts_kernel() is None,
    reason="the CPU kernels do not build here",
)


def _block(kind: str, fmt: str) -> FusedMoE:
    block, hf_cfg = hf_block(kind)
    cfg = MoEConfig.from_hf_config(hf_cfg)
    weights = load_expert_weights(checkpoint_tensors(kind, block), PREFIX, cfg)
    experts = BlockQuantExperts.quantize(weights, fmt, try_load_qlinear_kernel())
    return FusedMoE(cfg, weights, experts=experts)


def _both(
    moe: FusedMoE, x: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        monkeypatch.setenv(ENABLE_ENV, "0")
        loop = moe(x)
        monkeypatch.setenv(ENABLE_ENV, "1")
        fused = moe(x)
    return fused, loop


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "int8"])
def test_fused_call_equals_the_per_expert_loop(kind: str, fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    moe = _block(kind, fmt)
    gen = torch.Generator().manual_seed(1)
    for t in (1, 3, 37):  # decode at one user, a few users (GEMV rows), a batch (every expert, some many)
        x = torch.randn(t, H, generator=gen)
        fused, loop = _both(moe, x, monkeypatch)
        scale = loop.abs().max()
        assert scale > 0
        err = (fused - loop).abs().max()
        assert err <= RTOL * scale, f"{kind} {fmt} T={t}: max |fused - loop| {err:.3g}, scale {scale:.3g}"


def _mxfp4(shape: tuple[int, int, int], gen: torch.Generator) -> Mxfp4Tensor:  # [E, N, K]
    e, n, k = shape
    blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=gen, dtype=torch.uint8)
    return Mxfp4Tensor(blocks, torch.randint(120, 128, (e, n, k // 32), generator=gen, dtype=torch.uint8))


@needs_kernels
@pytest.mark.skipif(try_load_mxfp4_kernel() is None, reason="the MXFP4 kernel does not build here")
def test_mxfp4_experts_take_the_fused_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt-oss's MXFP4 experts (biases, clamped SwiGLU) through the same loop over MXFP4's kernel."""
    block, hf_cfg = hf_block("gpt_oss")
    cfg = MoEConfig.from_hf_config(hf_cfg)
    weights = load_expert_weights(checkpoint_tensors("gpt_oss", block), PREFIX, cfg)
    gen = torch.Generator().manual_seed(4)
    i = cfg.intermediate_size
    experts = Mxfp4Experts(
        _mxfp4((E, 2 * i, H), gen), _mxfp4((E, H, i), gen), weights.b13, weights.b2, try_load_mxfp4_kernel()
    )
    moe = FusedMoE(cfg, weights, experts=experts)
    monkeypatch.setenv(ENABLE_ENV, "1")
    assert moe.native_call() is not None
    for t in (1, 3, 37):
        x = torch.randn(t, H, generator=gen) * 0.3
        fused, loop = _both(moe, x, monkeypatch)
        scale = loop.abs().max()
        assert scale > 0
        assert (fused - loop).abs().max() <= RTOL * scale, f"T={t}"


@needs_kernels
def test_fused_call_is_the_path_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    moe = _block("qwen3_moe", "q8_0")
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        monkeypatch.setenv(ENABLE_ENV, "0")
        loop = moe(x)

        def no_loop(*_: object) -> torch.Tensor:
            raise AssertionError("the per-expert loop ran")

        monkeypatch.setattr(moe, "_grouped", no_loop)
        monkeypatch.setenv(ENABLE_ENV, "1")
        assert moe.native_call() is not None
        fused = moe(x)  # would raise if the loop ran
    torch.testing.assert_close(fused, loop, rtol=0, atol=RTOL * float(loop.abs().max()))
    monkeypatch.setenv(ENABLE_ENV, "0")
    assert moe.native_call() is None
    monkeypatch.setenv(ENABLE_ENV, "yes")
    with pytest.raises(ValueError, match=ENABLE_ENV):
        moe.native_call()


@needs_kernels
def test_fused_call_checks_its_arguments() -> None:
    moe = _block("mixtral", "q8_0")
    call = moe.native_call()
    assert call is not None
    entry = moe.experts.fused_entry()  # type: ignore[attr-defined]
    x = torch.randn(2, H)
    w = torch.full((2, 2), 0.5)
    with pytest.raises(RuntimeError, match="returned 2"):  # an expert id outside [0, E): refused in C
        call.run(x, torch.tensor([[0, E]]).repeat(2, 1), w, entry)
    with pytest.raises(ValueError, match="ids"):
        call.run(x, torch.zeros(2, 2, dtype=torch.int32), w, entry)
    with pytest.raises(ValueError, match="x must be"):
        call.run(x.double(), torch.zeros(2, 2, dtype=torch.int64), w, entry)
    empty = call.run(torch.empty(0, H), torch.empty(0, 2, dtype=torch.int64), torch.empty(0, 2), entry)
    assert empty.shape == (0, H)


@needs_kernels
@pytest.mark.slow  # ~20 s on a shared 2-core machine
def test_a_prefill_sized_call_then_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill-sized call (10k tokens) and the next one-token call, on the scratch the first left,
    both equal the loop."""
    moe = _block("qwen3_moe", "q4_0")
    gen = torch.Generator().manual_seed(5)
    for t in (10_000, 1):
        x = torch.randn(t, H, generator=gen)
        fused, loop = _both(moe, x, monkeypatch)
        assert (fused - loop).abs().max() <= RTOL * loop.abs().max(), f"T={t}"
