"""llama.cpp's `gpt-oss` GGUF layout (convert_hf_to_gguf.py's GptOssModel; gguf-py's MODEL_TENSORS,
MXFP4 type 39): a tiny random gpt-oss (tests/models/test_gpt_oss.py's) written with gguf-py from its
MXFP4 checkpoint, experts as MXFP4 blocks (ggml's order: the e8m0 byte, then 16 bytes of codes, low
nibbles elements 0-15), everything else F32, metadata as the converter writes it, SmolLM2's tokenizer
keys. Served as it is on CPU, experts kept MXFP4 through the kernel: greedy tokens equal to transformers
on the dense twin, prompt logprobs within 1e-4 (every weight is exact in the file: only summation
order differs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf_vocab import add_embedded_tokenizer
from models.test_gpt_oss import GREEDY, WINDOW, _hf_greedy, _prompts, build_gpt_oss
from prompt_logprobs import engine_prompt_logprobs

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine

pytestmark = pytest.mark.slow  # ~75 s at load 7 here: SmolLM2's 49k-token vocabulary written, read, converted

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.sinks": "attn_sinks.weight",
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
    "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
    **{
        f"self_attn.{p}_proj.{s}": f"attn_{'output' if p == 'o' else p}.{s}"
        for p in "qkvo"
        for s in ("weight", "bias")
    },
}


def _ggml_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """[E, N, G, 16] (transformers' nibble order) + [E, N, G] -> ggml block_mxfp4 bytes [E, N, G * 17]."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*blocks.shape[:-1], 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    raw = torch.cat([scales[..., None], qs], dim=-1)
    return raw.reshape(*raw.shape[:2], -1).numpy()


def write_gpt_oss_gguf(folder: Path, out: Path, attn_fmt: str = "F32") -> Path:
    """The MXFP4 checkpoint in `folder` as llama.cpp's converter lays it out; `attn_fmt` "Q8_0" writes the
    attention projections' weights as llama-quantize would (gguf-py's reference quantizer)."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    rope = cfg["rope_parameters"]
    w = gguf.GGUFWriter(str(out), "gpt-oss")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_sliding_window(cfg["sliding_window"])
    add_embedded_tokenizer(w)

    def f32(name: str, t: torch.Tensor) -> None:
        w.add_tensor(name, np.ascontiguousarray(t.float().numpy()))

    f32("token_embd.weight", state["model.embed_tokens.weight"])
    f32("output_norm.weight", state["model.norm.weight"])
    f32("output.weight", state["lm_head.weight"])
    for n in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{n}."
        for hf, gg in _LAYER.items():
            if attn_fmt != "F32" and hf.startswith("self_attn.") and hf.endswith("_proj.weight"):
                qtype = gguf.GGMLQuantizationType[attn_fmt]
                data = gguf.quants.quantize(state[pre + hf].float().numpy(), qtype)
                w.add_tensor(f"blk.{n}.{gg}", data, raw_dtype=qtype)
            else:
                f32(f"blk.{n}.{gg}", state[pre + hf])
        gu_bias = state[pre + "mlp.experts.gate_up_proj_bias"]  # [E, 2I], gate and up interleaved
        f32(f"blk.{n}.ffn_gate_exps.bias", gu_bias[:, 0::2])
        f32(f"blk.{n}.ffn_up_exps.bias", gu_bias[:, 1::2])
        blocks, scales = (
            state[pre + "mlp.experts.gate_up_proj_blocks"],
            state[pre + "mlp.experts.gate_up_proj_scales"],
        )
        mx = gguf.GGMLQuantizationType.MXFP4
        w.add_tensor(
            f"blk.{n}.ffn_gate_exps.weight", _ggml_mxfp4(blocks[:, 0::2], scales[:, 0::2]), raw_dtype=mx
        )
        w.add_tensor(
            f"blk.{n}.ffn_up_exps.weight", _ggml_mxfp4(blocks[:, 1::2], scales[:, 1::2]), raw_dtype=mx
        )
        down = _ggml_mxfp4(
            state[pre + "mlp.experts.down_proj_blocks"], state[pre + "mlp.experts.down_proj_scales"]
        )
        w.add_tensor(f"blk.{n}.ffn_down_exps.weight", down, raw_dtype=mx)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> tuple[Path, Path]:
    """(the dense folder transformers reads, the GGUF file)."""
    root = tmp_path_factory.mktemp("gpt-oss-gguf")
    dense, packed = build_gpt_oss(root, smollm2_dir)
    return dense, write_gpt_oss_gguf(packed, root / "gpt-oss-tiny-MXFP4.gguf")


@pytest.fixture(scope="module")
def hf(files: tuple[Path, Path]) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(files[0]), dtype=torch.float32, attn_implementation="eager"
    )
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def engine(files: tuple[Path, Path]) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(files[1]), max_model_len=512),
            cache=CacheConfig(cache_dtype="float32", block_size=8, num_kv_blocks=128),
            max_num_batched_tokens=24,
            long_prefill_token_threshold=24,
        )
    )


def test_loads_as_gpt_oss_with_mxfp4_experts_on_the_kernel(engine: LLMEngine, hf: Any) -> None:
    from server.models.moe import Mxfp4Experts

    loaded = engine.loaded
    assert loaded.arch.architecture == "GptOssForCausalLM"
    assert loaded.quantization is not None and "mxfp4" in loaded.quantization
    layers: list[Any] = list(loaded.model.decoder_layers())
    assert [layer.self_attn.sliding_window for layer in layers] == [WINDOW, None, WINDOW, None]
    for ours, theirs in zip(layers, hf.model.layers, strict=True):
        assert torch.equal(ours.self_attn.sinks, theirs.self_attn.sinks)
        experts = ours.mlp.experts
        assert isinstance(experts, Mxfp4Experts) and experts.kernel is not None and ours.mlp.w13 is None
        gu = theirs.mlp.experts.gate_up_proj  # [E, H, 2I], gate and up interleaved
        w13 = torch.cat([gu[..., 0::2], gu[..., 1::2]], -1).transpose(1, 2)
        for e in range(w13.shape[0]):
            assert torch.equal(experts.w13.expert(e), w13[e])
            assert torch.equal(experts.w2.expert(e), theirs.mlp.experts.down_proj[e].t())


def test_greedy_and_prompt_logprobs_match_transformers(engine: LLMEngine, hf: Any) -> None:
    """Guard: a gpt-oss GGUF was refused before (no config reader, no tensor layout, MXFP4 not kept)."""
    prompts = _prompts((3 * WINDOW + 5, 2 * WINDOW + 9, 5), seed=11)
    assert engine.generate(prompts, GREEDY) == _hf_greedy(hf, prompts)
    prompt = _prompts((4 * WINDOW + 3,), seed=12)[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1].double()
    ref = logits.log_softmax(-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(engine_prompt_logprobs(engine, prompt), ref, atol=1e-4, rtol=0)
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks
