"""Mixtral, Qwen2-MoE and Qwen3-MoE served end to end: tiny random models built with transformers' own
classes (4 layers, 8 experts, top-2, GQA), saved as Hugging Face folders, loaded by our loader and run
by our engine against transformers fp32: greedy tokens equal token for token (staggered arrivals with
chunked prefill, a prefix-cache hit, preemption), prompt logprobs within 2e-4, and the router's chosen
experts equal on every token of every MoE layer.

Router ties: our router is the same `F.linear` over the same fp32 hidden states as transformers' up to
summation order in the layers before it, so two experts whose probabilities differ by less than that
error could swap. The test counts such near-ties (k-th and (k+1)-th probability within 1e-5) and
requires every other token's choice to be equal; on these seeds there are none (asserted too, so a
seed that produced one would be seen, not silently skipped)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_driver import run_staggered
from moe_models import KINDS, LOGPROB_TOL, PROMPTS, build, moe_engine
from prompt_logprobs import engine_prompt_logprobs, hf_greedy, hf_prompt_logprobs

from server.models.moe.layer import FusedMoE
from server.request import SamplingParams

TIE_GAP = 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            made[kind] = build(tmp_path_factory.mktemp(f"tiny-{kind}"), smollm2_dir, kind)
        return made[kind]

    return make


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_prompt_logprobs_prefix_hit_and_preemption(tiny: Callable[[str], Path], kind: str) -> None:
    folder = tiny(kind)
    engine = moe_engine(folder)
    a = engine.loaded.arch
    assert a.num_heads != a.num_kv_heads and a.moe is not None and a.moe.num_experts == 8
    moe_layers = [i for i, s in enumerate(a.layers) if s.mlp == "moe"]
    assert moe_layers == {"mixtral": [0, 1, 2, 3], "qwen2_moe": [0, 2, 3], "qwen3_moe": [1, 3]}[kind]
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    ref = hf_greedy(folder, prompts, 12)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    assert run_staggered(engine, prompts, params) == ref
    hits = engine.stats().prefix_cache_hits
    assert [engine.generate([p], params)[0] for p in prompts] == ref
    assert engine.stats().prefix_cache_hits > hits
    ours = engine_prompt_logprobs(engine, prompts[1])
    theirs = hf_prompt_logprobs(folder, prompts[1], torch.float32)
    torch.testing.assert_close(ours, theirs, atol=LOGPROB_TOL, rtol=0)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    # a cache too small for all four: requests are preempted and recomputed, tokens unchanged
    tight = moe_engine(folder, num_kv_blocks=12)
    assert run_staggered(tight, prompts, params) == ref
    assert tight.stats().num_preemptions > 0
    assert tight.stats().num_free_blocks == 12


def _record_ours(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(id of the block, chosen ids [T, K], router probabilities [T, E]) of every FusedMoE.route call."""
    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    original = FusedMoE.route

    def route(self: FusedMoE, x: torch.Tensor) -> Any:
        r = original(self, x)
        probs = torch.softmax(torch.nn.functional.linear(x, self.weights.router).float(), dim=-1)
        seen.append((id(self), r.ids.clone(), probs))
        return r

    monkeypatch.setattr(FusedMoE, "route", route)
    return seen


def _hf_router_choices(folder: Path, tokens: list[int]) -> Iterator[torch.Tensor]:
    """Per MoE layer in order: transformers' chosen experts [T, K] over the whole sequence at once."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    found: list[torch.Tensor] = []

    def hook(_m: Any, _inp: Any, out: Any) -> None:
        found.append(out[2].reshape(-1, out[2].shape[-1]))

    handles = [
        layer.mlp.gate.register_forward_hook(hook)
        for layer in hf.model.layers  # type: ignore[union-attr]
        if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")
    ]
    with torch.no_grad():
        hf(torch.tensor([tokens]))
    for h in handles:
        h.remove()
    yield from found


@pytest.mark.parametrize("kind", KINDS)
def test_router_choices_equal_on_every_token(
    tiny: Callable[[str], Path], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tiny(kind)
    engine = moe_engine(folder)
    prompt = engine.tokenizer.encode(PROMPTS[3])
    seen = _record_ours(monkeypatch)
    out = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0))[0]
    monkeypatch.undo()
    # one request: each block's calls, in step order, cover the prompt (in chunks of 8) then every
    # generated token but the last (never fed back)
    blocks = list(dict.fromkeys(b for b, _, _ in seen))
    ours = [torch.cat([ids for b, ids, _ in seen if b == blk]) for blk in blocks]
    probs = [torch.cat([p for b, _, p in seen if b == blk]) for blk in blocks]
    theirs = list(_hf_router_choices(folder, prompt + out[:-1]))
    assert len(ours) == len(theirs) == sum(s.mlp == "moe" for s in engine.loaded.arch.layers)
    ties = 0
    for mine, ref, p in zip(ours, theirs, probs, strict=True):
        assert mine.shape == ref.shape == (len(prompt) + len(out) - 1, 2)
        top = p.sort(dim=-1, descending=True).values
        tie = (top[:, 1] - top[:, 2]).abs() < TIE_GAP  # the 2nd and 3rd expert all but equal
        ties += int(tie.sum())
        same = (mine.sort(dim=-1).values == ref.sort(dim=-1).values).all(dim=-1)
        assert bool((same | tie).all()), (
            f"router choices differ at tokens {(~same).nonzero().flatten().tolist()}"
        )
    assert ties == 0
