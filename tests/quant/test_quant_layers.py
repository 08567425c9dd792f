"""Each quantized Linear against a plain matmul with its own dequantized weight, its error against the
full-precision weight, and the bytes it holds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from server.quant import QuantConfig, finalize, quantized_layer_bytes
from server.quant.formats import Int4Weights, dequantize, quantize_rtn
from server.quant.layers import BnbLinear, Fp8Linear, Int4Linear, Int8Linear

N, K = 192, 576  # SmolLM2's k_proj shape


def _weight(n: int = N, k: int = K, seed: int = 0) -> torch.Tensor:  # [N, K]
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def _x(m: int = 7, k: int = K, seed: int = 1) -> torch.Tensor:  # [M, K]
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.mark.parametrize("group", [32, 64, 128])
def test_quant_int4_cpu_kernel_asymmetric_zero_points(group: int) -> None:
    w = quantize_rtn(_weight(k=K if group != 128 else 1536), group)
    x = _x(k=w.in_features)
    bias = torch.randn(N) * 0.1
    layer = Int4Linear(w, bias, backend="cpu")
    ref = x @ dequantize(w) + bias
    # bf16 activations and scales inside the kernel: ~2^-8 relative per product.
    assert _rel_err(layer(x), ref) < 0.02
    assert _rel_err(Int4Linear(w, bias, backend="dequant")(x), ref) < 1e-5


def test_quant_int4_act_order_and_zero_16() -> None:
    """GPTQ act-order (g_idx a permutation of groups) and a v1 zero that reads as 16."""
    gen = torch.Generator().manual_seed(2)
    k, n, g = 256, 64, 64
    g_idx = (torch.arange(k) // g)[torch.randperm(k, generator=gen)].to(torch.int32)
    zeros = torch.randint(1, 16, (k // g, n), generator=gen, dtype=torch.int32)
    zeros[1, 3] = 16
    w = Int4Weights(
        intweight=torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32),
        zeros=zeros,
        scales=(torch.rand(k // g, n, generator=gen) * 0.01 + 1e-3).half(),
        g_idx=g_idx,
        group_size=g,
    )
    x = _x(k=k)
    ref = x @ dequantize(w)
    cpu = Int4Linear(w, None)
    assert cpu.backend == "cpu" and cpu.perm is not None
    assert _rel_err(cpu(x), ref) < 0.02
    assert _rel_err(Int4Linear(w, None, backend="dequant")(x), ref) < 1e-5


def test_quant_int4_uneven_groups_fall_back_to_dequant() -> None:
    w = quantize_rtn(_weight(n=16, k=64), 32)
    skewed = Int4Weights(w.intweight, w.zeros, w.scales, torch.zeros(64, dtype=torch.int32), 32)
    layer = Int4Linear(skewed, None)
    assert layer.backend == "dequant"
    x = _x(k=64)
    assert _rel_err(layer(x), x @ dequantize(skewed)) < 1e-5


@pytest.mark.interpreter
def test_quant_int4_triton_path_matches() -> None:
    """The CUDA path (AWQ-layout Triton kernel), run by the Triton interpreter on CPU."""
    pytest.importorskip("triton")
    w = quantize_rtn(_weight(n=64, k=128), 64)
    x = _x(m=3, k=128)
    layer = Int4Linear(w, None, backend="triton")
    assert _rel_err(layer(x), x @ dequantize(w)) < 1e-4


def test_quant_int8_per_channel() -> None:
    weight = _weight()
    layer = Int8Linear.quantize(weight, None)
    assert layer.qweight.dtype == torch.int8 and layer.scale is not None
    scale = layer.scale.float()[:, None]  # [N, 1]
    deq = layer.qweight.float() * scale
    # Round to nearest: at most half a step per element.
    assert bool(((deq - weight).abs() <= scale * 0.5 + 1e-7).all())
    x = _x()
    assert _rel_err(layer(x), x @ deq.t()) < 0.02
    assert _rel_err(layer(x), x @ weight.t()) < 0.03


def test_quant_fp8_per_channel() -> None:
    weight = _weight()
    layer = Fp8Linear.quantize(weight, torch.ones(N))
    assert layer.weight.dtype == torch.float8_e4m3fn
    deq = layer.weight.float() * layer.scale[:, None]
    # e4m3 keeps 3 mantissa bits: relative rounding <= 2^-4 for normal numbers.
    big = weight.abs() > layer.scale[:, None] * 2**-6
    assert bool(((deq - weight).abs()[big] <= weight.abs()[big] * 2**-4 + 1e-7).all())
    x = _x()
    assert _rel_err(layer(x), x @ deq.t() + 1) < 1e-4


@pytest.mark.parametrize("quant_type", ["nf4", "fp4", "int8"])
def test_quant_bitsandbytes_layers(quant_type: str) -> None:
    pytest.importorskip("bitsandbytes")
    weight = _weight()
    layer = BnbLinear(weight, None, quant_type, torch.bfloat16)
    x = _x().bfloat16()
    ref = x.float() @ weight.t()
    # Max error over the largest output, measured: nf4 ~0.12, fp4 ~0.16 (coarser grid), LLM.int8 ~0.01.
    assert _rel_err(layer(x), ref) < {"nf4": 0.15, "fp4": 0.2, "int8": 0.03}[quant_type]
    fp16_bytes = 2 * N * K
    assert layer.weight_nbytes() <= (0.3 if quant_type != "int8" else 0.55) * fp16_bytes


class _TwoLayer(nn.Module):
    """Just enough of our model's naming for finalize() to find projections."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        layer = nn.Module()
        layer.self_attn = nn.Module()
        layer.mlp = nn.Module()
        layer.self_attn.q_proj = nn.Linear(K, K, bias=False)
        layer.mlp.down_proj = nn.Linear(1536, K, bias=False)
        self.model.layers = nn.ModuleList([layer])
        self.lm_head = nn.Linear(K, 1000, bias=False)


@pytest.mark.parametrize(("method", "ratio"), [("int4", 0.30), ("int8", 0.55), ("fp8", 0.55)])
def test_quant_weight_bytes_of_quantized_layers(method: str, ratio: float) -> None:
    m = _TwoLayer()
    finalize(m, QuantConfig(method=method, is_prequantized=False), torch.bfloat16)
    assert isinstance(m.lm_head, nn.Linear)  # lm_head stays dense
    assert type(m.get_submodule("model.layers.0.self_attn.q_proj")).__name__ != "Linear"
    held, fp16 = quantized_layer_bytes(m)
    assert held <= ratio * fp16, (held, fp16)
