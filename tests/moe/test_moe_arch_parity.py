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

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_driver import TOKENIZER_FILES, run_staggered
from prompt_logprobs import engine_prompt_logprobs, hf_prompt_logprobs

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.models.moe.layer import FusedMoE
from server.request import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):",
    "In 1969, the first humans landed on the Moon. The mission was called",
]
MAX_LEN = 256
LOGPROB_TOL = 2e-4  # fp32 both sides; attention and expert sums in another order
KINDS = ["mixtral", "qwen2_moe", "qwen3_moe"]
TIE_GAP = 1e-5


def _config(kind: str) -> Any:
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=49152,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LEN,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        rms_norm_eps=1e-5,
        num_experts_per_tok=2,
    )
    if kind == "mixtral":
        return tf.MixtralConfig(**common, intermediate_size=48, num_local_experts=8)
    if kind == "qwen2_moe":
        # layer 1 dense (mlp_only_layers), a shared expert, no renormalisation (its shipped default)
        return tf.Qwen2MoeConfig(
            **common,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=80,
            num_experts=8,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        )
    # every second layer sparse (decoder_sparse_step 2: layers 1 and 3), renormalised top-k, q/k norms
    common["head_dim"] = 16
    return tf.Qwen3MoeConfig(
        **common,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        decoder_sparse_step=2,
        norm_topk_prob=True,
    )


def build(out: Path, tokenizer_from: Path, kind: str, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(kind), dtype=torch.float32)
    with torch.no_grad():
        # larger-than-default weights so greedy argmax and the router are not decided by noise; norms
        # away from 1 so a missing norm weight shows
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            elif name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, out / name)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            made[kind] = build(tmp_path_factory.mktemp(f"tiny-{kind}"), smollm2_dir, kind)
        return made[kind]

    return make


def _engine(folder: Path, num_kv_blocks: int = 128) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(folder), dtype="float32", max_model_len=MAX_LEN),
            cache=CacheConfig(block_size=4, num_kv_blocks=num_kv_blocks, enable_prefix_caching=True),
            max_num_batched_tokens=8,  # prompts are chunked, and chunks share steps with decodes
        )
    )


def hf_greedy(folder: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = hf.generate(  # type: ignore[misc]
                torch.tensor([p]), max_new_tokens=n, do_sample=False, min_new_tokens=0, eos_token_id=2
            )
            outs.append(ids[0, len(p) :].tolist())
    return outs


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_prompt_logprobs_prefix_hit_and_preemption(tiny: Callable[[str], Path], kind: str) -> None:
    folder = tiny(kind)
    engine = _engine(folder)
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
    tight = _engine(folder, num_kv_blocks=12)
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
    engine = _engine(folder)
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
