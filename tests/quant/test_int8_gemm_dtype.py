"""gemm_dtype int8 (server/quant/gemm_dtype.py): `--dtype auto` on a CPU with AVX512-VNNI but no native bf16
(Ice Lake's class, simulated here with KUBEINFER_CPU_DISABLE=avx512_bf16,amx_bf16) keeps the layers in fp32
and lets every block-quantized GEMM with an int8-activation kernel take it, as llama.cpp does: a GGUF's
16-row tiles are held (about the file's bits) and run their VNNI kernel at every row count, where before such
a CPU read the file repacked with fp32 activations. On AVX2-only CPUs int8 too: the GEMV's decode rows, and
a GGUF's k-quant tiles on their AVX2 path.
The kernels' own int8 results are tested with the tiles (test_cpu_qk_native.py, test_q8_tiles.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from gemm_paths import decode_graph_rows
from gguf_models import write_tiny_gguf
from prompt_logprobs import engine_prompt_logprobs

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.native import usable_cpu_features
from server.quant import cpu_qgemv_q8 as q8
from server.quant import cpu_qlinear as cq
from server.quant.block_linear import BlockQuantLinear
from server.quant.cpu_qk_native import try_load_qk_native_kernel, vnni_usable
from server.quant.gemm_dtype import apply_gemm_dtype, cpu_gemm_dtype, int8_activations_run
from server.quant.gguf_checkpoint import SUPER_BLOCKS_ENV
from server.request import SamplingParams

NO_BF16 = "avx512_bf16,amx_bf16"  # what a CPU with AVX512-VNNI but no native bf16 lacks
PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colours:", "Water boils at"]


def test_auto_takes_int8_only_without_native_bf16_and_with_an_int8_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert cpu_gemm_dtype(torch.bfloat16, "auto") == torch.bfloat16
    assert cpu_gemm_dtype(torch.float32, "float32") == torch.float32  # explicit: exact fp32 activations
    assert cpu_gemm_dtype(torch.float32) == torch.float32
    monkeypatch.setenv("KUBEINFER_CPU_DISABLE", NO_BF16)
    assert cpu_gemm_dtype(torch.float32, "auto") == (torch.int8 if int8_activations_run() else torch.float32)
    monkeypatch.setenv("KUBEINFER_CPU_DISABLE", f"{NO_BF16},avx512_vnni")  # an AVX2-only CPU: the GEMV's path
    assert int8_activations_run() == usable_cpu_features().avx2
    monkeypatch.setenv(
        "KUBEINFER_CPU_DISABLE", f"{NO_BF16},avx512_vnni,avx2"
    )  # neither: no int8 path beats fp32
    assert not int8_activations_run()
    assert cpu_gemm_dtype(torch.float32, "auto") == torch.float32


@pytest.fixture(scope="module", autouse=True)
def kernels_loaded_first() -> None:
    """The kernels loaded (cached per process and cache folder) with this CPU's own features before a test
    here disables some: a kernel loaded under KUBEINFER_CPU_DISABLE keeps that path for the rest of the
    worker's tests (a qlinear without its bf16 path)."""
    kernel = cq.try_load_qlinear_kernel()
    if kernel is not None:
        q8.try_load_q8_gemv_kernel(kernel)
    try_load_qk_native_kernel()


