"""int8, int4, AWQ and GPTQ layers repacked for the CPU weight-only kernel (server/quant/cpu_repack.py):
each against its existing torch reference (explicit tolerances), what falls back to the previous path,
the bytes held, and greedy parity of whole engines with transformers on the dequantized weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from engine_driver import run_staggered
from torch import nn

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.quant import QuantConfig, finalize, iter_projections, quantized_layer_bytes
from server.quant.block_linear import GEMM_MIN_ROWS, BlockQuantLinear
from server.quant.cpu_repack import (
    ActOrderBlockQuantLinear,
    cpu_kernel_enabled,
    int4_layout_problem,
    int4_linear,
    int8_linear,
    previous_cpu_path,
    quantize_int8,
)
from server.quant.formats import (
    Int4Weights,
    awq_decode,
    awq_encode,
    dequantize,
    gptq_decode,
    gptq_encode,
    pick_group_size,
    quantize_rtn,
)
from server.quant.layers import AwqCheckpointLinear, GptqCheckpointLinear, Int4Linear, Int8Linear
from server.request import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_kernel_enabled(), reason="the CPU kernel cannot be built here")

# fp32 activations and accumulation over the exactly dequantized weight: only the summation order differs
# from the reference, ~K * 2^-24 relative at worst; measured < 1e-6.
FP32_REL = 2e-5
PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colours:"]
NEW_TOKENS = 12


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


def _random_int4(k: int, n: int, group: int, act_order: bool, seed: int, zero16: bool = False) -> Int4Weights:
    g = _gen(seed)
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    zeros = torch.randint(0, 16, (k // group, n), generator=g, dtype=torch.int32)
    if zero16:
        zeros[0, 1] = 16  # a GPTQ v1 file's wrapped zero of 0
    return Int4Weights(
        intweight=torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32),
        zeros=zeros,
        scales=(torch.rand(k // group, n, generator=g) * 0.02 + 1e-3).half(),
        g_idx=g_idx.to(torch.int32),
        group_size=group,
    )


@pytest.mark.parametrize(
    ("k", "n", "group"),
    [(64, 48, 32), (576, 192, 64), (1536, 72, 128), (576, 40, 576), (96, 24, 32)],
)
@pytest.mark.parametrize("m", [1, 5, 33, GEMM_MIN_ROWS + 3])
@pytest.mark.parametrize("act_order", [False, True])
def test_int4_layer_matches_the_dequantizing_reference(
    k: int, n: int, group: int, m: int, act_order: bool
) -> None:
    w = _random_int4(k, n, group, act_order, seed=k + n + group, zero16=True)
    bias = torch.randn(n, generator=_gen(3)) * 0.1
    x = torch.randn(m, k, generator=_gen(m))
    layer = int4_linear(w, bias)
    permuted = act_order and group < k  # one group: any order of K is already k // G
    assert type(layer) is (ActOrderBlockQuantLinear if permuted else BlockQuantLinear)
    ref = Int4Linear(w, bias, backend="dequant")(x)  # the existing torch reference: x @ dequantize(w)
    assert _rel_err(layer(x), ref) < FP32_REL
    # the kernel's weight is the reference's, value for value (in its K order)
    from server.quant.cpu_qlinear import dequantize_reference

    perm = layer.perm if isinstance(layer, ActOrderBlockQuantLinear) else torch.arange(k)
    assert torch.equal(dequantize_reference(layer.weight_q), dequantize(w)[perm].t())


@pytest.mark.parametrize("fmt", ["awq", "gptq", "gptq_v2", "gptq-act-order"])
def test_finalize_repacks_checkpoint_layers_for_the_kernel(fmt: str) -> None:
    """The wiring: AWQ/GPTQ checkpoint modules become kernel layers that compute the old layer's function."""
    k, n, group = 256, 64, 64
    w = quantize_rtn(torch.randn(n, k, generator=_gen(1)) * 0.05, group, min_zero=0 if fmt == "awq" else 1)
    if fmt == "gptq-act-order":
        perm = torch.randperm(k, generator=_gen(2))
        w = Int4Weights(w.intweight[perm], w.zeros, w.scales, w.g_idx[perm], group)
    model = _one_projection(k, n)
    ckpt: nn.Module
    if fmt == "awq":
        t = awq_encode(w)
        ckpt = AwqCheckpointLinear(k, n, group, False, "cpu")
        ckpt.qweight, ckpt.qzeros, ckpt.scales = t.qweight, t.qzeros, t.scales
        qcfg = QuantConfig(method="awq", is_prequantized=True, group_size=group)
        expected = awq_decode(t.qweight, t.qzeros, t.scales, group)
    else:
        offset = 0 if fmt == "gptq_v2" else 1
        g = gptq_encode(w, zero_offset=offset)
        ckpt = GptqCheckpointLinear(k, n, group, False, "cpu")
        ckpt.qweight, ckpt.qzeros, ckpt.scales, ckpt.g_idx = g.qweight, g.qzeros, g.scales, g.g_idx
        qcfg = QuantConfig(method="gptq", is_prequantized=True, group_size=group, zero_offset=offset)
        expected = gptq_decode(g.qweight, g.qzeros, g.scales, g.g_idx, group, offset)
    model.model.layers[0].self_attn.q_proj = ckpt
    finalize(model, qcfg, torch.float32)
    layer = model.model.layers[0].self_attn.q_proj
    assert type(layer) is (ActOrderBlockQuantLinear if fmt == "gptq-act-order" else BlockQuantLinear)
    x = torch.randn(9, k, generator=_gen(4))
    assert _rel_err(layer(x), x @ dequantize(expected)) < FP32_REL


