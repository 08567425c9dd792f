"""Our own AWQ / GPTQ quantizer: a full-precision model in, a checkpoint in the exact AutoAWQ (GEMM) or
AutoGPTQ (v1) on-disk format out, servable with `python -m server --model DIR`.

CLI: python -m server.quantize --method awq|gptq|rtn [--model M] --out DIR
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from server.models.loader import load_model, read_hf_config, resolve_model
from server.quant import iter_projections
from server.quant.formats import Int4Weights, awq_encode, gptq_encode
from server.quantize.algorithms import AwqOptions, GptqOptions, awq_layer, gptq_layer, linear, rtn_layer
from server.quantize.calibration import CALIBRATION_TEXT
from server.quantize.evaluation import SequenceRunner
from server.tokenizer import Tokenizer

log = logging.getLogger(__name__)

METHODS = ("awq", "gptq", "rtn")
_SKIP_FILES = {"config.json", "quantize_config.json", "quant_config.json", "model.safetensors.index.json"}


@dataclass(frozen=True)
class QuantizeOptions:
    method: str  # awq | gptq | rtn (round-to-nearest, written in the AWQ layout: the baseline)
    group_size: int | None = None  # None = 128 if it divides every projection's in_features, else 64, 32
    sym: bool = (
        False  # gptq only (AWQ is always asymmetric); see docs/quantization.md for why not AutoGPTQ's True
    )
    act_order: bool = False  # gptq desc_act
    calib_tokens: int = 512
    damp_percent: float = 0.1  # gptq; AutoGPTQ's 0.01 overfits a calibration text this small
    awq_clip: bool = True
    awq_grid: int = 20  # scale exponents tried (and clipping ratios: half as many)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.group_size is not None and self.group_size not in (32, 64, 128):
            raise ValueError(f"group_size must be 32, 64 or 128, got {self.group_size}")
        if self.calib_tokens < 16:
            raise ValueError("calib_tokens must be >= 16")
        if self.awq_grid < 2:
            raise ValueError("awq_grid must be >= 2")
        if not 0 < self.damp_percent < 1:
            raise ValueError("damp_percent must be in (0, 1)")


@dataclass(frozen=True)
class QuantizeResult:
    out: Path
    method: str
    group_size: int
    calib_tokens: int
    seconds: float


def calibration_ids(tokenizer: Tokenizer, num_tokens: int, text: str = CALIBRATION_TEXT) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < num_tokens:  # a short text is repeated rather than silently using fewer tokens
        ids = ids + ids
    return ids[:num_tokens]


def _auto_group_size(in_features: list[int]) -> int:
    for g in (128, 64, 32):
        if all(k % g == 0 for k in in_features):
            return g
    raise ValueError(
        f"no 4-bit group size among 128, 64, 32 divides every in_features {sorted(set(in_features))}"
    )


def quantize_model(model: str | None, out: Path, opts: QuantizeOptions) -> QuantizeResult:
    t0 = time.monotonic()
    source = resolve_model(model)
    existing = read_hf_config(source.folder).get("quantization_config")
    if existing is not None:
        raise ValueError(
            f"{source.folder} is already quantized (quant_method {existing.get('quant_method')!r}): "
            "quantize from a full-precision checkpoint"
        )
    loaded = load_model(source.folder, torch.float32, torch.device("cpu"), opts.calib_tokens + 1)
    if not loaded.arch.is_llama:
        # the calibration runner (evaluation.py) runs the Llama layer; another would be calibrated wrongly
        raise ValueError(
            f"{loaded.arch.architecture}: calibrated quantization runs the Llama layer only "
            "(docs/models.md); serve it with --quantize instead"
        )
    net = loaded.model
    projections = list(iter_projections(net))
    group = opts.group_size or _auto_group_size([p.module.in_features for p in projections])  # type: ignore[misc]
    bad = [p.name for p in projections if p.module.in_features % group]  # type: ignore[operator]
    if bad:
        raise ValueError(f"group_size {group} does not divide in_features of {bad[:3]}")
    ids = torch.tensor(calibration_ids(Tokenizer(source.folder), opts.calib_tokens), dtype=torch.int64)
    runner = SequenceRunner(net, ids.numel())
    quantized: dict[str, Int4Weights] = {}
    with torch.no_grad():
        h = runner.embed(ids)
        layers = net.decoder_layers()
        for i, layer in enumerate(layers):
            if opts.method == "awq":
                # Inputs of the next layer come from the full-precision layer, as in AutoAWQ.
                h_next = runner.layer(layer, h)
                result = awq_layer(
                    runner,
                    layer,
                    h,
                    AwqOptions(group, grid=opts.awq_grid, clip=opts.awq_clip, clip_grid=opts.awq_grid),
                )
            elif opts.method == "gptq":
                result = gptq_layer(
                    runner,
                    layer,
                    h,
                    GptqOptions(
                        group, sym=opts.sym, act_order=opts.act_order, damp_percent=opts.damp_percent
                    ),
                )
                # Inputs of the next layer come from this layer quantized, as in AutoGPTQ.
                h_next = runner.layer(layer, h)
            else:
                result = rtn_layer(layer, group)
                h_next = h
            for name, w in result.items():
                quantized[f"model.layers.{i}.{name}"] = w
            h = h_next
            log.info("quantized layer %d/%d", i + 1, len(layers))
    write_checkpoint(net, quantized, opts, group, source.folder, out)
    return QuantizeResult(out, opts.method, group, int(ids.numel()), time.monotonic() - t0)


def quantization_config(opts: QuantizeOptions, group_size: int) -> dict[str, object]:
    """config.json `quantization_config`, with the keys AutoAWQ / AutoGPTQ (via transformers) write."""
    if opts.method in ("awq", "rtn"):
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "damp_percent": opts.damp_percent,
        "desc_act": opts.act_order,
        "static_groups": False,
        "sym": opts.sym,
        "true_sequential": True,
        "checkpoint_format": "gptq",
        "model_name_or_path": None,
        "model_file_base_name": None,
    }


def write_checkpoint(
    model: torch.nn.Module,
    quantized: dict[str, Int4Weights],
    opts: QuantizeOptions,
    group_size: int,
    source: Path,
    out: Path,
) -> None:
    state: dict[str, torch.Tensor] = {}
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    for name, tensor in model.state_dict().items():
        module_name = name.rpartition(".")[0]
        if module_name in quantized or "rotary" in name or (tied and name == "lm_head.weight"):
            continue
        state[name] = tensor.detach().to(torch.float16).contiguous()
    for name, w in quantized.items():
        bias = linear(model, name).bias
        if opts.method == "gptq":
            g = gptq_encode(w)
            state.update(
                {
                    f"{name}.qweight": g.qweight,
                    f"{name}.qzeros": g.qzeros,
                    f"{name}.scales": g.scales,
                    f"{name}.g_idx": g.g_idx,
                }
            )
        else:
            a = awq_encode(w)
            state.update(
                {f"{name}.qweight": a.qweight, f"{name}.qzeros": a.qzeros, f"{name}.scales": a.scales}
            )
        if bias is not None:
            state[f"{name}.bias"] = bias.detach().to(torch.float16).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((source / "config.json").read_text())
    qc = quantization_config(opts, group_size)
    cfg["quantization_config"] = qc
    cfg["torch_dtype"] = "float16"
    cfg["dtype"] = "float16"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if opts.method == "gptq":
        # AutoGPTQ also writes the same settings on their own.
        (out / "quantize_config.json").write_text(
            json.dumps({k: v for k, v in qc.items() if k != "quant_method"}, indent=2)
        )
    for f in source.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in _SKIP_FILES:
            shutil.copy(f, out / f.name)