@pytest.mark.parametrize("path", ["vnni", "avx2", "neither"])
def test_the_embedded_model_without_native_bf16(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, path: str
) -> None:
    """`python -m server`'s defaults on a CPU without native bf16: with AVX512-VNNI (Ice Lake's class) the
    Q4_1 projections and the Q8_0 head (16-row tiles) take int8 activations, a 600-token prefill through
    the int8 batched path and no dense GEMM; with AVX2 the GEMV takes the decode rows and the head stays
    row-major; with neither, fp32 everywhere. No bf16 GEMM in any. (The kernels stay loaded with this CPU's
    path, so under a simulated AVX2 the batched calls still run VNNI: the AVX2 case checks the choice, not
    the timing path.)"""
    off = {"vnni": "", "avx2": ",avx512_vnni", "neither": ",avx512_vnni,avx2"}[path]
    monkeypatch.setenv("KUBEINFER_CPU_DISABLE", NO_BF16 + off)
    if path != "neither" and q8.path_for(usable_cpu_features()) != path:
        pytest.skip(f"no {path} path here")
    qlinear = cq.try_load_qlinear_kernel()
    loaded = q8.try_load_q8_gemv_kernel(qlinear) if qlinear is not None else None
    if loaded is not None:
        # The kernel was loaded with this CPU's features (kernels_loaded_first); where those include AMX-BF16
        # its batched path stops at AMX_GEMM_MAX_ROWS. A CPU without native bf16 loads it without that limit.
        # (a frozen dataclass, shared by every caller: set in place, put back after the test)
        kept = loaded.gemm_max_rows
        object.__setattr__(loaded, "gemm_max_rows", q8.gemm_max_rows_for(usable_cpu_features()))
        request.addfinalizer(lambda: object.__setattr__(loaded, "gemm_max_rows", kept))
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=None)))
    want = torch.float32 if path == "neither" else torch.int8
    assert engine.info.gemm_dtype == str(want).removeprefix("torch.")
    layers = _projections(engine)
    assert all(m.gemm_dtype == want for m in layers)
    assert {m.weight_q.fmt for m in layers} == ({"q4_1", "q8_0_x16"} if path == "vnni" else {"q4_1", "q8_0"})
    kernel = layers[0].kernel
    assert kernel is not None
    fast = q8.active_kernel(kernel)  # the int8 GEMV takes int8 layers' decode rows by default
    assert (fast is not None and fast.supports(layers[0].weight_q, 1, want)) == (path != "neither")
    dense: list[torch.dtype] = []
    int8_rows: list[int] = []
    gemm, linear = BlockQuantLinear._dequant_gemm, q8.Q8GemvKernel.linear

    def dense_spy(self, x, w, kernel, compute=torch.float32, out_dtype=torch.float32):  # type: ignore[no-untyped-def]
        dense.append(compute)
        return gemm(self, x, w, kernel, compute, out_dtype)

    def int8_spy(self, x, w, bias=None, out=None, compute=torch.float32):  # type: ignore[no-untyped-def]
        int8_rows.append(x.shape[0])
        return linear(self, x, w, bias, out, compute)

    monkeypatch.setattr(BlockQuantLinear, "_dequant_gemm", dense_spy)
    monkeypatch.setattr(q8.Q8GemvKernel, "linear", int8_spy)
    words = ("the quick brown fox jumps over the lazy dog and " * 80).strip()
    prompt = engine.tokenizer.encode(words)[:600]
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))
    assert torch.bfloat16 not in dense
    if path == "vnni":
        assert not dense and 600 in int8_rows  # the int8 batched path took the whole prefill
    elif path == "neither":
        assert dense and set(dense) == {torch.float32} and not int8_rows  # past GEMM_MIN_ROWS: fp32
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def _projections(engine: LLMEngine) -> list[BlockQuantLinear]:
    return [m for m in engine.loaded.model.modules() if isinstance(m, BlockQuantLinear)]


@pytest.mark.slow
def test_gguf_on_a_vnni_cpu_without_bf16_holds_tiles_and_takes_int8_activations(
    tiny_model_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Q4_K_M-style file (Q4_K projections, Q6_K embedding and tied head) served with the defaults on a
    simulated Ice Lake: its tensors are 16-row tiles (4.625 / 6.56 bits per weight; the repacks held 6.0 /
    10.0), every projection's gemm_dtype is int8, decode runs in the decode graph, and prompt logprobs and
    greedy tokens stay those of the same engine with fp32 activations within int8 activations' error."""
    monkeypatch.setenv("KUBEINFER_CPU_DISABLE", NO_BF16)
    if not int8_activations_run() or not vnni_usable():
        pytest.skip("the int8-activation kernels' AVX512-VNNI path (the tiles') does not run here")
    hf_folder = tiny_model_factory("llama", tie=True, hidden=256)
    path = write_tiny_gguf(hf_folder, tmp_path / "tiny-k.gguf", "Q4_K", embedding_fmt="Q6_K")
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(path), cache_dir=tmp_path / "cache"),
            cache=CacheConfig(cache_dtype="float32"),
        )
    )
    assert engine.info.gemm_dtype == "int8" and engine.info.quantization == "gguf-q4_k+q6_k"
    projections = _projections(engine)
    assert projections and all(m.gemm_dtype == torch.int8 for m in projections)
    assert {m.weight_q.fmt for m in projections} == {"q4_k_x16", "q6_k_x16"}
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    ours = engine_prompt_logprobs(engine, prompts[1])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    rows = decode_graph_rows(monkeypatch)
    int8 = engine.generate(prompts, params)
    assert rows, "decode did not run in the decode graph"
    # every projection is a tile: bf16 layers run the same int8 kernels, bit for bit
    apply_gemm_dtype(engine.loaded.model, torch.bfloat16)
    assert torch.equal(engine_prompt_logprobs(engine, prompts[1]), ours)
    apply_gemm_dtype(engine.loaded.model, torch.float32)  # the same weights, fp32 activations (exact)
    exact = engine_prompt_logprobs(engine, prompts[1])
    fp32 = engine.generate(prompts, params)
    error = (ours - exact).abs()
    # measured here (Zen 5, simulated, 2026-12-06): mean 0.035, max 0.080 nats; 3 of 4 greedy streams equal
    assert error.mean() <= 0.07 and error.max() <= 0.3, (error.mean(), error.max())
    identical = sum(a == b for a, b in zip(int8, fp32, strict=True))
    assert identical >= 2, (int8, fp32)
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


