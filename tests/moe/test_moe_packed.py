"""Expert weights packed once at load for the int8 batched path (BlockQuantExperts.pack_int8,
pack_moe_int8_weights) and read in place by the fused experts call (csrc/moe_experts.cpp slices the packed
copy per 16-row group): every expert with 5+ tokens takes that path here (AVX512-VNNI, bf16 compute).
The reference is the torch form of the int8 kernel (cpu_qgemv_q8.linear_reference: W @ Q8(x), float64)
through gate/up, SiLU-and-mul and down per chosen expert."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from server.models.moe import MoEConfig, SparseMoeBlock
from server.models.moe.native import try_load_moe_experts_kernel
from server.models.moe.quant import BlockQuantExperts, pack_moe_int8_weights
from server.models.moe.weights import ExpertWeights
from server.quant.cpu_qgemv_q8 import PACK_ENABLE_ENV, active_kernel, linear_reference
from server.quant.cpu_qlinear import try_load_qlinear_kernel

E, TOP_K, H, INTER, T = 4, 2, 288, 96, 24  # 2I = 192, H = 288: tasks of 96 or 192 rows, one partial
# |fused - reference| <= RTOL * max|reference|: fp32 sums in the kernel against one float64 rounding; the
# activation between the GEMMs is quantized to Q8 the same way on both sides, but an fp32 ulp in a gate/up
# output can move a value across a Q8 rounding step (one step of d = max|x_b| / 127).
RTOL = 2e-3


def _q8():
    kernel = try_load_qlinear_kernel()
    if kernel is None or try_load_moe_experts_kernel() is None:
        pytest.skip("the CPU kernels do not build here")
    q8 = active_kernel(kernel)
    if q8 is None or q8.isa != "vnni":
        pytest.skip("the int8 batched path needs AVX512-VNNI")
    return kernel, q8


def _experts(fmt: str, seed: int) -> BlockQuantExperts:
    kernel, _ = _q8()
    g = torch.Generator().manual_seed(seed)
    w = ExpertWeights(
        router=torch.randn(E, H, generator=g),
        router_bias=None,
        w13=torch.randn(E, 2 * INTER, H, generator=g) / H**0.5,
        w2=torch.randn(E, H, INTER, generator=g) / INTER**0.5,
        b13=None,
        b2=None,
    )
    return BlockQuantExperts.quantize(w, fmt, kernel, compute=torch.bfloat16)


def _routing() -> tuple[torch.Tensor, torch.Tensor]:  # ids, weights: [T, TOP_K]; every expert 12 tokens
    t = torch.arange(T)
    ids = torch.stack([t % E, (t + 1) % E], dim=1)
    weights = torch.stack([torch.full((T,), 0.75), torch.full((T,), 0.25)], dim=1)
    return ids, weights


def _reference(
    experts: BlockQuantExperts, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor
) -> torch.Tensor:
    out = torch.zeros(x.shape[0], H)
    for t in range(x.shape[0]):
        for j in range(TOP_K):
            e = int(ids[t, j])
            h = linear_reference(x[t : t + 1], experts.w13[e])
            act = torch.nn.functional.silu(h[:, :INTER]) * h[:, INTER:]
            out[t] += wts[t, j] * linear_reference(act, experts.w2[e])[0]
    return out


def _run(
    experts: BlockQuantExperts,
    x: torch.Tensor,
    ids: torch.Tensor,
    wts: torch.Tensor,
    task_rows: int = 0,
    batch_tokens: int = 0,
) -> torch.Tensor:
    cfg = MoEConfig("qwen3_moe", E, TOP_K, H, INTER, renormalize=True)
    call = experts.fused_call(cfg)
    assert call is not None
    call.spec.task_rows = task_rows
    call.spec.batch_tokens = batch_tokens
    return call.run(x, ids, wts, experts.fused_entry())


@pytest.mark.parametrize(("fmt", "task_rows"), [("q4_0", 0), ("q4_1", 96), ("q8_0", 192)])
def test_the_fused_call_reads_the_packed_copy(
    fmt: str, task_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packed at load, the call equals the reference; then the stored weights' bytes are zeroed and it
    still does: the 5+-token GEMMs read only the packed copy (before the fix the call dropped it and
    repacked the stored bytes on every call, so this gave zeros)."""
    monkeypatch.delenv("KUBEINFER_INT8_GEMM", raising=False)
    _, q8 = _q8()
    experts = _experts(fmt, seed=3)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(4))
    ids, wts = _routing()
    ref = _reference(experts, x, ids, wts)
    unpacked = _run(experts, x, ids, wts, task_rows)
    added = experts.pack_int8(q8)
    assert added == _packed_numel(experts)
    assert added > 0 and experts.packed_bytes(q8) == 0
    packed = _run(experts, x, ids, wts, task_rows)
    scale = ref.abs().max()
    for name, got in (("unpacked", unpacked), ("packed", packed)):
        err = (got - ref).abs().max()
        assert err <= RTOL * scale, f"{fmt} {name}: max |fused - reference| {err:.3g}, scale {scale:.3g}"
    for w in experts.w13 + experts.w2:
        w.q.zero_()
    err = (_run(experts, x, ids, wts, task_rows) - packed).abs().max()
    assert err <= 1e-6 * scale, f"{fmt}: the call read the stored weights, max diff {err:.3g}"


