"""gpt-oss (GptOssForCausalLM) through the paged engine against transformers' own class: a tiny random
model (4 layers alternating a 16-token window and full attention, attention sinks, q/k/v/o biases, YaRN
RoPE, 4 experts top-2 with the biased router and clamped SwiGLU) whose experts are stored in MXFP4 as
the shipped checkpoints store them (`*_blocks`/`*_scales`, quantization_config mxfp4); transformers runs
the same experts dequantized (its own converter), eager attention. Greedy tokens equal with prompts
several windows long, staggered and chunked, under preemption, on a prefix-cache hit; prompt logprobs
within 1e-4."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_driver import TOKENIZER_FILES, run_staggered
from prompt_logprobs import engine_prompt_logprobs

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.request import SamplingParams

WINDOW, NEW_TOKENS, VOCAB = 16, 10, 49152
E, H, INTER = 4, 64, 32


def _mxfp4(shape: tuple[int, ...], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:  # [E, N, K]
    *lead, k = shape
    blocks = torch.randint(0, 256, (*lead, k // 32, 16), generator=g, dtype=torch.uint8)
    # e2m1 magnitudes up to 6 times 2**-6 .. 2**-4: weights of a few hundredths, like the others here
    scales = torch.randint(121, 124, (*lead, k // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def build_gpt_oss(out: Path, tokenizer_from: Path) -> tuple[Path, Path]:
    """(dense folder, MXFP4 folder) of one random model: the MXFP4 one holds the experts packed, the
    dense one transformers' dequantization of the same bytes."""
    from safetensors.torch import load_file, save_file
    from transformers import GptOssConfig, GptOssForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    cfg = GptOssConfig(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=INTER, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=E,
        num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=1024,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 16.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2, rms_norm_eps=1e-5,
    )  # fmt: skip
    torch.manual_seed(5)
    model: Any = GptOssForCausalLM(cfg).float()
    g = torch.Generator().manual_seed(6)
    packed: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.0, 1.0)  # sinks of a few units: they change every softmax visibly
            elif p.dim() > 1:
                p.normal_(0.0, 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
        for i, layer in enumerate(model.model.layers):
            experts = layer.mlp.experts
            for proj, shape in (("gate_up_proj", (E, 2 * INTER, H)), ("down_proj", (E, H, INTER))):
                blocks, scales = _mxfp4(shape, g)
                getattr(experts, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                packed[f"model.layers.{i}.mlp.experts.{proj}_blocks"] = blocks
                packed[f"model.layers.{i}.mlp.experts.{proj}_scales"] = scales
    dense, quant = out / "dense", out / "mxfp4"
    model.save_pretrained(str(dense))
    quant.mkdir(parents=True)
    state = load_file(str(dense / "model.safetensors"))
    state = {k: v for k, v in state.items() if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**state, **packed}, str(quant / "model.safetensors"))
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn"],
    }
    (quant / "config.json").write_text(json.dumps(config))
    for folder in (dense, quant):
        for name in TOKENIZER_FILES:
            if (tokenizer_from / name).exists():
                shutil.copy(tokenizer_from / name, folder / name)
    return dense, quant


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> tuple[Path, Path]:
    return build_gpt_oss(tmp_path_factory.mktemp("gpt-oss"), smollm2_dir)


@pytest.fixture(scope="module")
def hf(folders: tuple[Path, Path]) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(folders[0]), dtype=torch.float32, attn_implementation="eager"
    )
    model.generation_config.eos_token_id = None
    return model


def _hf_greedy(hf: Any, prompts: list[list[int]]) -> list[list[int]]:
    with torch.inference_mode():
        return [
            hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]


def _prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _engine(folder: Path, backend: str = "cpu", **kw: Any) -> LLMEngine:
    cache = kw.pop("cache", CacheConfig(block_size=8, num_kv_blocks=128))
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(folder), dtype="float32"),
            cache=cache,
            attention_backend=backend,
            **kw,
        )
    )


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def test_layers_alternate_windows_with_sinks_and_experts(folders: tuple[Path, Path], hf: Any) -> None:
    """The MXFP4 folder's experts stay packed (Mxfp4Experts: 4-bit bytes, no dense w13/w2) and dequantize
    to exactly transformers' experts; the dense folder's load as dense weights equal to them too."""
    from server.models.moe import Mxfp4Experts

    packed: list[Any] = list(_engine(folders[1]).loaded.model.decoder_layers())
    dense: list[Any] = list(_engine(folders[0]).loaded.model.decoder_layers())
    assert [layer.self_attn.sliding_window for layer in packed] == [WINDOW, None, WINDOW, None]
    for ours, plain, theirs in zip(packed, dense, hf.model.layers, strict=True):
        assert torch.equal(ours.self_attn.sinks, theirs.self_attn.sinks)
        gu = theirs.mlp.experts.gate_up_proj  # [E, H, 2I], gate and up interleaved
        w13 = torch.cat([gu[..., 0::2], gu[..., 1::2]], -1).transpose(1, 2)  # [E, 2I, H] gate | up
        w2 = theirs.mlp.experts.down_proj.transpose(1, 2)  # [E, H, I]
        experts = ours.mlp.experts
        assert isinstance(experts, Mxfp4Experts) and ours.mlp.w13 is None and ours.mlp.w2 is None
        for e in range(E):
            assert torch.equal(experts.w13.expert(e), w13[e]) and torch.equal(experts.w2.expert(e), w2[e])
        assert torch.equal(plain.mlp.w13, w13) and torch.equal(plain.mlp.w2, w2)


PROMPTS = _prompts((3 * WINDOW + 5, 2 * WINDOW + 9, 5, 4 * WINDOW + 3), seed=1)


