"""MoE GGUF files served as they are (server/models/moe/gguf.py, server/quant/gguf_checkpoint.py): tiny
Mixtral (llama.cpp's `llama` layout with `ffn_*_exps` + `ffn_gate_inp`, q/k permuted), Qwen2-MoE
(`qwen2moe`, with `ffn_*_shexp` + `ffn_gate_inp_shexp` and a dense layer) and Qwen3-MoE (`qwen3moe`,
q/k norms) written with gguf-py from the weights of tests/moe/moe_models.py.

Two references: transformers fp32 over exactly the weights the file holds (gguf-py's dequantization:
`save_dequantized`), which our quantized serving must equal (greedy token for token, prompt logprobs
within 1e-4: only summation order differs); and the original fp32 model, which it must stay within
the quant type's error of (measured largest prompt-logprob error: F16 9e-4, Q8_0 0.016-0.017, Q4_K/Q6_K
1.37 on these random N(0, 0.08) weights with a Q4_K embedding; asserted 0.005, 0.1 and 2). Experts of
a kept type stay quantized (`BlockQuantExperts`), Qwen2-MoE's shared expert too (two BlockQuantLinear);
F16 ones are held fp32. Slow (each file's tokenizer
is converted from its GGUF metadata, ~30-80 s a file on a loaded 2-core machine)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from moe_gguf import save_dequantized, write_moe_gguf
from moe_models import PROMPTS, build
from prompt_logprobs import engine_prompt_logprobs, hf_greedy, hf_prompt_logprobs

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.models.moe.block import SparseMoeBlock
from server.models.moe.quant import BlockQuantExperts
from server.quant import weight_bytes
from server.quant.block_linear import BlockQuantLinear
from server.quant.cpu_qgemv_q8 import active_kernel, int8_pack_switch
from server.quant.cpu_qlinear import try_load_qlinear_kernel
from server.quant.gemm_dtype import apply_gemm_dtype
from server.quant.gguf_checkpoint import super_blocks_enabled
from server.request import SamplingParams

NEW = 10
pytestmark = pytest.mark.slow
# largest prompt-logprob error vs the fp32 model; Q4_0 (the mixed file's up projections) bounded as Q4_K
QUANT_TOL = {"F16": 5e-3, "Q8_0": 0.1, "Q4_K": 2.0, "Q4_0": 2.0, "Q5_K": 2.0}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")  # the qlinear kernel, built once for the module


@pytest.fixture(scope="module")
def files(
    tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path
) -> Callable[..., tuple[Path, Path, Path]]:
    made: dict[tuple[str, str], tuple[Path, Path, Path]] = {}

    def make(kind: str, fmt: str, down_fmt: str | None = None, **sizes: int) -> tuple[Path, Path, Path]:
        """(the fp32 HF folder, the GGUF, the HF folder of the file's dequantized weights)."""
        if (kind, fmt) not in made:
            root = tmp_path_factory.mktemp(f"{kind}-{fmt}")
            hf = build(root / "hf", smollm2_dir, kind, **sizes)
            path, weights = write_moe_gguf(hf, root / f"{kind}-{fmt}.gguf", fmt, down_fmt)
            made[kind, fmt] = (hf, path, save_dequantized(hf, root / "dequantized", weights))
        return made[kind, fmt]

    return make


def _serve(path: Path, cache: Path) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(path), cache_dir=cache, max_model_len=256),
            cache=CacheConfig(cache_dtype="float32", block_size=4, num_kv_blocks=128),
            max_num_batched_tokens=8,
        )
    )
    for block in engine.loaded.model.modules():  # quantized experts follow the engine's GEMM dtype
        if isinstance(block, SparseMoeBlock) and isinstance(block.experts, BlockQuantExperts):
            assert block.experts.compute == engine.gemm_dtype
    # against transformers fp32 on bf16 CPUs too: the projections and the experts' batches alike
    apply_gemm_dtype(engine.loaded.model, torch.float32)
    return engine


