"""The MoE architectures under the engine's other features, one request each on a tiny model of each of
the four (Mixtral, Qwen2-MoE with its shared expert and a dense layer, Qwen3-MoE with dense layers
between sparse ones: tests/moe/moe_models.py; gpt-oss with sinks, alternating windows and its biased
router: tests/models/test_gpt_oss.py's dense folder): LoRA on attention (equal to transformers + peft),
n-gram speculation and a grammar (equal to transformers greedy, unconstrained and under xgrammar's
processor); what is refused at start-up (a LoRA adapter for a MoE layer's MLP, --quantize); and the
config translation (which layers are sparse, the parameter count)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_adapters import make_adapter, peft_greedy
from moe_models import PROMPTS, build, moe_config, moe_engine
from prompt_logprobs import hf_greedy
from safetensors.torch import load_file, save_file

from server.config import LoRAConfig, LoRAModule
from server.lora.adapter import LoRAAdapterError, load_adapter
from server.models.layer_spec import UnsupportedModelError
from server.models.registry import arch_from_hf
from server.request import GrammarSpec, SamplingParams
from server.spec_decode.config import SpeculativeConfig

NEW = 10
SPEC_NEW = 24


KINDS = ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            root = tmp_path_factory.mktemp(f"tiny-{kind}")
            if kind == "gpt_oss":  # its dense folder: transformers and peft read it as it is
                from models.test_gpt_oss import build_gpt_oss

                made[kind] = build_gpt_oss(root, smollm2_dir)[0]
            else:
                made[kind] = build(root, smollm2_dir, kind)
        return made[kind]

    return make


@pytest.fixture(scope="module")
def qwen2_moe(tiny: Callable[[str], Path]) -> Path:
    return tiny("qwen2_moe")


def _hf_config(kind: str, **over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = moe_config(kind).to_dict()
    cfg.update(over)
    return cfg


@pytest.mark.parametrize(
    ("kind", "over", "sparse"),
    [
        ("mixtral", {}, [0, 1, 2, 3]),
        ("qwen2_moe", {}, [0, 2, 3]),
        ("qwen2_moe", {"decoder_sparse_step": 2, "mlp_only_layers": [3]}, [1]),
        ("qwen3_moe", {}, [1, 3]),
        ("qwen3_moe", {"decoder_sparse_step": 1, "mlp_only_layers": []}, [0, 1, 2, 3]),
    ],
)
def test_sparse_layers_and_parameter_count(kind: str, over: dict[str, Any], sparse: list[int]) -> None:
    from transformers import AutoModelForCausalLM

    cfg = _hf_config(kind, **over)
    arch = arch_from_hf(cfg)
    assert [i for i, s in enumerate(arch.layers) if s.mlp == "moe"] == sparse
    assert not arch.is_llama  # the fused CPU ops and the decode graph are not used
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(moe_config(kind).__class__.from_dict(cfg))
    assert arch.num_parameters == sum(p.numel() for p in hf.parameters())


def test_config_json_names_and_refusals() -> None:
    cfg = _hf_config("qwen3_moe")
    # Qwen's shipped configs write num_experts; transformers 5 saves num_local_experts
    cfg["num_experts"] = cfg.pop("num_local_experts")
    arch = arch_from_hf(cfg)
    assert arch.moe is not None and arch.moe.num_experts == 8 and arch.moe.renormalize and arch.qk_norm
    assert arch_from_hf(_hf_config("qwen2_moe")).qkv_bias
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        arch_from_hf(_hf_config("qwen2_moe", use_sliding_window=True, sliding_window=64))
    with pytest.raises(UnsupportedModelError, match="only silu-gated experts"):
        arch_from_hf(_hf_config("mixtral", hidden_act="gelu"))


def test_quantize_other_than_int8_is_refused(qwen2_moe: Path) -> None:
    # int8 reaches the experts (tests/moe/test_moe_quantize.py); fp8 does not yet
    with pytest.raises(UnsupportedModelError, match=r"\(--quantize fp8\) does not reach mixture-of-experts"):
        moe_engine(qwen2_moe, quantize="fp8")


@pytest.mark.parametrize("kind", KINDS)
def test_lora_on_attention_matches_peft_and_moe_mlp_targets_are_refused(
    tiny: Callable[[str], Path], tmp_path: Path, kind: str
) -> None:
    folder = tiny(kind)
    adapter = make_adapter(folder, tmp_path / "attn", 4, ("q_proj", "v_proj"), seed=1, std=0.15)
    engine = moe_engine(
        folder,
        lora=LoRAConfig(enable_lora=True, lora_modules=(LoRAModule("attn", str(adapter)),), max_lora_rank=8),
    )
    prompts = [engine.tokenizer.encode(PROMPTS[1])]
    ref = peft_greedy(folder, adapter, prompts, NEW)
    assert ref != peft_greedy(folder, None, prompts, NEW)  # the adapter changes the output
    assert engine.lora is not None
    params = SamplingParams(max_tokens=NEW, temperature=0.0)
    assert engine.generate(prompts, params, [engine.lora.get("attn")]) == ref
    if kind != "qwen2_moe":
        return
    # the same adapter plus a gate_proj pair for layer 0, whose MLP is the MoE block
    bad = tmp_path / "moe-mlp"
    shutil.copytree(adapter, bad)
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    arch = engine.loaded.arch
    pre = "base_model.model.model.layers.0.mlp.gate_proj"
    tensors[f"{pre}.lora_A.weight"] = torch.zeros(4, arch.hidden_size)
    tensors[f"{pre}.lora_B.weight"] = torch.zeros(arch.intermediate_size, 4)
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match="layer 0's MLP is a mixture of experts"):
        load_adapter("bad", bad, arch, 8, torch.float32)


@pytest.mark.parametrize("kind", KINDS)
def test_ngram_speculation_and_a_grammar_equal_transformers(tiny: Callable[[str], Path], kind: str) -> None:
    import xgrammar.contrib.hf as xhf
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    folder = tiny(kind)
    spec = moe_engine(
        folder, speculative=SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=3)
    )
    prompt = spec.tokenizer.encode("a b c d e f a b c d e f a b c")
    # long enough that each model's continuation repeats one of its tokens (gpt-oss's at its 15th), so
    # drafts are proposed; prompt tokens alone are not copied by every random model
    params = SamplingParams(max_tokens=SPEC_NEW, temperature=0.0)
    assert spec.generate([prompt], params) == hf_greedy(folder, [prompt], SPEC_NEW)
    assert spec.stats().spec_num_draft_tokens > 0

    grammar = GrammarSpec("choice", json.dumps(["north", "south", "east by west"]))
    prompt = spec.tokenizer.encode(PROMPTS[0])
    got = spec.generate([prompt], SamplingParams(max_tokens=NEW, temperature=0.0, structured=grammar))[0]
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    proc = xhf.LogitsProcessor(spec.grammars.compile(grammar))
    with torch.no_grad():
        ids = hf.generate(  # type: ignore[misc]
            torch.tensor([prompt]),
            max_new_tokens=NEW,
            do_sample=False,
            logits_processor=LogitsProcessorList([proc]),
            eos_token_id=2,
            pad_token_id=2,
        )
    assert got == ids[0, len(prompt) :].tolist()
    assert spec.tokenizer.decode(got, skip_special_tokens=True) in ("north", "south", "east by west")


def test_quantized_experts_count_in_the_weight_bytes() -> None:
    """A MoE block's quantized experts live outside its parameters; weight_bytes (/info, the start-up
    log) counts them."""
    from server.models.moe.block import SparseMoeBlock
    from server.models.moe.config import MoEConfig
    from server.models.moe.quant import BlockQuantExperts
    from server.quant import weight_bytes

    block = SparseMoeBlock(MoEConfig("mixtral", 4, 2, 64, 32))
    for p in block.parameters():
        p.data.normal_(0.0, 0.1)
    experts = BlockQuantExperts.quantize(block.expert_weights(), "q8_0")
    block.set_experts(experts)
    router = block.router.numel() * block.router.element_size()
    assert weight_bytes(block) == router + experts.nbytes()
    x = torch.randn(3, 64)
    assert block(x).shape == (3, 64)


def test_embedding_pass_runs_the_moe_layers(qwen2_moe: Path) -> None:
    """--task embed's dense causal pass (server/pooling/decoder.py) over [B, S, H] batches: the MoE
    block takes any leading shape; hidden states equal transformers' last hidden state."""
    from transformers import AutoModelForCausalLM

    from server.models.loader import load_model
    from server.pooling.decoder import DecoderEncoder

    loaded = load_model(qwen2_moe, torch.float32, torch.device("cpu"), max_positions=64, embedding_only=True)
    ids = torch.randint(3, 1000, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ours = DecoderEncoder(loaded.model)(ids, torch.zeros_like(ids), mask)
        hf = AutoModelForCausalLM.from_pretrained(str(qwen2_moe), dtype=torch.float32)
        ref = hf.model(ids).last_hidden_state  # type: ignore[operator]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