def test_layouts_the_kernel_cannot_hold_keep_the_previous_path() -> None:
    k, n = 128, 32
    uneven = _random_int4(k, n, 32, False, seed=5)
    uneven = Int4Weights(uneven.intweight, uneven.zeros, uneven.scales, torch.zeros(k, dtype=torch.int32), 32)
    assert int4_layout_problem(uneven) == "g_idx groups are not all group_size long"
    small_groups = _random_int4(k, n, 16, False, seed=6)
    assert "multiples of 32" in str(int4_layout_problem(small_groups))
    for w in (uneven, small_groups):
        g = gptq_encode(Int4Weights(w.intweight, w.zeros.clamp(min=1), w.scales, w.g_idx, w.group_size))
        ckpt = GptqCheckpointLinear(k, n, w.group_size, False, "cpu")
        ckpt.qweight, ckpt.qzeros, ckpt.scales, ckpt.g_idx = g.qweight, g.qzeros, g.scales, g.g_idx
        model = _one_projection(k, n)
        model.model.layers[0].self_attn.q_proj = ckpt
        finalize(
            model, QuantConfig(method="gptq", is_prequantized=True, group_size=w.group_size), torch.float32
        )
        assert type(model.model.layers[0].self_attn.q_proj) is Int4Linear
    with pytest.raises(ValueError, match="cannot be repacked"):
        int4_linear(uneven, None)


@pytest.mark.parametrize(("n", "k"), [(192, 576), (33, 64), (7, 1536)])
@pytest.mark.parametrize("m", [1, 6, GEMM_MIN_ROWS])
def test_int8_layer_matches_its_reference(n: int, k: int, m: int) -> None:
    weight = torch.randn(n, k, generator=_gen(n)) * 0.05
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    deq = q.float() * scale[:, None]  # [N, K]
    assert bool(((deq - weight).abs() <= scale[:, None] * 0.5 + 1e-7).all())  # round to nearest
    bias = torch.randn(n, generator=_gen(2))
    layer = int8_linear(q, scale, bias)
    x = torch.randn(m, k, generator=_gen(m))
    assert _rel_err(layer(x), x @ deq.t() + bias) < FP32_REL