def _check(engine: LLMEngine, hf: Path, dequantized: Path, fmt: str) -> None:
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:2]]
    params = SamplingParams(max_tokens=NEW, temperature=0.0)
    assert engine.generate(prompts, params) == hf_greedy(dequantized, prompts, NEW)
    ours = engine_prompt_logprobs(engine, prompts[1])
    torch.testing.assert_close(
        ours, hf_prompt_logprobs(dequantized, prompts[1], torch.float32), atol=1e-4, rtol=0
    )
    error = (ours - hf_prompt_logprobs(hf, prompts[1], torch.float32)).abs().max().item()
    assert error <= QUANT_TOL[fmt], error
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def _moe_blocks(engine: LLMEngine) -> list[SparseMoeBlock]:
    return [m for m in engine.loaded.model.modules() if isinstance(m, SparseMoeBlock)]


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_q8_0_experts_kept_quantized(
    files: Callable[..., tuple[Path, Path, Path]], cache: Path, kind: str
) -> None:
    hf, path, dequantized = files(kind, "Q8_0")
    engine = _serve(path, cache)
    assert (
        engine.loaded.arch.architecture
        == {
            "mixtral": "MixtralForCausalLM",
            "qwen2_moe": "Qwen2MoeForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM",
        }[kind]
    )
    assert engine.info.quantization == "gguf-q8_0"
    blocks = _moe_blocks(engine)
    assert len(blocks) == {"mixtral": 4, "qwen2_moe": 3, "qwen3_moe": 2}[kind]
    # 16-row tiles where the tile kernels run, as a dense Q8_0 matrix (experts were kept row-major)
    layout = "q8_0_x16" if super_blocks_enabled(engine.gemm_dtype) else "q8_0"
    for block in blocks:
        assert isinstance(block.experts, BlockQuantExperts) and block.w13 is None
        assert {w.fmt for w in block.experts.w13 + block.experts.w2} == {layout}
        # the quantized experts count in the weight bytes (/info, the start-up log); their packed copies
        # for int8 batches (made at load under bf16 GEMMs) are reported apart, as the dense layers' are
        params = sum(p.numel() * p.element_size() for p in block.parameters())
        stored = sum(
            t.numel() * t.element_size() for w in block.experts.w13 + block.experts.w2 for t in w.tensors()
        )
        assert weight_bytes(block) >= params + stored
        if kind == "qwen2_moe":  # ffn_*_shexp kept in their blocks (they were an fp32 copy, 3.8x the bytes)
            shared = [block.shared_gate_up, block.shared_down]
            assert block.shared_w13 is None and block.shared_w2 is None
            assert all(isinstance(m, BlockQuantLinear) and m.weight_q.fmt == layout for m in shared)
    assert not engine.loaded.gguf_dequantized
    _check(engine, hf, dequantized, "Q8_0")


def test_f16_experts_dequantized(files: Callable[..., tuple[Path, Path, Path]], cache: Path) -> None:
    hf, path, dequantized = files("mixtral", "F16")
    engine = _serve(path, cache)
    assert all(b.experts is None and b.w13 is not None for b in _moe_blocks(engine))
    assert engine.loaded.gguf_dequantized  # listed: F16 held as fp32
    _check(engine, hf, dequantized, "F16")


def test_experts_of_mixed_types_dequantized_and_listed(
    tmp_path: Path, smollm2_dir: Path, cache: Path
) -> None:
    """Gate Q8_0 and up Q4_0 cannot share one w13 in blocks: the layer's three stacks are served fp32 and
    each is listed (gguf_dequantized: the log, /info) with what it costs; they were dequantized silently."""
    hf = build(tmp_path / "hf", smollm2_dir, "mixtral")
    path, weights = write_moe_gguf(hf, tmp_path / "mixed.gguf", "Q8_0", up_fmt="Q4_0")
    engine = _serve(path, cache)
    assert all(b.experts is None and b.w13 is not None for b in _moe_blocks(engine))
    listed = {d.name: d for d in engine.loaded.gguf_dequantized or ()}
    layers = engine.loaded.arch.num_layers
    want = {f"blk.{n}.ffn_{p}_exps.weight" for n in range(layers) for p in ("gate", "up", "down")}
    assert set(listed) == want
    assert {listed[f"blk.0.ffn_{p}_exps.weight"].gguf_type for p in ("gate", "up", "down")} == {
        "Q8_0",
        "Q4_0",
    }
    moe = engine.loaded.arch.moe
    assert moe is not None
    fp32 = moe.num_experts * moe.hidden_size * moe.intermediate_size * 4
    per_32 = {"Q8_0": 34, "Q4_0": 18}  # ggml's block bytes per 32 values: the file's, not the held layout's
    for d in listed.values():
        assert d.resident_bytes == fp32 and d.file_bytes == fp32 // 4 // 32 * per_32[d.gguf_type], d
    _check(engine, hf, save_dequantized(hf, tmp_path / "dequantized", weights), "Q4_0")


