"""Hugging Face SmolLM3: the Llama layer, except that the layers whose `no_rope_layers` entry is 0 use no
rotary embedding at all (NoPE; transformers' modeling_smollm3.py: `use_rope = no_rope_layers[i]`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from server.models.arch import ArchConfig
from server.models.architecture import Architecture
from server.models.layer_spec import UnsupportedModelError


def configure(cfg: dict[str, Any], base: ArchConfig) -> ArchConfig:
    n = base.num_layers
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval", 4))  # transformers' default list
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if len(flags) != n:
        raise UnsupportedModelError(f"no_rope_layers has {len(flags)} entries for {n} layers")
    spec = base.layers[0]
    layers = tuple(spec if flag else replace(spec, rope=None) for flag in flags)
    return replace(base, layers=layers)


SMOLLM3 = Architecture(
    "SmolLM3ForCausalLM", "smollm3", configure, ("layers without RoPE (no_rope_layers)",), gguf=True
)
