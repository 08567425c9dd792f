"""The decode graph (server/models/decode_graph.py): a pure-decode step's layers in one compiled call give
bit-identical results to the Python-driven fused path, it records only for what it can run, and it
refuses a step it cannot."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_models import write_tiny_gguf

from server.attention.metadata import AttentionMetadata
from server.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig
from server.engine import LLMEngine
from server.models.decode_graph import DecodeGraph
from server.quant import cpu_qlinear as cq
from server.quant.block_linear import BF16_GEMM_MIN_ROWS, BlockQuantLinear
from server.quant.cpu_qlinear import compute_flag
from server.quant.gemm_dtype import apply_gemm_dtype
from server.request import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colours:"]
# Eight sequences: decode batches of 4..8 rows, the kernel's batched path (bf16 under bf16 GEMMs).
MANY = [*PROMPTS, "Once upon a time", "import numpy as np", "Dear Sir or Madam,", "1, 2, 3,", "Q: why?"]


@pytest.fixture(scope="module")
def tiny_q41(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory) -> Path:  # type: ignore[no-untyped-def]
    hf = tiny_model_factory("llama", tie=True)
    return write_tiny_gguf(hf, tmp_path_factory.mktemp("gguf") / "tiny-Q4_1.gguf", "Q4_1")


@pytest.fixture(scope="module")
def tiny_q41_hd32(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory) -> Path:  # type: ignore[no-untyped-def]
    """head_dim 32: an int8 KV cache's groups (server/attention/int8_kv.py) need a multiple of 32."""
    hf = tiny_model_factory("llama", tie=True, heads=2, kv_heads=1)
    return write_tiny_gguf(hf, tmp_path_factory.mktemp("gguf") / "tiny-hd32-Q4_1.gguf", "Q4_1")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:  # kernels built once for the module
    return tmp_path_factory.mktemp("cache")


def _generate(
    engine: LLMEngine, graph: bool, texts: list[str] = PROMPTS
) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy with logprobs, requests joining one step apart (so prefill and decode steps both occur)."""
    engine.loaded.model.use_decode_graph = graph
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [engine.tokenizer.encode(p) for p in texts]
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


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float16", "int8"])
def test_graph_is_bit_identical_to_the_python_path(
    request: pytest.FixtureRequest, cache: Path, kv_dtype: str
) -> None:
    """Per --kv-cache-dtype: the graph's K/V write (kubeinfer_kv_store) rounds as the Python path's
    `.to()` does (an int8 cache: both write through it), and both read the cache with the same kernel."""
    model_file = request.getfixturevalue("tiny_q41_hd32" if kv_dtype == "int8" else "tiny_q41")
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(model_file), cache_dir=cache), cache=CacheConfig(cache_dtype=kv_dtype)
        )
    )
    assert engine.runner.kv_caches[0][0].dtype == getattr(torch, kv_dtype)
    assert engine.loaded.model.config.head_dim % 32 == 0 or kv_dtype != "int8"
    assert engine.info.kv_cache_dtype == kv_dtype
    model = engine.loaded.model
    want_tokens, want_lps = _generate(engine, graph=False)
    assert model._decode_graph is None
    got_tokens, got_lps = _generate(engine, graph=True)
    assert model._decode_graph is not None and isinstance(model._decode_graph[1], DecodeGraph)
    assert got_tokens == want_tokens
    assert got_lps == want_lps  # exact: the same kernels in the same order on the same buffers
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_graph_is_bit_identical_under_bf16_gemms(tiny_q41: Path, cache: Path) -> None:
    """bf16 GEMMs (the kernel's bf16 batched path for 4..8-row decode batches where the CPU has
    AVX512-BF16): the graph gives what the Python path gives, bit for bit; switched back to fp32 after
    recording, it follows (its descriptors' compute flags are synced every step)."""
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_q41), cache_dir=cache)))
    model = engine.loaded.model
    apply_gemm_dtype(model, torch.bfloat16)
    want_tokens, want_lps = _generate(engine, graph=False, texts=MANY)
    got_tokens, got_lps = _generate(engine, graph=True, texts=MANY)
    assert model._decode_graph is not None and isinstance(model._decode_graph[1], DecodeGraph)
    assert got_tokens == want_tokens
    assert got_lps == want_lps
    apply_gemm_dtype(model, torch.float32)
    fp32_tokens, fp32_lps = _generate(engine, graph=False, texts=MANY)
    assert _generate(engine, graph=True, texts=MANY) == (fp32_tokens, fp32_lps)
    kernel = model.decoder_layers()[0].self_attn.qkv_proj.kernel
    if kernel is not None and kernel.bf16:
        assert fp32_lps != want_lps  # the bf16 path really ran
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_graph_records_only_what_it_can_run(tiny_q41: Path, tiny_model_factory, cache: Path) -> None:  # type: ignore[no-untyped-def]
    # Dense fp32 projections (oneDNN-packed) are not the block kernel's: the Python path serves.
    dense = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(tiny_model_factory("llama")), dtype="float32", cache_dir=cache)
        )
    )
    _generate(dense, graph=True)
    assert dense.loaded.model._decode_graph is not None and dense.loaded.model._decode_graph[1] is None
    # LoRA wraps the projections: they compute more than the kernel does.
    lora = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(tiny_q41), cache_dir=cache), lora=LoRAConfig(enable_lora=True)
        )
    )
    _generate(lora, graph=True)
    assert lora.loaded.model._decode_graph is not None and lora.loaded.model._decode_graph[1] is None


