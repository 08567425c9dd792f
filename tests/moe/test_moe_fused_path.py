"""Mixture-of-experts models on the compiled fp32 CPU path (llama.py `_forward_fused`): tiny random
Mixtral, Qwen2-MoE (its shared expert) and Qwen3-MoE (q/k norms, `norm_topk_prob`, dense
`mlp_only_layers`) run their attention and norms through the fused ops and each MoE layer's block between
them. Greedy tokens equal the torch path's (the eager module calls) and transformers', prompt logprobs
agree with the torch path's within 1e-4 (the fused norms sum in another order) and no KV block leaks.
These fp32 (unquantized) models have no block-quantized projections, so the decode graph does not record
them (tests/moe/test_moe_decode_graph.py runs quantized MoE models through it): their one-row steps run here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_driver import run_staggered
from moe_models import KINDS, PROMPTS, build, moe_engine
from prompt_logprobs import engine_prompt_logprobs, hf_greedy

from server.models.llama import LlamaForCausalLM
from server.request import SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            made[kind] = build(tmp_path_factory.mktemp(f"fused-{kind}"), smollm2_dir, kind)
        return made[kind]

    return make


@pytest.mark.parametrize("kind", KINDS)
def test_moe_model_runs_the_fused_path(
    tiny: Callable[[str], Path], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tiny(kind)
    engine = moe_engine(folder)
    model = engine.loaded.model
    assert model.fused_ops is not None and model.config.fused_cpu
    calls: list[int] = []
    original = LlamaForCausalLM._forward_fused

    def spy(self: LlamaForCausalLM, h: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(h.shape[0])
        return original(self, h, *args)

    monkeypatch.setattr(LlamaForCausalLM, "_forward_fused", spy)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    fused = run_staggered(engine, prompts, params)
    fused_lps = engine_prompt_logprobs(engine, prompts[1])
    assert calls, "the fused path never ran"
    assert 1 in calls  # one-row decode steps too
    # fp32 projections: no decode graph is recorded, those steps ran _forward_fused
    assert model._decode_graph is not None and model._decode_graph[1] is None
    ops, model.fused_ops = model.fused_ops, None
    try:
        n = len(calls)
        eager = run_staggered(engine, prompts, params)
        eager_lps = engine_prompt_logprobs(engine, prompts[1])
        assert len(calls) == n  # the torch path really served these
    finally:
        model.fused_ops = ops
    assert fused == eager == hf_greedy(folder, prompts, 8)
    torch.testing.assert_close(fused_lps, eager_lps, atol=1e-4, rtol=0)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
