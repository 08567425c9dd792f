"""The decode graph (server/models/decode_graph.py) for every dense layer kind of the layer contract: tiny
random Gemma 1, Gemma 2 (attention and final logit soft-caps), Gemma 3 (sliding windows shorter than the
prompts on both, a local RoPE base), Phi-3 (partial rotary, LongRoPE), Granite (multipliers), OLMo 2
(post-norms, q/k norms over the projection) and SmolLM3 (NoPE layers), quantized to q8_0 blocks with
--quantize: the graph is recorded and its tokens and logprobs are the Python fused path's bit for bit;
greedy tokens equal transformers' on the same (dequantized) weights."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from prompt_logprobs import hf_on_our_weights, model_greedy
from test_arch_parity import MAX_LEN, build

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.models.decode_graph import DecodeGraph
from server.quant.block_linear import BlockQuantLinear
from server.quant.gemm_dtype import apply_gemm_dtype
from server.request import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):",
]
WINDOW = 6  # Gemma 2/3's sliding layers: shorter than every prompt


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            folder = build(tmp_path_factory.mktemp(f"graph-{kind}"), smollm2_dir, kind, tie=kind != "olmo2")
            if kind in ("gemma2", "gemma3"):
                cfg = json.loads((folder / "config.json").read_text())
                cfg["sliding_window"] = WINDOW
                (folder / "config.json").write_text(json.dumps(cfg))
            made[kind] = folder
        return made[kind]

    return make


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:  # kernels built once for the module
    return tmp_path_factory.mktemp("cache")


def _engine(folder: Path, cache: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(
                model=str(folder), dtype="float32", quantize="q8_0", max_model_len=MAX_LEN, cache_dir=cache
            ),
            # no prefix cache: each run computes its prompts whole, so the runs differ by the graph only
            cache=CacheConfig(block_size=4, num_kv_blocks=128, enable_prefix_caching=False),
            # 8 seats and 32-token steps: Gemma 2/3's windowed layers get a KV group smaller than the
            # global layers' (8 x (2 + 2) + 8 = 40 blocks: what their running windows can use)
            max_num_seqs=8,
            max_num_batched_tokens=32,
        )
    )


def _generate(engine: LLMEngine, graph: bool) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy with logprobs, requests joining one step apart (prefill and decode steps both occur)."""
    model = engine.loaded.model
    model.use_decode_graph = graph
    model._decode_graph = None
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    lps: dict[str, list[float]] = {str(i): [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        if pending:
            i, p = pending.pop(0)
            engine.add_request(str(i), p, params)
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            lps[out.request_id] += [t.logprob for lp in out.new_logprobs for t in (lp.chosen, *lp.top)]
    return list(tokens.values()), list(lps.values())


@pytest.mark.parametrize("kind", ["gemma3", "gemma2", "phi3", "granite", "olmo2", "smollm3", "gemma"])
def test_graph_bit_identical_and_greedy_parity(tiny: Callable[[str], Path], cache: Path, kind: str) -> None:
    folder = tiny(kind)
    engine = _engine(folder, cache)
    model = engine.loaded.model
    assert model.fused_ops is not None
    if kind in ("gemma2", "gemma3"):
        assert {s.sliding_window for s in engine.loaded.arch.layers} == {WINDOW, None}
        # the windowed layers' caches are their own KV group's, smaller (server/core/kv_groups.py): the
        # graph gives those layers the step's group-1 slots and tables
        layers, caches = engine.loaded.arch.layers, engine.runner.kv_caches
        sizes = {(s.sliding_window, k.shape[0]) for s, (k, _) in zip(layers, caches, strict=True)}
        (windowed,), (full,) = ([n for w, n in sizes if w == want] for want in (WINDOW, None))
        assert windowed < full
    if kind == "gemma2":  # both caps in play: the graph's attention and compute_logits after it
        assert {s.attn_softcap for s in engine.loaded.arch.layers} == {2.0}
        assert engine.loaded.arch.final_logit_softcap == 5.0
    want_tokens, want_lps = _generate(engine, graph=False)
    assert model._decode_graph is None
    got_tokens, got_lps = _generate(engine, graph=True)
    assert model._decode_graph is not None and isinstance(model._decode_graph[1], DecodeGraph)
    assert got_tokens == want_tokens
    assert got_lps == want_lps  # exact: the same kernels in the same order on the same buffers
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    hf = hf_on_our_weights(folder, engine)
    prompts = [engine.tokenizer.encode(text) for text in PROMPTS]
    assert model_greedy(hf, prompts, [len(ours) for ours in got_tokens]) == got_tokens


def test_fused_path_serves_the_new_kinds(tiny: Callable[[str], Path], cache: Path) -> None:
    """fp32 dense weights (the oneDNN-packed projections, no graph): every dense layer kind now runs the
    compiled fused ops; greedy tokens equal the torch path's (the eager module calls) and prompt
    logprobs agree within 1e-4 (the fused norms sum in another order)."""
    folder = tiny("gemma3")
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(folder), dtype="float32", max_model_len=MAX_LEN, cache_dir=cache),
            cache=CacheConfig(block_size=4, num_kv_blocks=128),
        )
    )
    model = engine.loaded.model
    assert model.fused_ops is not None and model.config.fused_cpu
    fused = _generate(engine, graph=True)
    ops, model.fused_ops = model.fused_ops, None
    try:
        eager = _generate(engine, graph=True)
    finally:
        model.fused_ops = ops
    assert fused[0] == eager[0]
    torch.testing.assert_close(
        torch.tensor([x for row in fused[1] for x in row]),
        torch.tensor([x for row in eager[1] for x in row]),
        atol=1e-4,
        rtol=0,
    )