def test_k_quant_experts_kept_quantized(files: Callable[..., tuple[Path, Path, Path]], cache: Path) -> None:
    """A Q4_K_M-style file (Q4_K, experts' down projections Q6_K): k-quants need 256-value rows."""
    sizes = {"hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 256, "head_dim": 64}
    hf, path, dequantized = files("qwen3_moe", "Q4_K", "Q6_K", **sizes)
    engine = _serve(path, cache)
    assert engine.info.quantization == "gguf-q4_k+q6_k"
    kernel = try_load_qlinear_kernel(cache)
    q8 = None if kernel is None else active_kernel(kernel)
    # Where the super-block kernel runs AVX512-VNNI: Q4_K and Q6_K experts as 16-row tiles (q4_k_x16 at
    # 4.625 bits, q6_k_x16 at 6.56), no int8 packed copies. Elsewhere, repacked, and under bf16 GEMMs the
    # Q4_K experts packed for the int8 batched path (pack_moe_int8_weights; Q6_K's 16-value groups are not
    # that path's).
    tiles = super_blocks_enabled(engine.gemm_dtype)
    packs = (
        not tiles
        and engine.gemm_dtype == torch.bfloat16
        and q8 is not None
        and q8.isa == "vnni"
        and int8_pack_switch() is not False
    )
    for block in _moe_blocks(engine):
        assert isinstance(block.experts, BlockQuantExperts)
        assert {w.fmt for w in block.experts.w13} == {"q4_k_x16" if tiles else "q4_k"}
        assert {w.fmt for w in block.experts.w2} == {"q6_k_x16" if tiles else "q6_k"}
        assert all(w.super_blocks == tiles for w in block.experts.w13 + block.experts.w2)
        assert all((w.packed is not None) == packs for w in block.experts.w13)
        assert all(w.packed is None for w in block.experts.w2)
    _check(engine, hf, dequantized, "Q4_K")


def test_q5_k_experts_held_as_tiles(files: Callable[..., tuple[Path, Path, Path]], cache: Path) -> None:
    """A Q5_K_M-style file (Q5_K, experts' down projections Q6_K): where the tile kernels run, the Q5_K
    experts are q5_k_x16 tiles (5.625 bits per weight; the repack held 10.0), else repacked exactly;
    greedy and prompt logprobs those of transformers on the file's weights."""
    sizes = {"hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 256, "head_dim": 64}
    hf, path, dequantized = files("qwen3_moe", "Q5_K", "Q6_K", **sizes)
    engine = _serve(path, cache)
    assert engine.info.quantization == "gguf-q5_k+q6_k"
    assert engine.info.gguf_dequantized == ()
    tiles = super_blocks_enabled(engine.gemm_dtype)
    for block in _moe_blocks(engine):
        assert isinstance(block.experts, BlockQuantExperts)
        assert {w.fmt for w in block.experts.w13} == {"q5_k_x16" if tiles else "q5_k"}
        assert all(w.super_blocks == tiles for w in block.experts.w13)
        if tiles:
            assert all(w.nbytes() == w.out_features * w.in_features * 5.625 / 8 for w in block.experts.w13)
    _check(engine, hf, dequantized, "Q5_K")


def test_k_quant_experts_take_int8_activations_without_native_bf16(
    files: Callable[..., tuple[Path, Path, Path]], cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--dtype auto` on a CPU with AVX512-VNNI but no native bf16 (simulated): the experts follow the
    engine's gemm_dtype int8, held as 16-row tiles as on a bf16 CPU, and run the int8 kernels bf16 layers
    run (prompt logprobs bit for bit); against fp32 activations on the same weights, within int8's error."""
    from server.quant.cpu_qk_native import vnni_usable
    from server.quant.gemm_dtype import int8_activations_run

    monkeypatch.setenv("KUBEINFER_CPU_DISABLE", "avx512_bf16,amx_bf16")
    if not int8_activations_run() or not vnni_usable():
        pytest.skip("the int8-activation kernels' AVX512-VNNI path (the tiles') does not run here")
    sizes = {"hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 256, "head_dim": 64}
    _, path, _ = files("qwen3_moe", "Q4_K", "Q6_K", **sizes)
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(path), cache_dir=cache, max_model_len=256),
            cache=CacheConfig(cache_dtype="float32", block_size=4, num_kv_blocks=128),
            max_num_batched_tokens=8,
        )
    )
    assert engine.gemm_dtype == torch.int8
    for block in _moe_blocks(engine):
        assert isinstance(block.experts, BlockQuantExperts) and block.experts.compute == torch.int8
        assert {w.fmt for w in block.experts.w13} == {"q4_k_x16"}
        assert {w.fmt for w in block.experts.w2} == {"q6_k_x16"}
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:2]]
    ours = engine_prompt_logprobs(engine, prompts[1])
    apply_gemm_dtype(engine.loaded.model, torch.bfloat16)
    assert torch.equal(engine_prompt_logprobs(engine, prompts[1]), ours)
    apply_gemm_dtype(engine.loaded.model, torch.float32)
    error = (ours - engine_prompt_logprobs(engine, prompts[1])).abs()
    assert error.max() <= 0.3, error.max()  # measured here (Zen 5, simulated): mean 0.039, max 0.133 nats
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
