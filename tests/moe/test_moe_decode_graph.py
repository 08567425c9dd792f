"""Mixture-of-experts layers in the decode graph (server/models/decode_graph.py, cpu_fused.cpp's
KiDecodeMoe): tiny random Mixtral and Qwen3-MoE (dense layers beside sparse ones, q/k norms,
`norm_topk_prob`) quantized with --quantize int8 (per output channel), so every projection and expert
runs qlinear's kernel. Their decode steps are one C++ call (router GEMV, softmax, top-k, the experts'
native call). Greedy tokens equal the Python fused path's (FusedMoE between the compiled norms) and
transformers' on the same (dequantized) weights; logprobs agree with the fused path's within
LOGPROB_TOL, not bit for bit: the graph's router sums its dot products in another order than torch's
F.linear, so routing weights differ by fp32 rounding (the expert choices are the same; on exact ties the
graph takes the lowest index, a rule torch.topk does not promise). Qwen2-MoE's shared expert (its two
projections int8 as every projection, its sigmoid gate fp32) runs in the graph too, beside a dense layer;
held in float weights it is refused."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from moe_models import MAX_LEN, PROMPTS, build
from prompt_logprobs import hf_on_our_weights, model_greedy

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.models.cpu_fused import try_load_fused_ops
from server.models.decode_graph import DecodeGraph, layer_refusal, route
from server.models.moe import BlockQuantExperts, MoEConfig, SparseMoeBlock, select_experts
from server.quant.block_linear import BlockQuantLinear
from server.quant.cpu_qlinear import dequantize_reference
from server.quant.gemm_dtype import apply_gemm_dtype
from server.request import SamplingParams

LOGPROB_TOL = 1e-4  # fp32 both sides; only the router's sums (and its softmax's exp) round differently


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            made[kind] = build(tmp_path_factory.mktemp(f"graph-{kind}"), smollm2_dir, kind)
        return made[kind]

    return make


def _engine(folder: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(folder), dtype="float32", quantize="int8", max_model_len=MAX_LEN),
            cache=CacheConfig(block_size=4, num_kv_blocks=128, enable_prefix_caching=False),
            max_num_seqs=4,
            max_num_batched_tokens=32,
        )
    )


def _generate(engine: LLMEngine, graph: bool) -> tuple[list[list[int]], list[float]]:
    """Greedy with logprobs, requests joining one step apart (one- and several-row decode steps)."""
    model = engine.loaded.model
    model.use_decode_graph = graph
    model._decode_graph = None
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    lps: list[float] = []
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        if pending:
            i, p = pending.pop(0)
            engine.add_request(str(i), p, params)
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            lps += [t.logprob for lp in out.new_logprobs for t in (lp.chosen, *lp.top)]
    return list(tokens.values()), lps


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_decode_steps_run_in_the_graph(
    tiny: Callable[[str], Path], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(tiny(kind))
    model = engine.loaded.model
    assert model.fused_ops is not None
    assert any(isinstance(layer.mlp, SparseMoeBlock) for layer in model.decoder_layers())
    graph, got_tokens = _graph_equals_fused_path(engine, monkeypatch)
    shared = [r.shared_gate_up is not None for r in graph.moes if r is not None]
    assert shared and all(shared) == (kind == "qwen2_moe")  # the shared experts run in the graph
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    # int8 experts, so that transformers runs on their dequantized values, not the checkpoint's
    assert blocks and all(isinstance(b.experts, BlockQuantExperts) for b in blocks)
    hf = hf_on_our_weights(tiny(kind), engine)
    prompts = [engine.tokenizer.encode(text) for text in PROMPTS]
    assert model_greedy(hf, prompts, [len(ours) for ours in got_tokens]) == got_tokens


def _graph_equals_fused_path(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> tuple[DecodeGraph, list[list[int]]]:
    """Generates with the graph off, then on: the graph served one-row and batched steps, greedy tokens
    are equal, logprobs within LOGPROB_TOL, no KV block leaked. Returns the recorded graph and tokens."""
    model = engine.loaded.model
    want_tokens, want_lps = _generate(engine, graph=False)
    graph_steps: list[int] = []
    run = DecodeGraph.run

    def spy(self: DecodeGraph, h: torch.Tensor, *args: Any) -> torch.Tensor:
        graph_steps.append(h.shape[0])
        return run(self, h, *args)

    monkeypatch.setattr(DecodeGraph, "run", spy)
    got_tokens, got_lps = _generate(engine, graph=True)
    monkeypatch.undo()
    assert model._decode_graph is not None and isinstance(model._decode_graph[1], DecodeGraph)
    assert 1 in graph_steps and max(graph_steps) > 1  # one-row and batched decode steps
    assert got_tokens == want_tokens
    torch.testing.assert_close(torch.tensor(got_lps), torch.tensor(want_lps), atol=LOGPROB_TOL, rtol=0)
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    return model._decode_graph[1], got_tokens


def test_graph_follows_the_experts_gemm_dtype(tiny: Callable[[str], Path]) -> None:
    """A gemm_dtype set after recording (apply_gemm_dtype) rebuilds the experts' call with the new
    compute flag; the graph's MoE records follow it at the next step (sync_compute), as its projections'
    descriptors do."""
    engine = _engine(tiny("mixtral"))
    model = engine.loaded.model
    _generate(engine, graph=True)
    assert model._decode_graph is not None
    graph = model._decode_graph[1]
    assert isinstance(graph, DecodeGraph)
    blocks = [layer.mlp for layer in model.decoder_layers() if isinstance(layer.mlp, SparseMoeBlock)]
    before = [b.fused().native_call() for b in blocks]
    try:
        apply_gemm_dtype(model, torch.bfloat16)
        after = [b.fused().native_call() for b in blocks]
        assert all(a is not None and a is not b for a, b in zip(after, before, strict=True))
        graph.sync_compute()
        records = [r for r in graph.moes if r is not None]
        assert [r.experts for r in records] == [ctypes.addressof(c.spec) for c in after if c is not None]
    finally:
        apply_gemm_dtype(model, torch.float32)


def test_shared_expert_in_float_weights_refused(tiny: Callable[[str], Path]) -> None:
    """Held in float weights (here: the int8 projections swapped back for the checkpoint's fp32 tensors)
    the shared expert is the Python path's; the layer kind itself is the graph's."""
    engine = _engine(tiny("qwen2_moe"))
    arch = engine.loaded.arch
    moe_spec = next(s for s in arch.layers if s.mlp == "moe")
    assert layer_refusal(moe_spec, arch.moe) is None
    for block in engine.loaded.model.modules():
        if isinstance(block, SparseMoeBlock) and block.shared_gate_up is not None:
            assert isinstance(block.shared_gate_up, BlockQuantLinear)
            assert isinstance(block.shared_down, BlockQuantLinear)
            w13 = dequantize_reference(block.shared_gate_up.weight_q)
            w2 = dequantize_reference(block.shared_down.weight_q)
            block.shared_gate_up = block.shared_down = None
            block.shared_w13 = torch.nn.Parameter(w13, requires_grad=False)
            block.shared_w2 = torch.nn.Parameter(w2, requires_grad=False)
    _generate(engine, graph=True)
    assert engine.loaded.model._decode_graph is not None and engine.loaded.model._decode_graph[1] is None


@pytest.mark.parametrize("renormalize", [True, False])
def test_graph_router_matches_select_experts(renormalize: bool) -> None:
    """The graph's router (kubeinfer_moe_route) against routing.select_experts over torch's F.linear:
    the same experts on every token, weights within fp32 rounding; exact ties (duplicated router rows)
    go to the lowest index (cpu_fused.cpp's moe_route)."""
    ops = try_load_fused_ops()
    assert ops is not None
    torch.manual_seed(0)
    e, h, t = 16, 256, 64
    cfg = MoEConfig(
        "qwen3_moe", num_experts=e, top_k=4, hidden_size=h, intermediate_size=32, renormalize=renormalize
    )
    router = torch.randn(e, h) * 0.1
    x = torch.randn(t, h)
    probs, ids, weights = route(ops, router, cfg, x)
    want = select_experts(F.linear(x, router), cfg)
    assert torch.equal(ids, want.ids)
    torch.testing.assert_close(weights, want.weights, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(probs, torch.softmax(F.linear(x, router), dim=-1), atol=1e-6, rtol=1e-5)
    # exact ties: experts 3, 9 and 12 share a row, so do 5 and 6: their logits are equal bit for bit
    router[9] = router[3]
    router[12] = router[3]
    router[5] = 0.5 * router[3]  # 5 and 6 next, tied at the top-k boundary
    router[6] = router[5]
    # tokens aligned with row 3 (plus noise): experts 3, 9 and 12 lead, all three chosen, in index order
    x = torch.where(router[3] > 0, 1.0, -1.0) + 0.1 * torch.randn(t, h)
    probs, ids, weights = route(ops, router, cfg, x)
    assert probs[0, 3] == probs[0, 9] == probs[0, 12]
    assert torch.equal(probs[:, 5], probs[:, 6])
    # the lowest index first among equal values, the tie at the top-k boundary (5 and 6) included.
    # torch.topk on CPU does not promise that order (seen here: [12, 3, 9, ...] and 6 before 5 on some
    # rows), so on exact ties the graph's choice is this documented rule, not torch's.
    assert ids.tolist() == [[3, 9, 12, 5]] * t
    top = torch.topk(probs, cfg.top_k, dim=-1)
    want_w = _renorm(top.values, cfg).sort(dim=-1).values
    torch.testing.assert_close(weights.sort(dim=-1).values, want_w, atol=1e-7, rtol=1e-6)
    assert torch.equal(ids[:, :3].sort(dim=-1).values, top.indices[:, :3].sort(dim=-1).values)


def _renorm(top: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:  # [T, top_k] the chosen probabilities
    return top / top.sum(dim=-1, keepdim=True) if cfg.renormalize else top


def test_gpt_oss_decode_steps_run_in_the_graph(
    tmp_path: Path, smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpt-oss in the graph: its biased router, top-k of the logits then a softmax, MXFP4 experts with
    biases and the clamped SwiGLU (the experts' native call), attention sinks and alternating windows.
    A GGUF with Q8_0 attention (the graph runs block-quantized projections), so every decode step of
    staggered requests is one call; greedy tokens equal the Python fused path's, logprobs within
    LOGPROB_TOL (the router's sums). (The Python path equals transformers: tests/models/test_gpt_oss_gguf.py.)"""
    from models.test_gpt_oss import build_gpt_oss
    from models.test_gpt_oss_gguf import write_gpt_oss_gguf

    _, packed = build_gpt_oss(tmp_path, smollm2_dir)
    path = write_gpt_oss_gguf(packed, tmp_path / "gpt-oss-q8.gguf", attn_fmt="Q8_0")
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(path), max_model_len=MAX_LEN),
            cache=CacheConfig(
                cache_dtype="float32", block_size=4, num_kv_blocks=128, enable_prefix_caching=False
            ),
            max_num_seqs=4,
            max_num_batched_tokens=32,
        )
    )
    model = engine.loaded.model
    apply_gemm_dtype(model, torch.float32)
    arch = engine.loaded.arch
    assert arch.moe is not None and arch.moe.routing == "topk_softmax" and arch.moe.router_bias
    assert all(layer_refusal(s, arch.moe) is None for s in arch.layers)
    graph, _ = _graph_equals_fused_path(engine, monkeypatch)
    assert all(r is not None and r.routing == 1 and r.router_bias for r in graph.moes)


def test_graph_router_matches_gpt_oss_routing() -> None:
    """topk_softmax with a router bias (gpt-oss): the same experts as select_experts over
    F.linear(x, router, bias) on every token, weights within fp32 rounding."""
    ops = try_load_fused_ops()
    assert ops is not None
    torch.manual_seed(1)
    e, h, t = 32, 128, 48
    cfg = MoEConfig(
        "gpt_oss",
        e,
        4,
        h,
        32,
        routing="topk_softmax",
        router_bias=True,
        activation="swigluoai",
        expert_bias=True,
    )
    router, bias, x = torch.randn(e, h) * 0.1, torch.randn(e) * 0.5, torch.randn(t, h)
    logits, ids, weights = route(ops, router, cfg, x, bias)
    want = select_experts(F.linear(x, router, bias), cfg)
    assert torch.equal(ids, want.ids)
    torch.testing.assert_close(weights, want.weights, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(logits, F.linear(x, router, bias), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="router bias"):
        route(ops, router, cfg, x)
