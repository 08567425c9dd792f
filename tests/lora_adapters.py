"""Builds PEFT LoRA adapters for tests (random non-zero A and B) and runs the transformers + peft reference."""

from __future__ import annotations

from pathlib import Path

import torch


def make_adapter(
    base: Path,
    out: Path,
    rank: int,
    targets: tuple[str, ...],
    seed: int,
    alpha: float = 16.0,
    rslora: bool = False,
    std: float = 0.05,
) -> Path:
    """Save a LoRA adapter for the model in `base` with peft; A and B drawn from N(0, std)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    cfg = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora, lora_dropout=0.0
    )
    peft_model = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    peft_model.save_pretrained(str(out))
    return out


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers (+ peft when `adapter` is given) greedy continuation of each prompt, one at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    model.generation_config.eos_token_id = model.config.eos_token_id
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(
                input_ids=torch.tensor([p]), max_new_tokens=n, do_sample=False, min_new_tokens=0
            )
            outs.append(ids[0, len(p) :].tolist())
    return outs
