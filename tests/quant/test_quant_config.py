"""--quantize x checkpoint quantization_config x device -> QuantConfig or a startup error naming both."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from server.quant import keeps_dtype, resolve_quant_config
from server.quant.config import QuantConfig
from server.quant.formats import pick_group_size

CPU = torch.device("cpu")
AWQ_CFG = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}
GPTQ_CFG = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False, "desc_act": True}


def test_quant_no_flag_no_checkpoint_config_is_dense() -> None:
    assert resolve_quant_config(None, None, CPU) is None


@pytest.mark.parametrize(
    "flag", ["int8", "int4", "fp8", "bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4"]
)
def test_quant_on_the_fly_flags(flag: str) -> None:
    q = resolve_quant_config(flag, None, CPU)
    assert q is not None and q.method == flag and not q.is_prequantized


def test_quant_detects_awq_and_gptq_from_checkpoint() -> None:
    a = resolve_quant_config(None, AWQ_CFG, CPU)
    assert a == QuantConfig(method="awq", is_prequantized=True, group_size=64)
    g = resolve_quant_config("gptq", GPTQ_CFG, CPU)
    assert g is not None and g.method == "gptq" and g.is_prequantized
    assert (g.group_size, g.sym, g.desc_act, g.zero_offset) == (128, False, True, 1)
    v2 = resolve_quant_config(None, {**GPTQ_CFG, "checkpoint_format": "gptq_v2"}, CPU)
    assert v2 is not None and v2.zero_offset == 0
    old_awq = resolve_quant_config(
        None, {"quant_method": "awq", "w_bit": 4, "q_group_size": 32, "version": "GEMM"}, CPU
    )
    assert old_awq is not None and old_awq.group_size == 32


@pytest.mark.parametrize(
    ("flag", "ckpt"),
    [("int8", AWQ_CFG), ("awq", GPTQ_CFG), ("gptq", AWQ_CFG), ("bitsandbytes-nf4", GPTQ_CFG)],
)
def test_quant_flag_conflicting_with_checkpoint_names_both(flag: str, ckpt: dict[str, object]) -> None:
    with pytest.raises(ValueError) as e:
        resolve_quant_config(flag, ckpt, CPU)
    msg = str(e.value)
    assert f"--quantize {flag}" in msg and repr(ckpt["quant_method"]) in msg


def test_quant_prequantized_flag_without_checkpoint_config() -> None:
    with pytest.raises(
        ValueError, match=r"--quantize awq needs a pre-quantized AWQ checkpoint.*server\.quantize"
    ):
        resolve_quant_config("awq", None, CPU)


@pytest.mark.parametrize(
    ("ckpt", "match"),
    [
        ({**AWQ_CFG, "version": "gemv"}, "GEMM"),
        ({**AWQ_CFG, "bits": 3}, "bits=3"),
        ({**GPTQ_CFG, "bits": 8}, "bits=8"),
        ({**GPTQ_CFG, "checkpoint_format": "marlin"}, "marlin"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "--quantize bitsandbytes"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise"),
        ({"quant_method": "compressed-tensors"}, "compressed-tensors"),
    ],
)
def test_quant_unsupported_checkpoint_configs(ckpt: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_quant_config(None, ckpt, CPU)


def test_quant_device_that_cannot_run_the_method_names_both() -> None:
    with pytest.raises(ValueError, match=r"'int4' cannot run on device 'mps'"):
        resolve_quant_config("int4", None, torch.device("mps"))


def test_quant_bitsandbytes_missing_is_a_startup_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )
    with pytest.raises(ValueError, match=r"'bitsandbytes-nf4' needs the bitsandbytes package.*cpu"):
        resolve_quant_config("bitsandbytes-nf4", None, CPU)


def test_quant_keeps_dtype() -> None:
    awq = resolve_quant_config(None, AWQ_CFG, CPU)
    int8 = resolve_quant_config("int8", None, CPU)
    assert keeps_dtype("model.layers.0.self_attn.q_proj.scales", awq)
    assert not keeps_dtype("model.layers.0.self_attn.q_proj.bias", awq)
    assert not keeps_dtype("model.norm.weight", awq)
    # On the fly: projection weights stay in checkpoint precision until finalize() quantizes them.
    assert keeps_dtype("model.layers.3.mlp.down_proj.weight", int8)
    assert not keeps_dtype("model.embed_tokens.weight", int8)
    assert not keeps_dtype("lm_head.weight", int8)
    assert not keeps_dtype("model.layers.0.self_attn.q_proj.weight", None)


def test_quant_group_size_choice() -> None:
    assert pick_group_size(1536) == 128
    assert pick_group_size(576) == 64  # SmolLM2's hidden size
    with pytest.raises(ValueError):
        pick_group_size(100)
