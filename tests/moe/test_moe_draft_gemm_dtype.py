"""One walker for GEMM dtypes (server/quant/gemm_dtype.apply_gemm_dtype): the engine's GEMM dtype reaches
a draft model's quantized experts as it reaches the target's. A GGUF target drafts with an MoE GGUF
(both kept quantized: `keep_gguf`) under bf16 GEMMs (what `--dtype auto` picks on CPUs with native bf16)
and under int8 ones (its pick on AVX512-VNNI CPUs without), each forced here so that the test means the
same on every CPU: every BlockQuantLinear and every BlockQuantExperts of both models computes in it. Before, the draft got the projections' walker only
and kept its experts' batches in fp32. Slow (the GGUF's tokenizer is converted from its metadata)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_gguf import write_moe_gguf
from moe_models import PROMPTS, build

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.models.moe.block import SparseMoeBlock
from server.models.moe.quant import BlockQuantExperts
from server.quant.block_linear import BlockQuantLinear
from server.quant.gemm_dtype import apply_gemm_dtype
from server.request import SamplingParams
from server.spec_decode.config import SpeculativeConfig
from server.spec_decode.draft_model import DraftModelProposer

pytestmark = pytest.mark.slow


def _dtypes(model: torch.nn.Module) -> tuple[set[torch.dtype], set[torch.dtype]]:
    """(the projections' gemm_dtype, the quantized experts' compute dtype) of `model`."""
    linears = {m.gemm_dtype for m in model.modules() if isinstance(m, BlockQuantLinear)}
    experts = {
        b.experts.compute
        for b in model.modules()
        if isinstance(b, SparseMoeBlock) and isinstance(b.experts, BlockQuantExperts)
    }
    return linears, experts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_moe_draft_experts_follow_the_engine_gemm_dtype(
    tmp_path: Path, smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    monkeypatch.setattr("server.engine.cpu_gemm_dtype", lambda compute, requested="float32": dtype)
    hf = build(tmp_path / "hf", smollm2_dir, "qwen3_moe")
    path, _ = write_moe_gguf(hf, tmp_path / "moe-Q8_0.gguf", "Q8_0")
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(path), max_model_len=256, cache_dir=tmp_path / "c"),
            cache=CacheConfig(cache_dtype="float32", block_size=4, num_kv_blocks=128),
            speculative=SpeculativeConfig("draft_model", 2, model=str(path)),
        )
    )
    assert engine.gemm_dtype == dtype
    assert engine.speculator is not None
    draft = engine.speculator.proposer
    assert isinstance(draft, DraftModelProposer)
    want = {dtype}
    assert _dtypes(engine.loaded.model) == (want, want)
    assert _dtypes(draft.model) == (want, want)  # was ({bf16}, {fp32}): the experts kept fp32
    # the walker goes both ways, and counts every projection and expert set it set
    linears = sum(isinstance(m, BlockQuantLinear) for m in draft.model.modules())
    blocks = sum(isinstance(m, SparseMoeBlock) for m in draft.model.modules())
    assert blocks and apply_gemm_dtype(draft.model, torch.float32) == linears + blocks
    assert _dtypes(draft.model) == ({torch.float32}, {torch.float32})
    apply_gemm_dtype(draft.model, dtype)
    # the drafted run serves and frees every block
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:2]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [len(o) for o in outs] == [8, 8]
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