@pytest.mark.slow
def test_a_gguf_draft_is_laid_out_for_the_gemm_dtype_it_gets(
    tiny_model_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Q4_K draft beside an F16 GGUF target (nothing block-quantized, so the engine's GEMM dtype falls
    back to fp32) on the simulated CPU: the draft is loaded for the dtype the engine sets on it (fp32:
    repacked, not tiles, whose fp32 path is ~10x slower at decode), and the drafted run serves."""
    from server.spec_decode.config import SpeculativeConfig

    monkeypatch.setenv("KUBEINFER_CPU_DISABLE", NO_BF16)
    if not int8_activations_run() or not vnni_usable():
        pytest.skip("the int8-activation kernels' AVX512-VNNI path (the tiles') does not run here")
    hf_folder = tiny_model_factory("llama", tie=True, hidden=256)
    target = write_tiny_gguf(hf_folder, tmp_path / "target-f16.gguf", "F16")
    draft_path = write_tiny_gguf(hf_folder, tmp_path / "draft-q4k.gguf", "Q4_K", embedding_fmt="Q6_K")
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(target), cache_dir=tmp_path / "cache"),
            cache=CacheConfig(cache_dtype="float32"),
            speculative=SpeculativeConfig("draft_model", 2, model=str(draft_path)),
        )
    )
    assert engine.info.gemm_dtype == "float32" and not _projections(engine)
    assert engine.speculator is not None
    draft = engine.speculator.proposer.model  # type: ignore[attr-defined]
    linears = [m for m in draft.modules() if isinstance(m, BlockQuantLinear)]
    assert linears and all(m.gemm_dtype == torch.float32 for m in linears)
    assert {m.weight_q.fmt for m in linears} == {"q4_k", "q6_k"}  # tiles were held and run fp32
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:2]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [len(o) for o in outs] == [6, 6]
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


# an AVX2-only CPU (AMD Zen 2/3, Intel Haswell..Skylake client): no AVX-512 at all
AVX2_ONLY = "avx512f,avx512_bf16,avx512_vnni,avx_vnni,amx_tile,amx_bf16"


@pytest.mark.slow
def test_gguf_on_an_avx2_cpu_holds_tiles_at_the_files_bits(
    tiny_model_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """The Q4_K_M-style file with the defaults on a simulated AVX2-only CPU (the tile kernel's avx2 path set
    in this process's library; its AVX2-only build is test_cpu_qk_native's): held as 16-row tiles at about
    the file's bits (before: repacked at 6.0 / 10.0), every projection int8 and in its tile kernel at every
    row count; its logprobs are the vnni path's bit for bit, and greedy decoding gives the tokens the
    repacked layout gave."""
    monkeypatch.setenv("KUBEINFER_CPU_DISABLE", AVX2_ONLY)
    qk = try_load_qk_native_kernel()  # the instance the loader asks
    if qk is None:
        pytest.skip("the tile kernel cannot be built here")
    default = qk.isa
    request.addfinalizer(lambda: qk.set_path(default))
    if not int8_activations_run() or qk.set_path("avx2") != "avx2":
        pytest.skip("no AVX2 here")
    hf_folder = tiny_model_factory("llama", tie=True, hidden=256)
    path = write_tiny_gguf(hf_folder, tmp_path / "tiny-k.gguf", "Q4_K", embedding_fmt="Q6_K")

    def engine() -> LLMEngine:
        config = ModelConfig(model=str(path), cache_dir=tmp_path / "cache")
        return LLMEngine(EngineConfig(model=config, cache=CacheConfig(cache_dtype="float32")))

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    monkeypatch.setenv(SUPER_BLOCKS_ENV, "0")  # as before: repacked
    before = engine()
    prompts = [before.tokenizer.encode(p) for p in PROMPTS]
    assert {m.weight_q.fmt for m in _projections(before)} == {"q4_k", "q6_k"}
    repacked_bytes = sum(m.weight_q.nbytes() for m in _projections(before))
    repacked_tokens = before.generate(prompts, params)
    del before
    monkeypatch.delenv(SUPER_BLOCKS_ENV)
    tiles = engine()
    assert tiles.info.gemm_dtype == "int8"
    projections = _projections(tiles)
    assert {m.weight_q.fmt for m in projections} == {"q4_k_x16", "q6_k_x16"}
    assert all(m.gemm_dtype == torch.int8 and m.gemm_min_rows == sys.maxsize for m in projections)
    file_bits = {"q4_k_x16": 4.5, "q6_k_x16": 6.5625}
    held = sum(m.weight_q.nbytes() for m in projections)
    in_file = sum(m.in_features * m.out_features * file_bits[m.weight_q.fmt] / 8 for m in projections)
    assert held <= 1.03 * in_file and held < 0.8 * repacked_bytes, (held, in_file, repacked_bytes)
    rows = decode_graph_rows(monkeypatch)
    tokens = tiles.generate(prompts, params)
    assert rows, "decode did not run in the decode graph"
    # measured here (Zen 5, simulated, 2026-12-06): 4 of 4 greedy streams equal
    assert sum(a == b for a, b in zip(tokens, repacked_tokens, strict=True)) >= 3, (tokens, repacked_tokens)
    ours = engine_prompt_logprobs(tiles, prompts[1])
    if qk.set_path("vnni") == "vnni":
        assert torch.equal(engine_prompt_logprobs(tiles, prompts[1]), ours)
    assert tiles.kv.pool.num_free_blocks == tiles.kv.pool.num_blocks