def test_graph_refuses_steps_it_cannot_run(tiny_q41: Path, cache: Path) -> None:
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_q41), cache_dir=cache)))
    _generate(engine, graph=True)
    entry = engine.loaded.model._decode_graph
    assert entry is not None and entry[1] is not None
    graph = entry[1]
    hidden, d = graph.dims[0], graph.dims[4]
    h, cos, sin = torch.randn(2, hidden), torch.randn(2, d), torch.randn(2, d)

    def meta(slots: list[int], ctx: list[int], query_lens: tuple[int, ...] = (1, 1)) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.zeros(2, 2, dtype=torch.int32),
            context_lens=torch.tensor(ctx, dtype=torch.int32),
            query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
            max_query_len=max(query_lens),
            max_context_len=max(ctx),
            query_lens_cpu=query_lens,
            context_lens_cpu=tuple(ctx),
        )

    with pytest.raises(ValueError, match="pure-decode"):
        graph.run(h, [(cos, sin)], meta([0, 1], [1, 1], (1, 2)))
    with pytest.raises(ValueError, match="slot out of range"):
        graph.run(h, [(cos, sin)], meta([0, graph.num_cache_slots], [1, 1]))
    with pytest.raises(ValueError, match="context_lens"):
        graph.run(h, [(cos, sin)], meta([0, 1], [1, 10**6]))
    with pytest.raises(ValueError, match="cos"):
        graph.run(h, [(cos[:1], sin)], meta([0, 1], [1, 1]))
    with pytest.raises(ValueError, match="h must be"):
        graph.run(h.double(), [(cos, sin)], meta([0, 1], [1, 1]))


