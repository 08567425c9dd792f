"""GGUF models served as they are (quantized tensors kept, server/quant/gguf_checkpoint.py): the tensors
equal transformers' reading of the same file, and greedy decoding matches transformers token for token."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_driver import run_staggered
from gguf_models import hf_reference_greedy, write_tiny_gguf

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.quant.block_linear import BlockQuantEmbedding, BlockQuantLinear
from server.quant.cpu_qlinear import BlockQuantWeight, dequantize_reference
from server.quant.gemm_dtype import apply_gemm_dtype
from server.quant.gguf_checkpoint import read_gguf_checkpoint
from server.request import SamplingParams

GGUF_FORMATS = ["Q4_0", "Q4_1", "Q8_0"]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colours:", "Water boils at"]
NEW_TOKENS = 16

FP32_KV = CacheConfig(cache_dtype="float32")  # the parity tests compare against transformers fp32


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # One cache folder for the module's engines: each C++ kernel is compiled once, not once per test.
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    hf = tiny_model_factory("llama", tie=True)
    out = tmp_path_factory.mktemp("gguf")
    return {fmt: write_tiny_gguf(hf, out / f"tiny-{fmt}.gguf", fmt) for fmt in GGUF_FORMATS}


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
def test_tensors_equal_transformers_reading_of_the_file(tiny_gguf: dict[str, Path], fmt: str) -> None:
    """Names, the q/k rotary permutation and the dequantized values, bit for bit."""
    from transformers import AutoModelForCausalLM

    path = tiny_gguf[fmt]
    ours = read_gguf_checkpoint(path, torch.bfloat16)
    assert ours.formats == {fmt: 15, "F32": 5}  # 2 layers x 7 projections + embedding; 5 norms
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ref_state = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    assert set(ours.tensors) == set(ref_state)
    for name, value in ours.tensors.items():
        dense = dequantize_reference(value) if isinstance(value, BlockQuantWeight) else value
        assert torch.equal(dense, ref_state[name]), name


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
def test_greedy_parity_on_tiny_gguf_models(tiny_gguf: dict[str, Path], fmt: str, cache: Path) -> None:
    path = tiny_gguf[fmt]
    # against transformers fp32: an fp32 KV cache and fp32 GEMMs on bf16 CPUs too
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(path), cache_dir=cache), cache=FP32_KV))
    model = engine.loaded.model
    apply_gemm_dtype(model, torch.float32)
    assert engine.info.quantization == f"gguf-{fmt.lower()}"
    assert isinstance(model.model.embed_tokens, BlockQuantEmbedding)
    assert isinstance(model.lm_head, BlockQuantLinear)  # tied: the embedding's tensors
    assert model.lm_head.q is model.model.embed_tokens.q
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, BlockQuantLinear)  # fused, still quantized
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    ours = run_staggered(
        engine, prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    )
    assert ours == hf_reference_greedy(path, prompts, NEW_TOKENS)
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_k_quant_gguf_kept_quantized_with_greedy_parity(
    tiny_model_factory,  # type: ignore[no-untyped-def]
    tmp_path: Path,
    cache: Path,
) -> None:
    """A llama.cpp Q4_K_M-style file (projections Q4_K, token embedding and tied LM head Q6_K; hidden 256:
    k-quants need whole 256-value super-blocks): every tensor equals transformers' reading of the file,
    both formats are served quantized, and greedy decoding matches transformers token for token."""
    from transformers import AutoModelForCausalLM

    hf_folder = tiny_model_factory("llama", tie=True, hidden=256)
    path = write_tiny_gguf(hf_folder, tmp_path / "tiny-k.gguf", "Q4_K", embedding_fmt="Q6_K")
    ours = read_gguf_checkpoint(path, torch.bfloat16)
    assert ours.formats == {"Q4_K": 14, "Q6_K": 1, "F32": 5}
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ref_state = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    for name, value in ours.tensors.items():
        assert isinstance(value, BlockQuantWeight) or value.dim() == 1, name
        dense = dequantize_reference(value) if isinstance(value, BlockQuantWeight) else value
        assert torch.equal(dense, ref_state[name]), name
    del ref
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(path), cache_dir=cache), cache=FP32_KV))
    apply_gemm_dtype(engine.loaded.model, torch.float32)  # against transformers fp32
    assert engine.info.quantization == "gguf-q4_k+q6_k"
    model = engine.loaded.model
    assert isinstance(model.lm_head, BlockQuantLinear) and model.lm_head.method == "q6_k"
    assert isinstance(model.model.layers[0].mlp.down_proj, BlockQuantLinear)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:2]]  # two prompts: a 49k x 256 vocabulary is slow
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert run_staggered(engine, prompts, params) == hf_reference_greedy(path, prompts, NEW_TOKENS)
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_an_explicit_dtype_dequantizes_as_before(tiny_gguf: dict[str, Path], cache: Path) -> None:
    engine = LLMEngine(
        EngineConfig(model=ModelConfig(model=str(tiny_gguf["Q8_0"]), dtype="float32", cache_dir=cache))
    )
    assert engine.info.quantization is None
    assert isinstance(engine.loaded.model.model.embed_tokens, torch.nn.Embedding)


@pytest.mark.slow
def test_embedded_model_served_quantized_keeps_greedy_parity(smollm2_dir: Path) -> None:
    """The default (`make serve`): the embedded Q4_1 GGUF as it is, against transformers on its fp32
    dequantization, over the parity prompts of tests/engine/test_engine_parity.py."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "engine_parity", Path(__file__).parents[1] / "engine" / "test_engine_parity.py"
    )
    assert spec is not None and spec.loader is not None
    parity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parity)
    N, PARITY_PROMPTS, hf_greedy = parity.NEW_TOKENS, parity.PROMPTS, parity.hf_greedy

    # exact against transformers fp32: an fp32 KV cache and fp32 GEMMs (auto is bf16 for both on CPUs with
    # native bf16, from 4 rows for the GEMMs: tests/engine/test_kv_cache_dtype_parity.py and
    # tests/quant/test_bf16_gemm.py bound those against this same reference)
    engine = LLMEngine(EngineConfig(model=ModelConfig(), cache=FP32_KV))
    apply_gemm_dtype(engine.loaded.model, torch.float32)
    assert engine.info.quantization == "gguf-q4_1+q8_0"
    assert engine.info.weight_bytes < 100 * 2**20  # 92 MiB: the file's tensors, not 513 MiB of fp32
    prompts = [engine.tokenizer.encode(p) for p in PARITY_PROMPTS]
    assert run_staggered(engine, prompts, SamplingParams(max_tokens=N, temperature=0.0)) == hf_greedy(
        smollm2_dir, prompts, N
    )