class _OneLayer(nn.Module):
    """Just enough of our model's naming for finalize() to find projections."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.model = nn.Module()
        layer = nn.Module()
        layer.self_attn = nn.Module()
        layer.mlp = nn.Module()
        layer.self_attn.q_proj = nn.Linear(k, n, bias=False)
        layer.mlp.down_proj = nn.Linear(k, n, bias=True)
        self.model.layers = nn.ModuleList([layer])


def _one_projection(k: int, n: int) -> _OneLayer:
    return _OneLayer(k, n)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_on_the_fly_methods_hold_the_packed_bytes(method: str) -> None:
    k, n = 576, 192
    model = _OneLayer(k, n)
    finalize(model, QuantConfig(method=method, is_prequantized=False), torch.float32)
    layers = [p.module for p in iter_projections(model)]
    assert all(type(m) is BlockQuantLinear for m in layers)
    if method == "int8":
        per_layer = n * k + 4 * n  # int8 values + an fp32 scale per row
    else:
        groups = k // pick_group_size(k)
        per_layer = n * k // 2 + 2 * 4 * n * groups  # nibbles + fp32 scale and min per (row, group)
    held, _ = quantized_layer_bytes(model)
    assert held == 2 * per_layer + 4 * n  # + down_proj's fp32 bias
    with previous_cpu_path():
        old = _OneLayer(k, n)
        finalize(old, QuantConfig(method=method, is_prequantized=False), torch.float32)
    assert type(old.model.layers[0].self_attn.q_proj) is (Int8Linear if method == "int8" else Int4Linear)


# ------------------------------------------------------------------ engines


def _engine(folder: Path, quantize: str | None, cache_dir: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(folder), quantize=quantize, dtype="float32", cache_dir=cache_dir),
            cache=CacheConfig(num_kv_blocks=64),
            max_num_seqs=4,
            device="cpu",
            num_threads=1,
        )
    )


def _hf_greedy(hf: nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = hf.generate(  # type: ignore[operator]
                torch.tensor([p]),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
            )
            out.append(ids[0, len(p) :].tolist())
    return out


def _projection_bytes(engine: LLMEngine) -> int:  # the fused ones included
    return sum(m.weight_nbytes() for m in engine.loaded.model.modules() if isinstance(m, BlockQuantLinear))


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_on_the_fly_engine_greedy_parity_and_info_bytes(
    method: str, tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """--quantize int8/int4 on CPU: served by the kernel; greedy output equals transformers running the
    same dequantized projections; /info's weight bytes are the dense model's with the projections packed."""
    from transformers import AutoModelForCausalLM

    folder = tiny_model_factory("llama", tie=True)
    engine = _engine(folder, method, tmp_path)
    layer0 = engine.loaded.model.model.layers[0]
    assert type(layer0.self_attn.qkv_proj) is BlockQuantLinear  # fused, still in the kernel's layout
    assert type(layer0.mlp.down_proj) is BlockQuantLinear
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    packed = 0
    with torch.no_grad():
        for name, module in hf.named_modules():
            if name.endswith("_proj") and isinstance(module, nn.Linear):
                n, k = module.weight.shape
                if method == "int8":
                    q, scale = quantize_int8(module.weight)
                    module.weight.copy_(q.float() * scale[:, None])
                    packed += n * k + 4 * n
                else:
                    w = quantize_rtn(module.weight, pick_group_size(k))
                    module.weight.copy_(dequantize(w).t())
                    packed += n * k // 2 + 8 * n * (k // w.group_size)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    ours = run_staggered(
        engine, prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    )
    assert ours == _hf_greedy(hf, prompts)
    dense = _engine(folder, None, tmp_path)
    dense_proj = sum(4 * m.weight.numel() for n, m in hf.named_modules() if n.endswith("_proj"))
    assert _projection_bytes(engine) == packed
    assert engine.info.weight_bytes == dense.info.weight_bytes - dense_proj + packed


def _hf_from_checkpoint(folder: Path, method: str) -> nn.Module:
    """transformers' Llama holding the checkpoint's float tensors and its projections dequantized (fp32)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(folder))
    qc = cfg.quantization_config
    del cfg.quantization_config
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = load_file(str(folder / "model.safetensors"))
    target = hf.state_dict()
    with torch.no_grad():
        for name, module in hf.named_modules():
            if not (name.endswith("_proj") and isinstance(module, nn.Linear)):
                continue
            t = {
                leaf: state.pop(f"{name}.{leaf}")
                for leaf in ("qweight", "qzeros", "scales", "g_idx")
                if f"{name}.{leaf}" in state
            }
            if method == "awq":
                w = awq_decode(t["qweight"], t["qzeros"], t["scales"], qc["group_size"])
            else:
                w = gptq_decode(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], qc["group_size"])
            module.weight.copy_(dequantize(w).t())
            bias = state.pop(f"{name}.bias", None)
            if module.bias is not None:
                module.bias.copy_(bias if bias is not None else torch.zeros_like(module.bias))
        for key, value in state.items():
            target[key].copy_(value.float())
    return hf


@pytest.mark.slow  # ~2-4 min on the shared 2-core machine (transformers' generate on SmolLM2)
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_prequantized_engine_greedy_parity(
    method: str, quantized_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """Our SmolLM2 AWQ and GPTQ (act-order, asymmetric) checkpoints served through the kernel: greedy
    output equals transformers on the checkpoint's dequantized fp32 weights, token for token."""
    folder = quantized_checkpoint(method)
    engine = _engine(folder, None, tmp_path)
    assert engine.info.quantization == method
    layer0 = engine.loaded.model.model.layers[0]
    if method == "gptq":  # act-order: each projection keeps its own input order, unfused
        assert type(layer0.self_attn.q_proj) is ActOrderBlockQuantLinear
    else:
        assert type(layer0.self_attn.qkv_proj) is BlockQuantLinear
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    ours = run_staggered(
        engine, prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    )
    assert ours == _hf_greedy(_hf_from_checkpoint(folder, method), prompts)
