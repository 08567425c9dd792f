"""Prompt logprobs of the chosen tokens, ours and transformers', and prose prompts for the reduced-precision
parity tests (tests/quant/test_bf16_gemm.py, tests/engine/test_kv_cache_dtype_parity.py,
tests/engine/test_bf16_stream.py), and transformers' greedy
tokens of a tiny model folder (the architecture parity tests, tests/models and tests/moe) or of a loaded
transformers model holding the weights a test gave it (the decode-graph tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from server.engine import LLMEngine
from server.request import SamplingParams

TEXT = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in Europe built "
    "wooden frames that riders pushed along with their feet. Pedals came later, first on the front wheel, "
    "which grew larger and larger until the high-wheeled machines of the 1870s made riding fast but "
    "dangerous. The safety bicycle, with two wheels of equal size and a chain driving the rear one, "
    "settled the shape that most bicycles still have. Pneumatic tyres, gears and lighter frames followed, "
    "and within a few decades the bicycle had changed how people in towns and villages travelled to work."
)


def text_prompts(engine: LLMEngine, count: int, length: int) -> list[list[int]]:
    """`count` prompts of up to `length` tokens of English prose (TEXT twice, rotated by 5 words each)."""
    words = TEXT.split()
    out = []
    for i in range(count):
        rotated = " ".join(words[5 * i :] + words[: 5 * i])
        out.append(engine.tokenizer.encode(rotated + " " + rotated)[:length])
    return out


def engine_prompt_logprobs(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:  # [len - 1] float64
    engine.add_request("plp", prompt, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    found = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.prompt_logprobs is not None:
                found = o.prompt_logprobs
    assert found is not None and found[0] is None
    return torch.tensor([lp.chosen.logprob for lp in found[1:] if lp is not None], dtype=torch.float64)


def hf_prompt_logprobs(
    folder: Path, prompt: list[int], dtype: torch.dtype
) -> torch.Tensor:  # [len - 1] float64
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1].double()
    return logits.log_softmax(-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def model_greedy(model: Any, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """A loaded transformers model's greedy continuation of each prompt, exactly `lengths[i]` new tokens
    (eos does not stop it): for engines whose weights were put into `model` by the test."""
    outs = []
    with torch.inference_mode():
        for p, n in zip(prompts, lengths, strict=True):
            ids = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
            outs.append(ids[0, len(p) :].tolist())
    return outs


def hf_greedy(folder: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' fp32 greedy continuation of each prompt: up to `n` new tokens, stopping at token 2
    (the tiny models' eos)."""
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


def hf_on_our_weights(folder: Path, engine: LLMEngine) -> Any:
    """transformers' model of `folder` (fp32, eager attention) with every weight our engine quantized
    replaced by its dequantized values: projections (fused q/k/v and gate/up split back where the
    checkpoint keeps them apart), block-quantized experts as transformers' stacked expert tensors, and
    Qwen2-MoE's shared expert (gate rows then up rows); routers, norms and float weights stay the
    checkpoint's. AssertionError for a quantized weight transformers has no place for."""
    from transformers import AutoModelForCausalLM

    from server.models.moe import BlockQuantExperts, SparseMoeBlock
    from server.quant.block_linear import BlockQuantLinear
    from server.quant.cpu_qlinear import dequantize_reference

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager")
    arch = engine.loaded.arch
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    state = hf.state_dict()
    new: dict[str, torch.Tensor] = {}
    for name, m in engine.loaded.model.named_modules():
        prefix, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        if isinstance(m, SparseMoeBlock):
            if isinstance(m.experts, BlockQuantExperts):
                new[f"{name}.experts.gate_up_proj"] = torch.stack(
                    [dequantize_reference(w) for w in m.experts.w13]
                )
                new[f"{name}.experts.down_proj"] = torch.stack(
                    [dequantize_reference(w) for w in m.experts.w2]
                )
            continue
        if not isinstance(m, BlockQuantLinear):
            continue
        w = dequantize_reference(m.weight_q)  # [out, in] fp32
        if leaf == "shared_gate_up":
            for part, rows in zip(("gate_proj", "up_proj"), w.chunk(2), strict=True):
                new[f"{prefix}.shared_expert.{part}.weight"] = rows
        elif leaf == "shared_down":
            new[f"{prefix}.shared_expert.down_proj.weight"] = w
        elif f"{name}.weight" in state:
            new[f"{name}.weight"] = w
        elif leaf == "qkv_proj":
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), w.split((q, kv, kv)), strict=True):
                new[f"{prefix}.{part}.weight"] = rows
        elif leaf == "gate_up_proj":
            for part, rows in zip(("gate_proj", "up_proj"), w.chunk(2), strict=True):
                new[f"{prefix}.{part}.weight"] = rows
        else:
            raise AssertionError(f"no transformers weight for {name}")
    assert set(new) <= set(state), sorted(set(new) - set(state))[:3]
    hf.load_state_dict(new, strict=False)
    return hf
