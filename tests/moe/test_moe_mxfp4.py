"""MXFP4 experts (gpt-oss's shipped format): our dequantization against transformers' converter, and a
gpt-oss block served from packed weights against GptOssMLP holding the dequantized ones."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_blocks import INTER, PREFIX, E, H, hf_block, hf_routing

from server.models.moe import FusedMoE, MoEConfig, dequantize_mxfp4, load_expert_weights, load_mxfp4_experts
from server.models.moe.native import ENABLE_ENV


def _random_mxfp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:  # [*, N, K]
    g = torch.Generator().manual_seed(seed)
    *lead, k = shape
    blocks = torch.randint(0, 256, (*lead, k // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 130, (*lead, k // 32), generator=g, dtype=torch.uint8)  # 2**-7 .. 2**2
    return blocks, scales


def test_dequantize_reads_low_nibble_first_and_e8m0_scales() -> None:
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x92  # low nibble 2 (+1.0) first, high nibble 9 (-0.5)
    blocks[0, 1] = 0x07  # +6.0, then +0.0
    out = dequantize_mxfp4(blocks, torch.tensor([128], dtype=torch.uint8))  # scale 2 ** (128 - 127)
    assert out[:4].tolist() == [2.0, -1.0, 12.0, 0.0]
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.int(), torch.tensor([128], dtype=torch.uint8))


def test_dequantize_matches_transformers_converter() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_mxfp4((3, 24, 64), seed=0)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N]: transposed
    assert torch.equal(dequantize_mxfp4(blocks, scales), ref.transpose(1, 2))


def _gpt_oss_block() -> tuple[Any, MoEConfig, dict[str, torch.Tensor]]:
    """(transformers' GptOssMLP over the dequantized experts, our config, the packed checkpoint tensors)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    block, hf_cfg = hf_block("gpt_oss")
    cfg = MoEConfig.from_hf_config(hf_cfg)
    gu_b, gu_s = _random_mxfp4((E, 2 * INTER, H), seed=1)
    d_b, d_s = _random_mxfp4((E, H, INTER), seed=2)
    with torch.no_grad():  # the dense twin: what transformers loads from these bytes
        hf_experts: Any = block.experts
        hf_experts.gate_up_proj.copy_(convert_moe_packed_tensors(gu_b, gu_s, dtype=torch.float32))
        hf_experts.down_proj.copy_(convert_moe_packed_tensors(d_b, d_s, dtype=torch.float32))
    p = PREFIX + "."
    dense = ("experts.gate_up_proj", "experts.down_proj")  # a packed checkpoint has the blocks instead
    tensors = {p + k: v.detach().clone() for k, v in block.state_dict().items() if k not in dense}
    tensors |= {
        p + "experts.gate_up_proj_blocks": gu_b,
        p + "experts.gate_up_proj_scales": gu_s,
        p + "experts.down_proj_blocks": d_b,
        p + "experts.down_proj_scales": d_s,
    }
    return block, cfg, tensors


@pytest.mark.parametrize("use_kernel", [True, False])
def test_gpt_oss_block_from_mxfp4_matches_transformers(use_kernel: bool) -> None:
    """Through the CPU kernel and through the reference path (each expert dequantized per call)."""
    block, cfg, tensors = _gpt_oss_block()
    experts = load_mxfp4_experts(tensors, PREFIX, cfg, use_kernel=use_kernel)
    assert (experts.kernel is not None) == use_kernel
    moe = FusedMoE(cfg, load_expert_weights(tensors, PREFIX, cfg, dense_experts=False), experts=experts)
    x = torch.randn(13, H, generator=torch.Generator().manual_seed(3)) * 0.1
    with torch.no_grad():
        ref = block(x[None])[0][0]
        got = moe(x)
        assert torch.equal(moe.route(x).ids, hf_routing("gpt_oss", block, x))
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-5 * ref.abs().max().item())
    assert experts.w13.nbytes() * 7 < E * 2 * INTER * H * 4  # packed: ~0.53 bytes per value vs 4
    assert experts.nbytes() == sum(t.numel() for t in experts.tensors())


def test_a_step_reads_only_the_chosen_experts_packed_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Guard: the served path multiplies from the packed bytes (no expert is ever dequantized) and hands
    the kernel exactly the chosen experts' slices, each once per GEMM, whatever the number of tokens."""
    from server.models.moe import Mxfp4Tensor
    from server.quant.cpu_mxfp4 import Mxfp4Kernel

    monkeypatch.setenv(ENABLE_ENV, "0")  # the per-expert loop (the fused call: test_moe_native.py)
    block, cfg, tensors = _gpt_oss_block()
    experts = load_mxfp4_experts(tensors, PREFIX, cfg)
    assert experts.kernel is not None, "the MXFP4 kernel did not build here"
    kernel: Mxfp4Kernel = experts.kernel
    seen: list[int] = []

    class Recording:
        def linear(self, x: torch.Tensor, blocks: torch.Tensor, *args: Any) -> torch.Tensor:
            seen.append(blocks.data_ptr())
            return Mxfp4Kernel.linear(kernel, x, blocks, *args)

    def refuse(*_: Any) -> torch.Tensor:
        raise AssertionError("an expert was dequantized")

    monkeypatch.setattr(Mxfp4Tensor, "expert", refuse)
    experts.kernel = Recording()  # type: ignore[assignment]
    moe = FusedMoE(cfg, load_expert_weights(tensors, PREFIX, cfg, dense_experts=False), experts=experts)
    for t in (1, 5):
        x = torch.randn(t, H, generator=torch.Generator().manual_seed(t)) * 0.1
        seen.clear()
        with torch.no_grad():
            got = moe(x)
            ref = block(x[None])[0][0]
        torch.testing.assert_close(got, ref, rtol=0, atol=2e-5 * ref.abs().max().item())
        chosen = sorted(set(moe.route(x).ids.reshape(-1).tolist()))
        w13, w2 = experts.w13.blocks, experts.w2.blocks
        assert sorted(seen) == sorted(
            [w13[e].data_ptr() for e in chosen] + [w2[e].data_ptr() for e in chosen]
        )