@pytest.mark.parametrize("kind", ["gemma3", "granite"])
def test_graph_runs_separate_q_k_v_of_a_mixed_gguf(tmp_path: Path, cache: Path, kind: str) -> None:
    """A Gemma 3 or Granite (its multipliers, an untied head) GGUF whose attn_v is Q6_K and attn_q/attn_k
    Q8_0 (a Q4_K_M file's mix): q, k and v stay separate projections, the graph writes them into the
    columns of one qkv buffer and gives what the Python fused path gives, bit for bit; greedy tokens
    equal transformers' on the file's weights. (Phi-3's GGUF holds one fused attn_qkv: one format.)"""
    from gguf_archs import write_arch_gguf
    from test_gguf_archs import FMTS, _build
    from transformers import AutoModelForCausalLM

    hf = _build(tmp_path / "hf", kind)
    path = write_arch_gguf(hf, tmp_path / f"{kind}.gguf", tmp_path / "ref", {**FMTS, "attn_v": "Q6_K"})
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(path), max_model_len=MAX_LEN, cache_dir=cache),
            cache=CacheConfig(
                block_size=4, num_kv_blocks=128, enable_prefix_caching=False, cache_dtype="float32"
            ),
        )
    )
    apply_gemm_dtype(engine.loaded.model, torch.float32)
    attn = engine.loaded.model.decoder_layers()[0].self_attn
    assert (
        attn.qkv_proj is None and isinstance(attn.v_proj, BlockQuantLinear) and attn.v_proj.method == "q6_k"
    )
    want = _generate(engine, graph=False)
    got = _generate(engine, graph=True)
    entry = engine.loaded.model._decode_graph
    assert entry is not None and isinstance(entry[1], DecodeGraph)
    assert len(entry[1].projections[0]) == 6  # q, k, v, o, gate_up, down
    assert got == want
    ref = AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "ref"), dtype=torch.float32, attn_implementation="eager"
    )
    with torch.inference_mode():
        for text, ours in zip(PROMPTS, got[0], strict=True):
            ids = engine.tokenizer.encode(text)
            out = ref.generate(  # type: ignore[operator]
                torch.tensor([ids]), max_new_tokens=len(ours), do_sample=False, min_new_tokens=len(ours)
            )
            assert out[0, len(ids) :].tolist() == ours, text