RSS_SCRIPT = """
import json, resource, sys
import torch
from server.config import CacheConfig, EngineConfig, ModelConfig
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
from server.engine import LLMEngine
from server.models.arch import ArchConfig
from server.models.llama import LlamaForCausalLM
from server.models.loader import read_hf_config, resolve_model
from server.models.registry import arch_from_hf
from server.tokenizer import Tokenizer
# The baseline holds the code, not the model: the modules that building a model and a tokenizer load
# lazily (torch's meta-device registrations, transformers, tokenizers) are loaded first.
folder = resolve_model(None, keep_gguf=True).folder
with torch.device("meta"):
    LlamaForCausalLM(arch_from_hf(read_hf_config(folder)), max_positions=1)
Tokenizer(folder)
before = rss()
engine = LLMEngine(EngineConfig(model=ModelConfig(), cache=CacheConfig(kv_cache_memory_bytes=int(sys.argv[1]))))
from server.quant.block_linear import BlockQuantLinear
packed = sum(m.weight_q.packed.numel() for m in engine.loaded.model.modules()
             if isinstance(m, BlockQuantLinear) and m.weight_q.packed is not None)
print(json.dumps({"before": before, "after": rss(), "gguf": engine.source.gguf.stat().st_size,
                  "weight_bytes": engine.info.weight_bytes, "packed": packed}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_resident_memory_of_the_embedded_model(tmp_path: Path) -> None:
    """Loading the embedded model adds at most 1.5x the GGUF file plus the KV cache budget to the RSS,
    plus the int8 batches' packed weight copies where the engine made them (AVX512-VNNI with bf16 GEMMs:
    a chosen trade, logged at start, each copy at most 1.25x its weight's bytes: the same bytes of W, scales
    and offsets in fp32). Asserted loosely; benchmarks/cpu_qlinear.py prints the figure. fp32 weights alone
    were 513 MiB."""
    kv_budget = 64 << 20
    done = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, str(kv_budget)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    r = json.loads(done.stdout.strip().splitlines()[-1])
    added = r["after"] - r["before"]
    assert r["packed"] <= 1.25 * r["weight_bytes"], r
    assert added <= 1.5 * r["gguf"] + r["packed"] + kv_budget, r


@pytest.mark.parametrize("method", ["q8_0", "q4_1"])
def test_quantize_flag_chooses_block_formats_for_a_float_checkpoint(
    tiny_model_factory,  # type: ignore[no-untyped-def]
    method: str,
    cache: Path,
) -> None:
    """--quantize q8_0/q4_0/q4_1 on a float checkpoint: projections quantized like ggml's reference
    quantizer; greedy output equals transformers running the same dequantized projections."""
    from transformers import AutoModelForCausalLM

    from server.quant.cpu_qlinear import quantize_block

    folder = tiny_model_factory("llama", tie=True)
    engine = LLMEngine(
        EngineConfig(model=ModelConfig(model=str(folder), dtype="float32", quantize=method, cache_dir=cache))
    )
    assert engine.info.quantization == method
    assert isinstance(engine.loaded.model.model.layers[0].mlp.down_proj, BlockQuantLinear)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        for name, module in hf.named_modules():
            if name.endswith(("_proj",)) and isinstance(module, torch.nn.Linear):
                module.weight.copy_(dequantize_reference(quantize_block(module.weight, method)))
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    ours = run_staggered(
        engine, prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    )
    ref = []
    with torch.inference_mode():
        for p in prompts:
            ids = hf.generate(
                torch.tensor([p]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                min_new_tokens=NEW_TOKENS,
                eos_token_id=None,
            )
            ref.append(ids[0, len(p) :].tolist())
    assert ours == ref