@pytest.fixture(scope="module")
def reference(hf: Any) -> list[list[int]]:
    return _hf_greedy(hf, PROMPTS)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_parity_staggered_and_chunked(
    folders: tuple[Path, Path], reference: list[list[int]], backend: str
) -> None:
    prompts, ref = PROMPTS, reference
    assert run_staggered(_engine(folders[1], backend), prompts, GREEDY) == ref
    # an 11-token budget: every prompt chunked, chunk edges at every offset against the window edge
    engine = _engine(folders[1], backend, max_num_batched_tokens=11, long_prefill_token_threshold=11)
    assert run_staggered(engine, prompts, GREEDY) == ref
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_parity_under_preemption(folders: tuple[Path, Path], reference: list[list[int]]) -> None:
    # 12 blocks of 8 for every layer hold one or two of these sequences (the full-attention layers keep
    # every block; their KV group gets the bytes the windowed layers' group leaves: server/core/kv_groups.py)
    engine = _engine(folders[1], cache=CacheConfig(block_size=8, num_kv_blocks=12), max_num_batched_tokens=32)
    assert run_staggered(engine, PROMPTS, GREEDY) == reference
    assert engine.stats().num_preemptions > 0
    assert engine.kv.all_free


def test_dense_folder_and_prefix_cache_hit(folders: tuple[Path, Path], hf: Any) -> None:
    """The dense checkpoint (transformers' save) loads too; a shared 4-window prefix is reused."""
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(3, VOCAB, (4 * WINDOW,), generator=g).tolist()
    prompts = [shared + torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 11)]
    ref = _hf_greedy(hf, prompts)
    engine = _engine(
        folders[0], cache=CacheConfig(block_size=8, num_kv_blocks=128, enable_prefix_caching=True)
    )
    assert [engine.generate([p], GREEDY)[0] for p in prompts] == ref
    assert engine.stats().prefix_cache_hits >= 4 * WINDOW


def test_prompt_logprobs_match(folders: tuple[Path, Path], hf: Any) -> None:
    prompt = _prompts((5 * WINDOW + 3,), seed=7)[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1].double()
    ref = logits.log_softmax(-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    engine = _engine(folders[1], max_num_batched_tokens=24, long_prefill_token_threshold=24)
    torch.testing.assert_close(engine_prompt_logprobs(engine, prompt), ref, atol=1e-4, rtol=0)


def test_router_choices_equal_on_every_token(
    folders: tuple[Path, Path], hf: Any, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The biased router's top-2 equals transformers' on every token of every layer (prompt in 11-token
    chunks, then each generated token). Ties (2nd and 3rd logits within 1e-5, which summation order
    could swap) are counted and asserted absent on this seed, so one would be seen, not skipped."""
    from server.models.moe import FusedMoE

    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    original = FusedMoE.route

    def route(self: FusedMoE, x: torch.Tensor) -> Any:
        r = original(self, x)
        logits = torch.nn.functional.linear(x, self.weights.router, self.weights.router_bias).float()
        seen.append((id(self), r.ids.clone(), logits))
        return r

    prompt, out = PROMPTS[0], reference[0]
    engine = _engine(folders[1], max_num_batched_tokens=11, long_prefill_token_threshold=11)
    monkeypatch.setattr(FusedMoE, "route", route)
    assert engine.generate([prompt], GREEDY)[0] == out
    monkeypatch.undo()
    theirs: list[torch.Tensor] = []
    handles = [
        layer.mlp.router.register_forward_hook(lambda _m, _i, o: theirs.append(o[2]))
        for layer in hf.model.layers
    ]
    with torch.no_grad():
        hf(torch.tensor([prompt + out[:-1]]))
    for h in handles:
        h.remove()
    blocks = list(dict.fromkeys(b for b, _, _ in seen))
    assert len(blocks) == len(theirs) == 4
    for blk, ref in zip(blocks, theirs, strict=True):
        mine = torch.cat([ids for b, ids, _ in seen if b == blk])
        logits = torch.cat([lg for b, _, lg in seen if b == blk])
        assert mine.shape == ref.shape == (len(prompt) + len(out) - 1, 2)
        top = logits.sort(dim=-1, descending=True).values
        assert not bool(((top[:, 1] - top[:, 2]).abs() < 1e-5).any())  # no near-tie on this seed
        assert torch.equal(mine.sort(dim=-1).values, ref.sort(dim=-1).values)


@pytest.mark.slow  # one spawned rank (~20 s on a loaded machine)
def test_tensor_parallel_2_dense_experts_sinks_and_windows(
    folders: tuple[Path, Path], reference: list[list[int]]
) -> None:
    """TP=2 over gloo (server/distributed/moe_sharding.py): attention sinks cut with their heads, each
    expert's intermediate split with the down bias on rank 0; greedy equals transformers. The MXFP4
    folder is refused before any rank starts: intermediate 32 over 2 ranks would cut a 32-block."""
    from server.config import ParallelConfig
    from server.distributed.sharding import TensorParallelConfigError

    parallel = ParallelConfig(tensor_parallel_size=2, distributed_timeout_s=60)
    with pytest.raises(TensorParallelConfigError, match=r"MXFP4 .* not a multiple of 32"):
        _engine(folders[1], device="cpu", parallel=parallel)
    engine = _engine(folders[0], device="cpu", num_threads=1, max_num_batched_tokens=11, parallel=parallel)
    try:
        assert engine.loaded.model.model.layers[0].self_attn.sinks.shape == (2,)  # type: ignore[union-attr]
        assert run_staggered(engine, PROMPTS, GREEDY) == reference
    finally:
        engine.close()
