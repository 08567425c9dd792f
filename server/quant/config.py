"""--quantize and a checkpoint's quantization_config -> one validated QuantConfig (or a startup error)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

# --quantize values (TGI's names) that quantize a full-precision checkpoint while loading.
ON_THE_FLY = {
    "int8": "int8",
    "int4": "int4",
    "fp8": "fp8",
    "bitsandbytes": "bitsandbytes",  # TGI: LLM.int8()
    "bitsandbytes-nf4": "bitsandbytes-nf4",
    "bitsandbytes-fp4": "bitsandbytes-fp4",
    # GGUF's block formats (round to nearest, as ggml's reference quantizers), served by our CPU kernel
    "q8_0": "q8_0",
    "q4_0": "q4_0",
    "q4_1": "q4_1",
}
BLOCK_FORMATS = ("q8_0", "q4_0", "q4_1")
PREQUANTIZED = ("awq", "gptq", "fp8")
SUPPORTED_DEVICES = ("cpu", "cuda")
DEFAULT_INT4_GROUP_SIZE = 128


@dataclass(frozen=True)
class QuantConfig:
    method: str  # awq, gptq, fp8, int8, int4, bitsandbytes*, q8_0, q4_0, q4_1
    is_prequantized: bool
    bits: int = 4
    group_size: int = DEFAULT_INT4_GROUP_SIZE  # awq/gptq: from the checkpoint (-1 there = whole column)
    sym: bool = False  # gptq
    desc_act: bool = False  # gptq act-order: g_idx is a permutation of groups
    zero_offset: int = 1  # gptq: 1 for checkpoint_format "gptq" (zeros stored minus one), 0 for "gptq_v2"
    modules_to_not_convert: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        known = set(ON_THE_FLY) | set(PREQUANTIZED)
        if self.method not in known:
            raise ValueError(f"unknown quantization method {self.method!r}; expected one of {sorted(known)}")
        if self.is_prequantized and self.method not in PREQUANTIZED:
            raise ValueError(f"{self.method} is quantized while loading, not read from a checkpoint")
        if not self.is_prequantized and self.method in ("awq", "gptq"):
            raise ValueError(f"{self.method} needs a pre-quantized checkpoint")
        if self.bits != 4 and self.method in ("awq", "gptq"):
            raise ValueError(f"{self.method} with bits={self.bits} is not supported (only 4-bit)")
        if self.group_size != -1 and self.group_size < 8:
            raise ValueError(f"group_size must be -1 or >= 8, got {self.group_size}")
        if self.zero_offset not in (0, 1):
            raise ValueError("zero_offset must be 0 or 1")

    @property
    def bnb_quant_type(self) -> str:
        return {"bitsandbytes": "int8", "bitsandbytes-nf4": "nf4", "bitsandbytes-fp4": "fp4"}[self.method]


def _flag_matches_checkpoint(flag: str, ckpt_method: str) -> bool:
    if flag == ckpt_method:
        return True
    return flag.startswith("bitsandbytes") and ckpt_method == "bitsandbytes"


def _from_checkpoint(cfg: dict[str, Any]) -> QuantConfig:
    method = str(cfg.get("quant_method", "")).lower()
    if method == "awq":
        version = str(cfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ checkpoint version {version!r} is not supported (only the GEMM layout)")
        if not cfg.get("zero_point", True):
            raise ValueError("AWQ checkpoints without zero points (zero_point: false) are not supported")
        return QuantConfig(
            method="awq",
            is_prequantized=True,
            bits=int(cfg.get("bits", cfg.get("w_bit", 4))),
            group_size=int(cfg.get("group_size", cfg.get("q_group_size", 128))),
            modules_to_not_convert=tuple(cfg.get("modules_to_not_convert") or ()),
        )
    if method == "gptq":
        fmt = str(cfg.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (expected gptq or gptq_v2)")
        if cfg.get("lm_head"):
            raise ValueError("GPTQ checkpoints with a quantized lm_head are not supported")
        return QuantConfig(
            method="gptq",
            is_prequantized=True,
            bits=int(cfg.get("bits", 4)),
            group_size=int(cfg.get("group_size", 128)),
            sym=bool(cfg.get("sym", True)),
            desc_act=bool(cfg.get("desc_act", False)),
            zero_offset=1 if fmt == "gptq" else 0,
            modules_to_not_convert=tuple(cfg.get("modules_to_not_convert") or ()),
        )
    if method == "fp8":
        if cfg.get("weight_block_size"):
            raise ValueError(
                "block-wise fp8 checkpoints (weight_block_size) are not supported; per-tensor/channel only"
            )
        if cfg.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(
                "fp8 checkpoints with static activation scales are not supported (weight-only fp8)"
            )
        return QuantConfig(
            method="fp8",
            is_prequantized=True,
            modules_to_not_convert=tuple(cfg.get("modules_to_not_convert") or ()),
        )
    if method == "bitsandbytes":
        raise ValueError(
            "pre-quantized bitsandbytes checkpoints are not supported: load the full-precision model "
            "with --quantize bitsandbytes, bitsandbytes-nf4 or bitsandbytes-fp4 instead"
        )
    raise ValueError(
        f"checkpoint quantization_config.quant_method {method or None!r} is not supported "
        "(supported: awq, gptq, fp8)"
    )


def check_device(method: str, device: torch.device) -> None:
    if device.type not in SUPPORTED_DEVICES:
        raise ValueError(
            f"quantization {method!r} cannot run on device {device.type!r} (supported: cpu, cuda)"
        )
    if method.startswith("bitsandbytes") and importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(
            f"quantization {method!r} needs the bitsandbytes package, which is not installed "
            f"on this {device.type} host (pip install bitsandbytes)"
        )
    if method in BLOCK_FORMATS and device.type != "cpu":
        raise ValueError(f"quantization {method!r} runs on CPU only (the block-quantized CPU kernel)")
    if method == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        raise ValueError(
            f"quantization 'fp8' cannot run on device {device.type!r}: this torch has no float8_e4m3fn"
        )


def resolve_quant_config(
    flag: str | None, checkpoint_cfg: dict[str, Any] | None, device: torch.device
) -> QuantConfig | None:
    """--quantize and the checkpoint's quantization_config -> what to do (raises ValueError on conflicts)."""
    if flag is None and checkpoint_cfg is None:
        return None
    if flag is not None and flag not in ON_THE_FLY and flag not in ("awq", "gptq"):
        raise ValueError(f"--quantize {flag!r} is not one of {sorted(set(ON_THE_FLY) | {'awq', 'gptq'})}")
    qcfg: QuantConfig
    if checkpoint_cfg is not None:
        ckpt_method = str(checkpoint_cfg.get("quant_method", "")).lower()
        if flag is not None and not _flag_matches_checkpoint(flag, ckpt_method):
            raise ValueError(
                f"--quantize {flag} conflicts with the checkpoint, which is already quantized with "
                f"quant_method {ckpt_method!r} (config.json quantization_config): drop --quantize "
                f"or pass --quantize {ckpt_method}"
            )
        qcfg = _from_checkpoint(checkpoint_cfg)
    else:
        assert flag is not None
        if flag in ("awq", "gptq"):
            raise ValueError(
                f"--quantize {flag} needs a pre-quantized {flag.upper()} checkpoint, but the checkpoint has no "
                f"quantization_config: write one with `python -m server.quantize --method {flag} --out DIR`, "
                "or pick an on-the-fly method (int8, int4, fp8, bitsandbytes*)"
            )
        qcfg = QuantConfig(method=ON_THE_FLY[flag], is_prequantized=False)
    check_device(qcfg.method, device)
    return qcfg
