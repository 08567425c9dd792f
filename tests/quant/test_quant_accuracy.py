"""Accuracy of every method on the embedded SmolLM2 over a fixed held-out text (server.quantize.evaluation):
perplexity against the unquantized model and teacher-forced greedy top-1 agreement over 256 positions.

The bounds are what we measured (see docs/quantization.md) plus a margin; the reference is the model as
we ship it, whose weights are themselves dequantized Q4_1 (4-bit, blocks of 32): errors stack on top.
Models are scored in fp32 (bf16 matmuls are ~5x slower on this CPU); on CPU int8/int4/AWQ/GPTQ run through
our weight-only kernel in fp32 too (server/quant/cpu_repack.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from server.models.loader import load_model
from server.quant import QuantConfig, finalize, quantized_layer_bytes
from server.quantize.evaluation import SequenceScores, score_sequence, top1_agreement

# method -> (max perplexity ratio to unquantized, min top-1 agreement, max bytes ratio to fp16).
# Measured on this text (ratio, agreement): int8 0.995, 0.945; fp8 1.019, 0.938 (1.034, 0.922 with amax
# scales before fp8_channel_scales; tests/quant/test_quant_fp8_accuracy.py pins it); bitsandbytes (LLM.int8)
# 1.052, 0.875; int4 (group 128, 64 where 576 forces it) 1.308, 0.645; RTN group 64 1.254, 0.688;
# AWQ 1.138, 0.781; GPTQ (asym, act-order, damp 0.1) 1.146, 0.809; nf4 1.303, 0.707; fp4 1.451, 0.594.
# Bytes: the CPU kernel's int4 layout holds an fp32 scale and min per (group, row), exact for fp16 scales
# and 4-bit zeros: 0.625 bytes per weight at group 64 (0.3125 of fp16), 0.5625 at 128.
BOUNDS: dict[str, tuple[float, float, float]] = {
    "int8": (1.02, 0.90, 0.55),
    "fp8": (1.04, 0.90, 0.55),
    "bitsandbytes": (1.08, 0.83, 0.55),
    "int4": (1.38, 0.60, 0.32),
    "rtn-g64": (1.32, 0.64, 0.32),
    "awq": (1.20, 0.73, 0.32),
    "gptq": (1.22, 0.75, 0.32),
    "bitsandbytes-nf4": (1.37, 0.65, 0.30),
    "bitsandbytes-fp4": (1.53, 0.54, 0.30),
}


@dataclass(frozen=True)
class Measured:
    scores: SequenceScores
    layer_bytes: int
    layer_fp16_bytes: int


@pytest.fixture(scope="module")
def measure(
    smollm2_dir: Path, heldout_ids: torch.Tensor, quantized_checkpoint: Callable[[str], Path]
) -> Callable[[str], Measured]:
    cache: dict[str, Measured] = {}

    def run(method: str) -> Measured:
        if method not in cache:
            cpu = torch.device("cpu")
            if method in ("awq", "gptq"):
                loaded = load_model(quantized_checkpoint(method), torch.float32, cpu, 512)
            elif method == "rtn-g64":
                # Round-to-nearest at AWQ/GPTQ's group size (64: SmolLM2's 576 is no multiple of 128).
                loaded = load_model(smollm2_dir, torch.float32, cpu, 512)
                finalize(
                    loaded.model, QuantConfig("int4", is_prequantized=False, group_size=64), torch.float32
                )
            else:
                loaded = load_model(
                    smollm2_dir, torch.float32, cpu, 512, None if method == "none" else method
                )
            held, fp16 = quantized_layer_bytes(loaded.model)
            cache[method] = Measured(score_sequence(loaded.model, heldout_ids), held, fp16)
        return cache[method]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("method", list(BOUNDS))
def test_quant_accuracy_and_memory(method: str, measure: Callable[[str], Measured]) -> None:
    base = measure("none")
    q = measure(method)
    max_ppl_ratio, min_agree, max_bytes = BOUNDS[method]
    ratio = q.scores.perplexity / base.scores.perplexity
    agree = top1_agreement(base.scores, q.scores, 256)
    assert ratio <= max_ppl_ratio, (
        f"{method}: perplexity {q.scores.perplexity:.2f} vs {base.scores.perplexity:.2f}"
    )
    assert agree >= min_agree, f"{method}: top-1 agreement {agree:.3f}"
    assert q.layer_bytes <= max_bytes * q.layer_fp16_bytes, f"{method}: {q.layer_bytes} bytes"


@pytest.mark.slow
def test_quant_awq_and_gptq_beat_round_to_nearest(measure: Callable[[str], Measured]) -> None:
    rtn = measure("rtn-g64").scores.perplexity
    awq = measure("awq").scores.perplexity
    gptq = measure("gptq").scores.perplexity
    assert awq < rtn, f"AWQ {awq:.3f} vs RTN {rtn:.3f}"
    assert gptq < rtn, f"GPTQ {gptq:.3f} vs RTN {rtn:.3f}"


@pytest.mark.slow
def test_quant_unquantized_reference_is_sane(measure: Callable[[str], Measured]) -> None:
    # The dequantized-Q4_1 SmolLM2-135M on this plain English prose: measured 21.79.
    assert 15 < measure("none").scores.perplexity < 30
