"""Reading and validating one PEFT LoRA adapter folder (`adapter_config.json` + `adapter_model.safetensors`).

Format: Hugging Face PEFT (`peft.LoraConfig`, weights saved by `PeftModel.save_pretrained`), whose
tensor names are `base_model.model.<module>.lora_A.weight` ([r, in_features]) and `...lora_B.weight`
([out_features, r]). The delta of one module is `scaling * x @ A.T @ B.T` with `scaling = alpha / r`, or
`alpha / sqrt(r)` under rsLoRA (`use_rslora`); `rank_pattern` / `alpha_pattern` override r and alpha per
module, resolved with peft's own matcher. We fold `scaling` into B at load time, so serving adds
`(x @ A.T) @ B_scaled.T`.

Only what our model can serve is accepted: LoRA on the q/k/v/o/gate/up/down projections of the decoder
layers. DoRA, LoRA biases, `modules_to_save`, embeddings or lm_head deltas are refused with a clear
`LoRAAdapterError` rather than silently ignored.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from server.models.arch import ArchConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
# Phi-3's checkpoint (and so peft's target names) fuses q/k/v and gate/up: such an adapter's lora_B rows
# split exactly into the parts' (one shared lora_A), the projections our layers hold.
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
TARGET_MODULES = ATTN_MODULES + MLP_MODULES + tuple(FUSED_MODULES)

_KEY = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight"
)


class LoRAAdapterError(ValueError):
    """The adapter cannot be served on this base model (bad path, format, shapes or rank)."""


def module_shapes(arch: ArchConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each LoRA-able projection of one decoder layer."""
    h, i, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    q, kv = arch.num_heads * d, arch.num_kv_heads * d
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
        "qkv_proj": (h, q + 2 * kv),
        "gate_up_proj": (h, 2 * i),
    }


@dataclass(frozen=True)
class LoRAModuleWeights:
    a: Tensor  # [r, in_features], model dtype
    b: Tensor  # [out_features, r], model dtype, scaling folded in


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter's weights, keyed by (layer index, module name such as "q_proj")."""

    name: str
    path: Path
    rank: int  # the largest rank over its modules
    weights: dict[tuple[int, str], LoRAModuleWeights]

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.weights.values())

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(sorted({m for _, m in self.weights}))


@dataclass(frozen=True)
class _Scaling:
    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]


def _read_config(folder: Path) -> _Scaling:
    from peft import LoraConfig, PeftConfig

    try:
        cfg = PeftConfig.from_pretrained(str(folder))
    except Exception as e:
        raise LoRAAdapterError(f"invalid {ADAPTER_CONFIG} in {folder}: {type(e).__name__}: {e}") from e
    if not isinstance(cfg, LoraConfig):
        raise LoRAAdapterError(f"adapter {folder} is a {cfg.peft_type} adapter; only LoRA is served")
    refused = {
        "use_dora": "DoRA adapters",
        "lora_bias": "LoRA biases (lora_bias)",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D) adapters",
        "modules_to_save": "modules_to_save (fully trained extra modules)",
    }
    for attr, what in refused.items():
        if getattr(cfg, attr, None):
            raise LoRAAdapterError(f"adapter {folder}: {what} are not supported")
    if getattr(cfg, "bias", "none") != "none":
        raise LoRAAdapterError(f"adapter {folder}: bias={cfg.bias!r} is not supported (only 'none')")
    return _Scaling(
        r=int(cfg.r),
        lora_alpha=float(cfg.lora_alpha),
        use_rslora=bool(cfg.use_rslora),
        rank_pattern=dict(cfg.rank_pattern or {}),
        alpha_pattern=dict(cfg.alpha_pattern or {}),
    )


def resolve_adapter_path(path: str, cache_dir: Path | None = None) -> Path:
    """A local folder, or a hub repo id fetched into the model cache. Raises LoRAAdapterError."""
    folder = Path(path).expanduser()
    if folder.is_dir():
        return folder
    if folder.exists():
        raise LoRAAdapterError(f"LoRA path {path} is not a folder")
    if re.fullmatch(r"[\w.-]+/[\w.-]+", path) and not path.startswith((".", "/")):
        return fetch_hub_adapter(path, cache_dir)
    raise LoRAAdapterError(f"No adapter found for {path}: the folder does not exist")


def fetch_hub_adapter(repo_id: str, cache_dir: Path | None = None) -> Path:
    """A hub adapter's snapshot folder under `<cache_dir>/hub` (fetched unless cached; HF_TOKEN).
    Raises LoRAAdapterError."""
    from huggingface_hub import snapshot_download

    from server.config import default_cache_dir

    try:
        return Path(
            snapshot_download(
                repo_id,
                cache_dir=str((cache_dir or default_cache_dir()) / "hub"),
                allow_patterns=[ADAPTER_CONFIG, ADAPTER_WEIGHTS],
                token=os.environ.get("HF_TOKEN") or None,
            )
        )
    except Exception as e:
        raise LoRAAdapterError(
            f"LoRA path {repo_id}: not a local folder, and fetching it from the hub failed: "
            f"{type(e).__name__}: {e}"
        ) from e