def test_rows_per_task_must_be_whole_96_row_tiles() -> None:
    experts = _experts("q8_0", seed=5)
    ids, wts = _routing()
    with pytest.raises(RuntimeError, match="returned 2"):
        _run(experts, torch.randn(T, H), ids, wts, task_rows=100)


def _packed_numel(experts: BlockQuantExperts) -> int:
    total = 0
    for w in experts.w13 + experts.w2:
        assert w.packed is not None
        total += w.packed.numel()
    return total


def _model(fmt: str) -> tuple[nn.Module, list[BlockQuantExperts]]:
    cfg = MoEConfig("qwen3_moe", E, TOP_K, H, INTER, renormalize=True)
    sets = [_experts(fmt, seed=10 + i) for i in range(2)]
    blocks = [SparseMoeBlock(cfg) for _ in sets]
    for block, experts in zip(blocks, sets, strict=True):
        block.set_experts(experts)
    return nn.Sequential(*blocks), sets


def test_pack_moe_int8_weights_follows_the_pack_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    _q8()
    monkeypatch.delenv("KUBEINFER_INT8_GEMM", raising=False)
    monkeypatch.setenv(PACK_ENABLE_ENV, "0")
    model, sets = _model("q4_1")
    assert pack_moe_int8_weights(model) == 0
    monkeypatch.setenv(PACK_ENABLE_ENV, "1")
    added = pack_moe_int8_weights(model)
    assert added > 0 and added == sum(_packed_numel(experts) for experts in sets)
    assert pack_moe_int8_weights(model) == 0  # packed once
    fp32, fp32_sets = _model("q4_1")
    for experts in fp32_sets:
        experts.compute = torch.float32
    assert pack_moe_int8_weights(fp32) == 0  # fp32 layers never take the batched int8 path
    monkeypatch.setenv(PACK_ENABLE_ENV, "maybe")
    with pytest.raises(ValueError, match=PACK_ENABLE_ENV):
        pack_moe_int8_weights(model)


@pytest.mark.parametrize("batch_tokens", [1, 7, 10, 64])
def test_a_long_call_runs_in_batches_of_tokens_equal_to_one(batch_tokens: int) -> None:
    """A prefill chunk whose scratch would outgrow the kept 64 MiB runs as batches of tokens (the 2.1B
    Qwen3-MoE shape's 2,048-token chunk: 420 MB zero-filled and unmapped per call before, 1.65x slower).
    Split into batches (24 tokens as 24 x 1, 4 x 6, 3 x 8, 1 x 24), the call equals the reference as one
    batch does (not bit for bit: an expert's GEMM path follows its row count), and every token is summed:
    a batch that dropped or repeated tokens would leave rows at zero or wrong."""
    experts = _experts("q8_0", seed=6)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(7))
    ids, wts = _routing()
    ref = _reference(experts, x, ids, wts)
    scale = ref.abs().max()
    whole = _run(experts, x, ids, wts)  # the library's own batch: T tokens fit
    batched = _run(experts, x, ids, wts, batch_tokens=batch_tokens)
    for name, got in (("one batch", whole), (f"batches of {batch_tokens}", batched)):
        err = (got - ref).abs().max()
        assert err <= RTOL * scale, f"{name}: max |fused - reference| {err:.3g}, scale {scale:.3g}"
    assert bool((batched.abs().amax(dim=1) > 0).all())


def test_a_negative_batch_size_is_refused() -> None:
    experts = _experts("q8_0", seed=5)
    ids, wts = _routing()
    with pytest.raises(RuntimeError, match="returned 2"):
        _run(experts, torch.randn(T, H), ids, wts, batch_tokens=-1)
