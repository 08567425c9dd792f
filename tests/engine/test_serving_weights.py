"""Fused projections and CPU pre-packed weights compute what the model loaded by name computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from server.models.cpu_bf16_gemm import Bf16PanelLinear, try_load_fast_bf16_gemm
from server.models.loader import load_model
from server.models.serving_weights import (
    BF16_GEMM_ENV,
    PackedLinear,
    bf16_panel_kernel,
    cpu_packing_supported,
    prepare_for_serving,
)
from server.native import usable_cpu_features
from server.quant import cpu_repack
from server.quant.block_linear import BlockQuantLinear
from server.quantize.evaluation import SequenceRunner

CPU = torch.device("cpu")


def _logits(model, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return SequenceRunner(model, ids.numel()).logits(ids)  # [T, vocab]


@pytest.mark.parametrize(
    ("arch", "tie"), [("llama", True), ("qwen2", False), ("qwen3", True), ("qwen3", False)]
)
def test_fused_and_packed_model_matches_the_loaded_one(tiny_model_factory, arch: str, tie: bool) -> None:  # type: ignore[no-untyped-def]
    folder = tiny_model_factory(arch, tie=tie)
    ref = load_model(folder, torch.float32, CPU, 64).model
    opt = load_model(folder, torch.float32, CPU, 64).model
    report = prepare_for_serving(opt, CPU, torch.float32)

    layers = opt.decoder_layers()
    assert report.fused_projections == 2 * len(layers)
    for layer in layers:
        assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "gate_proj")
        assert layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None
    if cpu_packing_supported(CPU, torch.float32):
        # qkv, o, gate_up, down per layer, and the vocabulary projection.
        assert report.packed_linears == 4 * len(layers) + 1
        assert isinstance(opt.lm_head, PackedLinear)
        assert not any(type(m) is nn.Linear for m in opt.modules())

    ids = torch.randint(3, opt.config.vocab_size, (37,), generator=torch.Generator().manual_seed(0))
    want, got = _logits(ref, ids), _logits(opt, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # The compiled fused layer ops (server/models/cpu_fused.py) ran above; the torch ops give the same.
    assert opt.fused_ops is not None and ref.fused_ops is None
    opt.fused_ops = None
    torch.testing.assert_close(_logits(opt, ids), got, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("panels", ["0", "1"])
def test_bf16_weights_are_packed_where_the_cpu_computes_bf16(
    tiny_model_factory, monkeypatch, panels: str
) -> None:  # type: ignore[no-untyped-def]
    """A bf16 folder served on an AVX-512 CPU (`--dtype auto` picks bf16 on AVX512-BF16/AMX) gets its weights
    pre-packed like fp32 (F.linear re-packs a bf16 weight on every call too): oneDNN's layout gives the same
    logits bit for bit; cpu_bf16_gemm's panels (the default where AVX512-BF16 runs) the same to bf16 rounding
    of another fp32 summation order, and the same greedy tokens. Where oneDNN has no bf16, bf16 weights stay
    plain Linear modules."""
    monkeypatch.setenv(BF16_GEMM_ENV, panels)
    folder = tiny_model_factory("qwen2", tie=False)
    ref = load_model(folder, torch.bfloat16, CPU, 64).model
    model = load_model(folder, torch.bfloat16, CPU, 64).model
    report = prepare_for_serving(model, CPU, torch.bfloat16)
    layers = model.decoder_layers()
    assert report.fused_projections == 2 * len(layers)
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert report.packed_linears == 0 and not cpu_packing_supported(CPU, torch.bfloat16)
        return
    assert cpu_packing_supported(CPU, torch.bfloat16)
    assert report.packed_linears == 4 * len(layers) + 1
    assert not any(type(m) is nn.Linear for m in model.modules())
    kernel = bf16_panel_kernel()
    want_type = Bf16PanelLinear if kernel is not None else PackedLinear
    assert isinstance(model.lm_head, want_type) and isinstance(layers[0].mlp.down_proj, want_type)
    ids = torch.randint(3, model.config.vocab_size, (29,), generator=torch.Generator().manual_seed(2))
    want, got = _logits(ref, ids), _logits(model, ids)
    if want_type is PackedLinear:
        # oneDNN runs the same bf16 kernel either way, only without the per-call re-pack.
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_panels_default_leaves_amx_cpus_to_onednn(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """KUBEINFER_BF16_GEMM unset: the panels where their AVX512-BF16 path runs, except where AMX-BF16 is
    usable: there oneDNN's pre-packed GEMM (AMX tiles) ran Llama-3.2-1B's matrices 1.9x faster at 16 rows
    and 8-10x at 256-2048 (the panels 1.2x at one row; benchmarks/bf16_gemm.py, docs/benchmarks-log.md).
    `1` asks for the panels wherever they run, `0` never."""
    monkeypatch.delenv(BF16_GEMM_ENV, raising=False)
    runs = try_load_fast_bf16_gemm() is not None
    amx = usable_cpu_features().amx_bf16
    assert (bf16_panel_kernel() is not None) == (runs and not amx)
    monkeypatch.setenv(BF16_GEMM_ENV, "1")
    assert (bf16_panel_kernel() is not None) == runs
    monkeypatch.setenv(BF16_GEMM_ENV, "0")
    assert bf16_panel_kernel() is None


def test_quantized_projections_keep_their_names(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    folder = tiny_model_factory("llama", tie=True)
    ref = load_model(folder, torch.float32, CPU, 64, "int8").model
    model = load_model(folder, torch.float32, CPU, 64, "int8").model
    report = prepare_for_serving(model, CPU, torch.float32)
    layer = model.decoder_layers()[0]
    if cpu_repack.cpu_kernel_enabled():
        # int8 on CPU is the weight-only kernel's BlockQuantLinear (cpu_repack.py): q/k/v and gate/up of
        # one format fuse like dense ones
        assert report.fused_projections == 2 * len(model.decoder_layers())
        assert isinstance(layer.self_attn.qkv_proj, BlockQuantLinear)
    else:
        assert report.fused_projections == 0
        assert type(layer.self_attn.q_proj) is not nn.Linear and layer.self_attn.qkv_proj is None
    ids = torch.randint(3, model.config.vocab_size, (20,), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_logits(model, ids), _logits(ref, ids), rtol=1e-4, atol=1e-4)