def load_adapter(
    name: str,
    folder: Path,
    arch: ArchConfig,
    max_rank: int,
    dtype: torch.dtype,
) -> LoRAAdapter:
    """Read and check an adapter against the base model. Raises LoRAAdapterError for any mismatch:
    missing files, a corrupt safetensors file, unknown modules, wrong shapes, rank above max_rank."""
    from peft.utils.other import get_pattern_key
    from safetensors.torch import load_file

    if not (folder / ADAPTER_CONFIG).is_file():
        raise LoRAAdapterError(f"No adapter found for {folder}: {ADAPTER_CONFIG} is missing")
    weights_file = folder / ADAPTER_WEIGHTS
    if not weights_file.is_file():
        raise LoRAAdapterError(f"adapter {folder}: {ADAPTER_WEIGHTS} is missing")
    cfg = _read_config(folder)
    try:
        tensors = load_file(str(weights_file))
    except Exception as e:
        raise LoRAAdapterError(
            f"adapter {folder}: cannot read {ADAPTER_WEIGHTS}: {type(e).__name__}: {e}"
        ) from e
    shapes = module_shapes(arch)
    pairs: dict[tuple[int, str], dict[str, Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None or m.group(3) not in TARGET_MODULES:
            raise LoRAAdapterError(
                f"adapter {folder}: tensor {key!r} is not a LoRA weight of a q/k/v/o/gate/up/down (or fused qkv/gate_up) projection"
            )
        layer, module = int(m.group(1)), m.group(3)
        if layer >= arch.num_layers:
            raise LoRAAdapterError(
                f"adapter {folder}: layer {layer} does not exist (the base model has {arch.num_layers})"
            )
        if module in MLP_MODULES and arch.layers[layer].mlp == "moe":
            raise LoRAAdapterError(
                f"adapter {folder}: layer {layer}'s MLP is a mixture of experts; LoRA on its "
                f"{module} (expert weights) is not supported, only on q/k/v/o and dense MLP layers"
            )
        pairs.setdefault((layer, module), {})[m.group(4)] = t
    if not pairs:
        raise LoRAAdapterError(f"adapter {folder}: no LoRA weights in {ADAPTER_WEIGHTS}")
    out: dict[tuple[int, str], LoRAModuleWeights] = {}
    max_seen = 0
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"adapter {folder}: layer {layer} {module} lacks lora_A or lora_B")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes[module]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or b.shape != (fan_out, r):
            raise LoRAAdapterError(
                f"adapter {folder}: layer {layer} {module} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}; the base model needs [r, {fan_in}] and [{fan_out}, r] "
                "(an adapter for another model?)"
            )
        if r > max_rank:
            raise LoRAAdapterError(
                f"LoRA rank {r} is greater than max_lora_rank {max_rank} (adapter {name!r})"
            )
        attn = module in ATTN_MODULES or module == "qkv_proj"
        full_name = f"model.layers.{layer}.{'self_attn' if attn else 'mlp'}.{module}"
        cfg_r, alpha = cfg.r, cfg.lora_alpha
        if cfg.rank_pattern:  # per-module overrides, matched as peft matches them
            cfg_r = int(cfg.rank_pattern.get(get_pattern_key(list(cfg.rank_pattern), full_name), cfg_r))
        if cfg.alpha_pattern:
            alpha = float(cfg.alpha_pattern.get(get_pattern_key(list(cfg.alpha_pattern), full_name), alpha))
        if cfg_r != r:
            raise LoRAAdapterError(
                f"adapter {folder}: layer {layer} {module} has rank {r} but its config says r={cfg_r}"
            )
        scaling = alpha / math.sqrt(r) if cfg.use_rslora else alpha / r
        b_scaled = b.to(torch.float32) * scaling
        if not (torch.isfinite(a).all() and torch.isfinite(b_scaled).all()):
            raise LoRAAdapterError(f"adapter {folder}: layer {layer} {module} has non-finite weights")
        parts = FUSED_MODULES.get(module, (module,))
        rows = b_scaled.split([shapes[p][1] for p in parts])
        for part, b_part in zip(parts, rows, strict=True):
            if (layer, part) in out or (part != module and (layer, part) in pairs):
                raise LoRAAdapterError(
                    f"adapter {folder}: layer {layer} {part} is given twice (fused and alone)"
                )
            out[(layer, part)] = LoRAModuleWeights(
                a=a.to(dtype).contiguous(), b=b_part.to(dtype).contiguous()
            )
        max_seen = max(max_seen, r)
    return LoRAAdapter(name=name, path=folder, rank=max_seen, weights=out)
