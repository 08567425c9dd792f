"""Mixture-of-experts models under tensor parallelism (server/distributed/moe_sharding.py wired into
sharding.py): a tiny random Mixtral, Qwen2-MoE (shared expert, a dense layer) and Qwen3-MoE (q/k norms,
dense layers between sparse ones) served with
tensor_parallel_size 2 over gloo give transformers' greedy tokens (staggered, chunked prefill, a
prefix-cache hit) and its prompt logprobs within the single-device tolerance. gpt-oss's MXFP4 experts
are cut along their packed blocks (checked in one process: the ranks' partial sums add up to the whole
block) and refused where a rank's slice would cut a block."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from engine_driver import run_staggered
from moe_models import LOGPROB_TOL, MAX_LEN, PROMPTS, build
from prompt_logprobs import engine_prompt_logprobs, hf_greedy, hf_prompt_logprobs

from server.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from server.distributed.moe_sharding import TensorParallelSparseMoeBlock
from server.distributed.sharding import TensorParallelConfigError, rank_loading_slicer
from server.engine import LLMEngine
from server.models.moe import (
    BlockQuantExperts,
    ExpertWeights,
    MoEConfig,
    Mxfp4Experts,
    Mxfp4Tensor,
    SparseMoeBlock,
    block_state,
    dequantize_mxfp4,
)
from server.models.moe.quant import quantize_moe_blocks
from server.quant.block_linear import BlockQuantLinear
from server.request import SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            made[kind] = build(tmp_path_factory.mktemp(f"tp-{kind}"), smollm2_dir, kind)
        return made[kind]

    return make


def tp_engine(folder: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(folder), dtype="float32", max_model_len=MAX_LEN),
            cache=CacheConfig(block_size=4, num_kv_blocks=128, enable_prefix_caching=True),
            max_num_batched_tokens=8,  # prompts are chunked, and chunks share steps with decodes
            device="cpu",  # gloo
            num_threads=1,  # two ranks share this machine's cores
            parallel=ParallelConfig(tensor_parallel_size=2, distributed_timeout_s=60),
        )
    )


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_tp2_greedy_and_prompt_logprobs_equal_transformers(tiny: Callable[[str], Path], kind: str) -> None:
    folder = tiny(kind)
    engine = tp_engine(folder)
    try:
        blocks = [m for m in engine.loaded.model.modules() if isinstance(m, TensorParallelSparseMoeBlock)]
        assert len(blocks) == {"mixtral": 4, "qwen2_moe": 3, "qwen3_moe": 2}[kind]
        moe = engine.loaded.arch.moe
        assert moe is not None and blocks[0].cfg.intermediate_size == moe.intermediate_size // 2
        prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
        params = SamplingParams(max_tokens=8, temperature=0.0)
        ref = hf_greedy(folder, prompts, 8)
        assert run_staggered(engine, prompts, params) == ref
        hits = engine.stats().prefix_cache_hits
        assert engine.generate([prompts[1]], params)[0] == ref[1]
        assert engine.stats().prefix_cache_hits > hits
        ours = engine_prompt_logprobs(engine, prompts[3])
        theirs = hf_prompt_logprobs(folder, prompts[3], torch.float32)
        torch.testing.assert_close(ours, theirs, atol=LOGPROB_TOL, rtol=0)
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        engine.close()
    assert engine.tp is not None and [p.exitcode for p in engine.tp.procs] == [0]


def _gpt_oss_block(inter: int, seed: int = 3) -> tuple[SparseMoeBlock, SparseMoeBlock]:
    """(block with MXFP4 experts, the same block with them dequantized dense), gpt-oss's routing."""
    e, h = 4, 64
    cfg = MoEConfig(
        "gpt_oss", e, 2, h, inter, routing="topk_softmax", router_bias=True, activation="swigluoai",
        expert_bias=True, swiglu_limit=7.0,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)

    def mx(n: int, k: int) -> Mxfp4Tensor:
        blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=g, dtype=torch.uint8)
        return Mxfp4Tensor(blocks, torch.randint(121, 125, (e, n, k // 32), generator=g, dtype=torch.uint8))

    w13, w2 = mx(2 * inter, h), mx(h, inter)
    b13, b2 = torch.randn(e, 2 * inter, generator=g) * 0.1, torch.randn(e, h, generator=g) * 0.1
    w = ExpertWeights(
        router=torch.randn(e, h, generator=g) * 0.3,
        router_bias=torch.randn(e, generator=g) * 0.1,
        w13=dequantize_mxfp4(w13.blocks, w13.scales),
        w2=dequantize_mxfp4(w2.blocks, w2.scales),
        b13=b13,
        b2=b2,
    )
    dense = SparseMoeBlock(cfg, device="meta")
    for name, t in block_state(w, "m").items():
        setattr(dense, name.split(".", 1)[1], torch.nn.Parameter(t, requires_grad=False))
    packed = SparseMoeBlock(cfg, device="meta")
    for name in ("router", "router_bias", "b13", "b2"):
        setattr(packed, name, torch.nn.Parameter(getattr(w, name), requires_grad=False))
    packed.set_experts(Mxfp4Experts(w13, w2, b13, b2))
    return packed, dense


@pytest.mark.parametrize("packed", [True, False], ids=["mxfp4", "dense"])
def test_gpt_oss_rank_shards_sum_to_the_whole_block(packed: bool) -> None:
    """Each rank's block (its partial sum, before the all-reduce) over 2 ranks adds up to the whole
    block: the down bias once, the packed w2 cut on block boundaries (I / N = 32)."""
    mxfp4, dense = _gpt_oss_block(inter=64)
    whole = mxfp4 if packed else dense
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(1))
    shards = [TensorParallelSparseMoeBlock.from_block(whole, r, 2) for r in range(2)]
    if packed:
        assert all(isinstance(s.experts, Mxfp4Experts) for s in shards)
        assert shards[0].experts.w2.blocks.shape[2] == 1  # type: ignore[union-attr]  # one 32-block each
    with torch.no_grad():
        want = dense(x)
        got = sum(SparseMoeBlock.forward(s, x) for s in shards)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_mxfp4_split_inside_a_block_is_refused(tmp_path: Path) -> None:
    from transformers import GptOssConfig

    mxfp4, _ = _gpt_oss_block(inter=32)
    with pytest.raises(TensorParallelConfigError, match=r"MXFP4 .* 16 per rank, not a multiple of 32"):
        TensorParallelSparseMoeBlock.from_block(mxfp4, 0, 2)
    # a shipped-style folder: experts in MXFP4 (quantization_config), intermediate_size 32
    cfg = GptOssConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    cfg.quantization_config = {"quant_method": "mxfp4"}
    folder = tmp_path / "gpt-oss"
    cfg.save_pretrained(str(folder))
    with pytest.raises(TensorParallelConfigError, match=r"MXFP4 .* not a multiple of 32"):
        rank_loading_slicer(folder, None, 0, 2)
    assert rank_loading_slicer(folder, None, 0, 1) is not None  # one rank: nothing to split


def test_int8_experts_rank_shards_sum_to_the_whole_int8_block() -> None:
    """--quantize int8 under TP: a Qwen2-MoE-shaped block (shared expert) with per-channel int8 experts,
    cut for 2 ranks (w13 rows with their scales, w2 columns with each row's whole scale), sums to the
    whole int8 block, the shared expert's int8 projections cut likewise; GGUF-style block formats are
    refused, experts or shared expert."""
    cfg = MoEConfig("qwen2_moe", 8, 2, 64, 64, renormalize=False, shared_expert_intermediate_size=96)
    block = SparseMoeBlock(cfg, device="cpu")
    g = torch.Generator().manual_seed(4)
    for p in block.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.2)
    assert quantize_moe_blocks(block, "int8", None) == 1  # experts and the shared expert's projections
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(2))
    shards = [TensorParallelSparseMoeBlock.from_block(block, r, 2) for r in range(2)]
    assert isinstance(shards[1].experts, BlockQuantExperts)
    assert shards[1].experts.w2[0].in_features == 32 and shards[1].shared_w2 is None
    shared = [shards[1].shared_gate_up, shards[1].shared_down]
    assert all(isinstance(m, BlockQuantLinear) and m.weight_q.fmt == "int8" for m in shared)
    assert [(m.out_features, m.in_features) for m in shared] == [(96, 64), (64, 48)]
    with torch.no_grad():
        want = block(x)
        got = sum(SparseMoeBlock.forward(s, x) for s in shards)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
    q8 = SparseMoeBlock(cfg, device="cpu")
    for p in q8.parameters():
        p.data.normal_()
    quantize_moe_blocks(q8, "q8_0", None)
    with pytest.raises(TensorParallelConfigError, match="dense, int8 and MXFP4 experts only"):
        TensorParallelSparseMoeBlock.from_block(q8, 0, 2)
    q8.set_experts(block.experts)  # int8 experts, a Q8_0 shared expert (a GGUF's): refused by name
    with pytest.raises(TensorParallelConfigError, match=r"dense or int8 shared expert only.*q8_0"):
        TensorParallelSparseMoeBlock.from_block(q8, 0, 2)
