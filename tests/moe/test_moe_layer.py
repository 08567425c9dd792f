"""FusedMoE against transformers' own MoE blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss) with the same
weights, loaded through our checkpoint-name helper: router choices equal on every token, outputs within
tolerance."""

from __future__ import annotations

import pytest
import torch
from hf_blocks import PREFIX, E, H, checkpoint_tensors, hf_block, hf_routing

from server.models.moe import FusedMoE, MoEConfig, MoEConfigError, group_by_expert, load_expert_weights
from server.models.moe.layer import DenseExperts

KINDS = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")
T = 37  # tokens: every expert gets some, a few get many


def _ours(kind: str, gemm_dtype: torch.dtype = torch.float32) -> tuple[FusedMoE, torch.nn.Module]:
    block, hf_cfg = hf_block(kind)
    cfg = MoEConfig.from_hf_config(hf_cfg)
    weights = load_expert_weights(checkpoint_tensors(kind, block), PREFIX, cfg)
    return FusedMoE(cfg, weights, gemm_dtype=gemm_dtype), block


@pytest.mark.parametrize("kind", KINDS)
def test_fused_moe_matches_transformers_block(kind: str) -> None:
    ours, block = _ours(kind)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = block(x[None])
        ref = (ref[0] if isinstance(ref, tuple) else ref)[0]
        got = ours(x)
        # Same F.linear of the same tensors: the logits are bit-identical, so top-k (ties included) is too.
        assert torch.equal(ours.route(x).ids, hf_routing(kind, block, x))
    # fp32 GEMMs in another order than transformers' per-expert loop: a few ulps of the largest output.
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-5 * ref.abs().max().item())


@pytest.mark.parametrize("kind", ("mixtral", "gpt_oss"))
def test_bf16_expert_gemms_stay_close(kind: str) -> None:
    ours, block = _ours(kind, gemm_dtype=torch.bfloat16)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = block(x[None])
        ref = (ref[0] if isinstance(ref, tuple) else ref)[0]
        got = ours(x)
    # Weights and activations rounded to bf16 (8 bits of mantissa) in two chained GEMMs.
    assert (got - ref).abs().max() <= 3e-2 * ref.abs().max()


def test_grouping_is_one_stable_sort_by_expert() -> None:
    ids = torch.tensor([[3, 1], [1, 0], [3, 2]])
    g = group_by_expert(ids, 5)
    assert g.counts == [1, 2, 1, 2, 0] and g.offsets == [0, 1, 3, 4, 6]
    assert g.pairs.tolist() == [3, 1, 2, 5, 0, 4]  # expert 0: pair 3; expert 1: pairs 1, 2; ...
    assert g.tokens.tolist() == [1, 0, 1, 2, 0, 2]


class _Recording(DenseExperts):
    def __init__(self, *a: object, **kw: object) -> None:
        super().__init__(*a, **kw)  # type: ignore[arg-type]
        self.used: list[int] = []

    def gate_up(self, e: int, x: torch.Tensor) -> torch.Tensor:
        self.used.append(e)
        return super().gate_up(e, x)


def test_one_token_runs_only_its_chosen_experts() -> None:
    ours, _ = _ours("qwen3_moe")
    rec = _Recording(ours.weights)
    moe = FusedMoE(ours.cfg, ours.weights, experts=rec)
    x = torch.randn(1, H)
    with torch.no_grad():
        moe(x)
    assert sorted(rec.used) == sorted(moe.route(x).ids[0].tolist())


def test_config_and_shapes_are_checked() -> None:
    with pytest.raises(MoEConfigError, match="top_k"):
        MoEConfig("mixtral", num_experts=2, top_k=3, hidden_size=8, intermediate_size=8)
    with pytest.raises(MoEConfigError, match="routing"):
        MoEConfig("mixtral", 4, 2, 8, 8, routing="sigmoid")
    ours, _ = _ours("mixtral")
    assert ours(torch.zeros(0, H)).shape == (0, H)  # an empty step
    with pytest.raises(ValueError, match=r"x must be \[T, 64\]"):
        ours(torch.randn(3, H + 1))
    bad = MoEConfig("mixtral", E, 2, H, 16)
    with pytest.raises(ValueError, match="w13"):
        FusedMoE(bad, ours.weights)
    with pytest.raises(KeyError, match=r"experts\.0\.w1\.weight"):
        load_expert_weights({}, PREFIX, ours.cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_path_matches_the_cpu_path(kind: str) -> None:
    ours, _ = _ours(kind)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cpu = ours(x)
        cuda_weights = ours.weights.to("cuda")
        gpu = FusedMoE(ours.cfg, cuda_weights, gemm_dtype=torch.float32)(x.cuda())
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=0, atol=1e-4 * cpu.abs().max().item())