def test_graph_runs_qwen3_qk_norm_bit_identical(tiny_model_factory, cache: Path) -> None:  # type: ignore[no-untyped-def]
    """Qwen3 (q_norm/k_norm per head, head_dim 32 with hidden 64) quantized to q8_0 blocks: the graph is
    recorded (it runs the q/k norms itself) and gives what the Python fused path gives."""
    folder = tiny_model_factory("qwen3", tie=False)
    engine = LLMEngine(
        EngineConfig(model=ModelConfig(model=str(folder), dtype="float32", quantize="q8_0", cache_dir=cache))
    )
    model = engine.loaded.model
    assert model.config.qk_norm and model.fused_ops is not None
    want_tokens, want_lps = _generate(engine, graph=False)
    model._decode_graph = None
    got_tokens, got_lps = _generate(engine, graph=True)
    assert model._decode_graph is not None and isinstance(model._decode_graph[1], DecodeGraph)
    assert got_tokens == want_tokens
    assert got_lps == want_lps
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_bf16_decode_batches_from_the_crossover_leave_the_graph(
    tiny_q41: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under bf16 GEMMs the graph serves decode batches below BF16_GEMM_MIN_ROWS on the kernel (its bf16
    batched path from 5 rows); a batch of BF16_GEMM_MIN_ROWS sequences goes through the Python path and
    its bf16 dequantize + GEMM. (The batched int8 path, which takes such batches on AVX512-VNNI CPUs by
    default, is off here: test_cpu_qgemv_q8.py holds it.)"""
    monkeypatch.setenv("KUBEINFER_INT8_GEMM", "0")
    engine = LLMEngine(
        EngineConfig(model=ModelConfig(model=str(tiny_q41), cache_dir=cache), max_num_seqs=BF16_GEMM_MIN_ROWS)
    )
    apply_gemm_dtype(engine.loaded.model, torch.bfloat16)
    graph_rows: list[int] = []
    gemm_rows: list[tuple[int, torch.dtype]] = []
    run, gemm = DecodeGraph.run, BlockQuantLinear._dequant_gemm

    def spy_run(self, h, tables, meta):  # type: ignore[no-untyped-def]
        graph_rows.append(h.shape[0])
        return run(self, h, tables, meta)

    def spy_gemm(self, x, w, kernel, compute=torch.float32, out_dtype=torch.float32):  # type: ignore[no-untyped-def]
        gemm_rows.append((x.shape[0], compute))
        return gemm(self, x, w, kernel, compute, out_dtype)

    monkeypatch.setattr(DecodeGraph, "run", spy_run)
    monkeypatch.setattr(BlockQuantLinear, "_dequant_gemm", spy_gemm)
    prompt = engine.tokenizer.encode("one two")
    engine.generate([prompt] * 8, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert graph_rows and max(graph_rows) == 8 and not gemm_rows  # small batches: the graph, the kernel
    graph = engine.loaded.model._decode_graph[1]  # type: ignore[index]
    assert graph is not None and graph.max_rows == BF16_GEMM_MIN_ROWS - 1
    graph_rows.clear()
    many = [prompt] * BF16_GEMM_MIN_ROWS
    outs = engine.generate(many, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(set(map(tuple, outs))) == 1  # the same prompt: the same tokens at every batch size
    assert all(r < BF16_GEMM_MIN_ROWS for r in graph_rows)
    # the full decode batches ran the projections' bf16 GEMMs (q/k/v, o, gate/up, down per layer)
    decode = [c for r, c in gemm_rows if r == BF16_GEMM_MIN_ROWS]
    assert len(decode) >= 4 * 2 and set(decode) == {torch.bfloat16}
    apply_gemm_dtype(engine.loaded.model, torch.float32)
    assert graph.max_rows == DecodeGraph.MAX_ROWS


def test_a_gemm_dtype_set_after_recording_reaches_the_graph(tiny_q41: Path, cache: Path) -> None:
    """The graph reads its projections' gemm_dtype again only when one was assigned (a counter on
    BlockQuantLinear, not 120 attribute reads a step): one projection set directly to bf16 after recording
    lowers `max_rows` and sets that projection's compute flag; set back, both return. fp32 GEMMs to start
    with on every CPU (`--dtype auto` is bf16 where AVX512-BF16 is usable)."""
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_q41), cache_dir=cache)))
    apply_gemm_dtype(engine.loaded.model, torch.float32)
    prompt = engine.tokenizer.encode("one two")
    engine.generate([prompt] * 2, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    graph = engine.loaded.model._decode_graph[1]  # type: ignore[index]
    assert graph is not None and graph.max_rows == DecodeGraph.MAX_ROWS
    down = graph.projections[-1][-1]
    changes = BlockQuantLinear.gemm_dtype_changes
    down.gemm_dtype = torch.bfloat16
    assert BlockQuantLinear.gemm_dtype_changes == changes + 1
    assert graph.max_rows == BF16_GEMM_MIN_ROWS - 1
    assert graph.descriptors[-1].compute == compute_flag(torch.bfloat16) != compute_flag(torch.float32)
    down.gemm_dtype = torch.float32
    graph.sync_compute()
    assert graph.max_rows == DecodeGraph.MAX_ROWS
    assert graph.descriptors[-1].compute == compute_flag(torch.float32)


def test_packed_weights_keep_the_graph_and_the_python_path_bit_identical(
    tiny_q41: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine packs its bf16 projections for the batched int8 path (pack_int8_weights); decode batches
    of 4..8 rows read the copies, in the graph (descriptors point to them) and in Python, and give what the
    unpacked weights give, bit for bit. KUBEINFER_INT8_PACK=0 packs nothing; unset, only what fits in a
    share of the available memory."""
    from server import cpu_env
    from server.quant import cpu_qgemv_q8 as q8
    from server.quant.gemm_dtype import pack_int8_weights

    fast = q8.try_load_q8_gemv_kernel(cq.load_qlinear_kernel(cache), cache)
    if fast is None or fast.isa != "vnni":
        pytest.skip("the batched int8 path (and its packed weights) runs on AVX512-VNNI only")
    results = []
    for switch in ("0", "1"):
        monkeypatch.setenv(q8.PACK_ENABLE_ENV, switch)
        engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_q41), cache_dir=cache)))
        model = engine.loaded.model
        apply_gemm_dtype(model, torch.bfloat16)
        with q8.int8_gemm(True):
            pack_int8_weights(model)  # (the engine packed already where --dtype auto is bf16)
            linears = [m for m in model.modules() if isinstance(m, BlockQuantLinear)]
            assert all((m.weight_q.packed is not None) == (switch == "1") for m in linears)
            graph = _generate(engine, graph=True, texts=MANY)
            descriptors = engine.loaded.model._decode_graph[1].descriptors
            assert all(bool(d.packed) == (switch == "1") for d in descriptors)
            assert _generate(engine, graph=False, texts=MANY) == graph
        results.append(graph)
    assert results[0] == results[1]
    # unset: packed only if the copies fit in PACK_MEMORY_SHARE of MemAvailable
    monkeypatch.setenv(q8.PACK_ENABLE_ENV, "0")
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_q41), cache_dir=cache)))
    apply_gemm_dtype(engine.loaded.model, torch.bfloat16)
    monkeypatch.delenv(q8.PACK_ENABLE_ENV)
    monkeypatch.setattr(cpu_env, "available_memory_bytes", lambda: 1024)
    with q8.int8_gemm(True):
        assert pack_int8_weights(engine.loaded.model) == 0
        monkeypatch.setattr(cpu_env, "available_memory_bytes", lambda: 1 << 40)
        assert pack_int8_weights(engine.loaded.model) > 0
        assert pack_int8_weights(engine.loaded.model) == 0  # once
    monkeypatch.setenv(q8.PACK_ENABLE_ENV, "yes")
    with pytest.raises(ValueError, match=q8.PACK_ENABLE_ENV):
        pack_int8_weights(engine.loaded.model)


def test_graph_runs_windowed_layers_bit_identical(tiny_q41: Path, cache: Path) -> None:
    """Sliding-window layers interleaved with global ones: the graph calls the windowed decode entry point
    with each layer's window and gives what the Python path gives, bit for bit (a different answer from
    the same model without windows, on prompts longer than the window)."""
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_q41), cache_dir=cache)))
    model = engine.loaded.model
    texts = [p * 3 for p in PROMPTS]  # ~15-25 tokens, past a 4-token window
    full_tokens, _ = _generate(engine, graph=True, texts=texts)
    assert model._decode_graph is not None and isinstance(model._decode_graph[1], DecodeGraph)
    for i, layer in enumerate(model.decoder_layers()):
        layer.self_attn.sliding_window = 4 if i % 2 == 0 else None  # interleaved
    model._decode_graph = None
    want_tokens, want_lps = _generate(engine, graph=False, texts=texts)
    got_tokens, got_lps = _generate(engine, graph=True, texts=texts)
    assert model._decode_graph is not None and isinstance(model._decode_graph[1], DecodeGraph)
    assert got_tokens == want_tokens and got_lps == want_lps
    assert want_tokens != full_tokens
