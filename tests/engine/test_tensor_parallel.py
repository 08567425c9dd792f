"""Tensor parallelism on gloo (CPU): TP=N greedy output equals TP=1 token for token, a dead worker ends
the engine loop, shapes that cannot split are refused at startup."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from engine_driver import run_staggered

from server.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from server.distributed.driver import TensorParallelError
from server.distributed.sharding import TensorParallelConfigError, shard_spec
from server.engine import LLMEngine
from server.models.arch import ArchConfig
from server.quant.layers import Int8Linear
from server.request import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):",
    "List three colours:",
    "In 1969, the first humans landed on the Moon. The mission was called",
]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


def make_engine(
    folder: Path,
    tp: int,
    cache: CacheConfig,
    timeout_s: float = 60,
    quantize: str | None = None,
    **kw: object,
) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(folder), dtype="float32", quantize=quantize),
            cache=cache,
            device="cpu",  # gloo; a GPU machine with fewer than N devices would be refused
            num_threads=1,  # N ranks share this machine's cores
            parallel=ParallelConfig(tensor_parallel_size=tp, distributed_timeout_s=timeout_s),
            **kw,  # type: ignore[arg-type]
        )
    )


def run_both(folder: Path, tp: int, cache: CacheConfig, **kw: object) -> tuple[list, list, LLMEngine]:
    """TP=1 and TP=tp greedy outputs of PROMPTS (`kw`: make_engine's, e.g. quantize). The TP=1 reference
    loads in the layout a TP rank loads (`rank_loading`: int8 as Int8Linear, not the CPU kernel's
    repacked layout, whose fp32 activations round differently from Int8Linear's bf16 ones)."""
    from server.distributed.sharding import rank_loading

    with rank_loading(tp):
        ref_engine = make_engine(folder, 1, cache, **kw)
    prompts = [ref_engine.tokenizer.encode(p) for p in PROMPTS]
    ref = run_staggered(ref_engine, prompts, GREEDY)
    engine = make_engine(folder, tp, cache, **kw)
    try:
        got = run_staggered(engine, prompts, GREEDY)
        # the same prompts again: the second pass reads its prefixes from the (sharded) prefix cache
        again = run_staggered(engine, prompts, GREEDY)
        assert again == got
    finally:
        engine.close()
    assert engine.tp is not None
    assert [p.exitcode for p in engine.tp.procs] == [0] * (tp - 1)  # stopped by the stop message
    return got, ref, engine


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: q/k norm weights replicated on both ranks
def test_tp2_parity_with_chunked_prefill_and_preemption(tiny_model_factory, arch: str) -> None:  # type: ignore[no-untyped-def]
    folder = tiny_model_factory(arch, tie=False, heads=4, kv_heads=2)
    # 12 blocks of 4 tokens cannot hold 5 sequences of ~22 tokens; an 8-token budget chunks every prompt.
    cache = CacheConfig(block_size=4, num_kv_blocks=12, enable_prefix_caching=True)
    got, ref, engine = run_both(folder, 2, cache, max_num_batched_tokens=8)
    assert got == ref
    assert all(len(t) == GREEDY.max_tokens for t in got)
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    assert stats.num_free_blocks == stats.num_total_blocks
    assert engine.runner.kv_caches[0][0].shape[2] == 1  # 2 KV heads over 2 ranks: one each


@pytest.mark.slow  # three processes on this machine's cores
def test_tp3_qwen2_parity_prefix_caching(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    folder = tiny_model_factory("qwen2", tie=True, hidden=96, heads=6, kv_heads=3)
    cache = CacheConfig(block_size=8, num_kv_blocks=64, enable_prefix_caching=True)
    got, ref, engine = run_both(folder, 3, cache)
    assert got == ref
    assert engine.stats().prefix_cache_hits > 0


def test_tp2_replicates_kv_heads_parity(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    folder = tiny_model_factory("qwen2", tie=False, heads=4, kv_heads=1)
    cache = CacheConfig(block_size=8, num_kv_blocks=64)
    got, ref, engine = run_both(folder, 2, cache)
    assert got == ref
    assert engine.runner.kv_caches[0][0].shape[2] == 1  # the one KV head, replicated on both ranks


def _arch(heads: int, kv: int, inter: int) -> ArchConfig:
    return ArchConfig(
        architecture="LlamaForCausalLM",
        vocab_size=100,
        hidden_size=heads * 8,
        intermediate_size=inter,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
    )


@pytest.mark.parametrize(
    ("heads", "kv", "inter", "n", "message"),
    [
        (6, 3, 96, 4, "attention heads (6)"),
        (6, 3, 96, 2, "KV heads (3)"),
        (4, 2, 90, 4, "intermediate size (90)"),
    ],
)
def test_shapes_that_do_not_split_are_refused(heads: int, kv: int, inter: int, n: int, message: str) -> None:
    with pytest.raises(TensorParallelConfigError, match=re.escape(message)):
        shard_spec(_arch(heads, kv, inter), 0, n)


def test_shard_spec_replicates_and_splits() -> None:
    specs = [shard_spec(_arch(8, 2, 64), r, 4) for r in range(4)]
    assert [s.kv_heads for s in specs] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # query heads 0-3 read KV 0
    assert [s.heads for s in specs] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [s.vocab for s in specs] == [(0, 25), (25, 50), (50, 75), (75, 100)]
    odd = [shard_spec(_arch(6, 3, 96), r, 3).vocab for r in range(3)]
    assert odd == [(0, 34), (34, 68), (68, 100)] and shard_spec(_arch(6, 3, 96), 0, 3).vocab_shard == 34


def test_engine_refuses_tp_that_does_not_divide(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    folder = tiny_model_factory("llama", tie=False, heads=4, kv_heads=2)
    with pytest.raises(TensorParallelConfigError, match="attention heads"):
        make_engine(folder, 3, CacheConfig(block_size=8, num_kv_blocks=16))


def test_killed_worker_makes_the_step_raise(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    folder = tiny_model_factory("llama", tie=False, heads=4, kv_heads=2)
    engine = make_engine(folder, 2, CacheConfig(block_size=8, num_kv_blocks=32))
    try:
        prompt = engine.tokenizer.encode("Hello there")
        engine.add_request("a", prompt, SamplingParams(max_tokens=50, temperature=0.0))
        engine.step()
        pid = engine.tp.procs[0].pid  # type: ignore[union-attr]
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises((TensorParallelError, RuntimeError)):
            for _ in range(100):
                engine.step()
        assert time.monotonic() - t0 < 60
    finally:
        engine.close()


def test_hung_worker_times_out(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    folder = tiny_model_factory("llama", tie=False, heads=4, kv_heads=2)
    engine = make_engine(folder, 2, CacheConfig(block_size=8, num_kv_blocks=32), timeout_s=5)
    pid = engine.tp.procs[0].pid  # type: ignore[union-attr]
    assert pid is not None
    try:
        engine.add_request("a", engine.tokenizer.encode("Hello there"), SamplingParams(max_tokens=50))
        engine.step()
        os.kill(pid, signal.SIGSTOP)  # alive but never answers
        t0 = time.monotonic()
        with pytest.raises((TensorParallelError, RuntimeError)):
            for _ in range(100):
                engine.step()
        assert time.monotonic() - t0 < 30  # the 5 s collective timeout, not a stall
    finally:
        os.kill(pid, signal.SIGKILL)
        engine.close()


def test_other_quantization_is_refused_before_loading(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    folder = tiny_model_factory("llama", tie=False, heads=4, kv_heads=2)
    config = EngineConfig(
        model=ModelConfig(model=str(folder), dtype="float32", quantize="int4"),
        cache=CacheConfig(block_size=8, num_kv_blocks=16),
        device="cpu",
        parallel=ParallelConfig(tensor_parallel_size=2),
    )
    with pytest.raises(TensorParallelConfigError, match=r"dense and int8 .* --quantize int4"):
        LLMEngine(config)


def test_tp2_int8_parity_shards_along_the_packed_layout(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    """--quantize int8 (per-output-channel scales): column-parallel shards keep their rows' int8 values
    and scales, row-parallel shards their columns with every row's full scale; TP=2 equals TP=1 int8."""
    folder = tiny_model_factory("llama", tie=False, heads=4, kv_heads=2)
    cache = CacheConfig(block_size=8, num_kv_blocks=64, enable_prefix_caching=True)
    got, ref, engine = run_both(folder, 2, cache, quantize="int8")
    assert got == ref
    assert engine.loaded.quantization == "int8"
    attn = engine.loaded.model.decoder_layers()[0].self_attn
    assert isinstance(attn.o_proj.linear, Int8Linear)  # type: ignore[union-attr]
    assert attn.o_proj.linear.qweight.shape[1] == attn.o_proj.linear.in_features  # type: ignore[union-attr]


def _checkpoint_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


@pytest.mark.parametrize(
    ("quantize", "bound"), [(None, 0.55), pytest.param("int8", 0.8, marks=pytest.mark.slow)]
)
def test_rank_reads_only_its_slices(
    tiny_model_factory, monkeypatch, quantize: str | None, bound: float
) -> None:  # type: ignore[no-untyped-def]
    """Rank 0 of 2 materializes only its slices of the checkpoint (safetensors get_slice): about half
    of it dense; with on-the-fly int8 the row-parallel weights are read whole (their scales span the row)."""
    from server.models import loader

    folder = tiny_model_factory("llama", tie=False, heads=4, kv_heads=2)
    read: list[int] = []
    real = loader.load_state_dict

    def counting(folder: Path, slicer=None):  # type: ignore[no-untyped-def]
        state = real(folder, slicer)
        read.append(sum(t.numel() * t.element_size() for t in state.values()))
        return state

    monkeypatch.setattr(loader, "load_state_dict", counting)
    engine = make_engine(folder, 2, CacheConfig(block_size=8, num_kv_blocks=16), quantize=quantize)
    engine.close()
    total = _checkpoint_bytes(folder)
    assert len(read) == 1 and 0.45 * total < read[0] < bound * total, (read, total)


def test_checkpoint_slicer_cuts_each_tensor_like_shard_model(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file

    from server.distributed.sharding import rank_loading_slicer
    from server.models.loader import load_state_dict

    folder = tiny_model_factory("qwen2", tie=False, heads=4, kv_heads=2)
    full: dict = {}
    for f in folder.glob("*.safetensors"):
        full.update(load_file(str(f)))
    for rank in range(2):
        part = load_state_dict(folder, rank_loading_slicer(folder, None, rank, 2))
        assert part.keys() == full.keys()
        q = "model.layers.0.self_attn.q_proj"
        d = full[f"{q}.weight"].shape[0] // 2
        assert torch.equal(part[f"{q}.weight"], full[f"{q}.weight"][rank * d : (rank + 1) * d])
        assert torch.equal(
            part[f"{q}.bias"], full[f"{q}.bias"][rank * d : (rank + 1) * d]
        )  # Qwen2's qkv bias
        down = "model.layers.0.mlp.down_proj.weight"
        i = full[down].shape[1] // 2
        assert torch.equal(part[down], full[down][:, rank * i : (rank + 1) * i])
        norm = "model.layers.0.input_layernorm.weight"
        assert torch.equal(part[norm], full[norm])


@pytest.mark.slow  # waits out a heartbeat period and the collective timeout
def test_idle_heartbeat_notices_a_hung_worker(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    """No traffic: the idle loop's heartbeat (an all-reduce every HEARTBEAT_S) raises within the timeout."""
    folder = tiny_model_factory("llama", tie=False, heads=4, kv_heads=2)
    engine = make_engine(folder, 2, CacheConfig(block_size=8, num_kv_blocks=32), timeout_s=3)
    pid = engine.tp.procs[0].pid  # type: ignore[union-attr]
    assert pid is not None
    try:
        engine.check_health()  # healthy: nothing raised
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match="heartbeat failed"):
            while time.monotonic() - t0 < 60:
                engine.check_health()
                time.sleep(0.5)
        assert time.monotonic() - t0 < 30  # HEARTBEAT_S + the 3 s timeout, not a stall
    finally:
        os.kill(pid, signal.SIGKILL)
        engine.close(graceful=False)


def test_tp2_windowed_layers_keep_their_own_kv_group(tmp_path: Path, smollm2_dir: Path) -> None:
    """A Qwen2 whose layers 1-2 are windowed beside the global layer 0 keeps the windowed layers' own
    group under tensor parallelism, as on one device (server/core/kv_groups.py): rank 0 and rank 1 plan
    the same layout (a rank that differs fails the start-up), blocks behind the window go back to the
    windowed pool, and greedy tokens equal transformers' through chunked prefill and prefix hits past
    the window edge."""
    from transformers import AutoModelForCausalLM
    from window_models import WINDOW, build_window_model

    folder = build_window_model(tmp_path / "swa-qwen2", smollm2_dir, "qwen2")
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 49152, (4 * WINDOW,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 49152, (n,), generator=g).tolist() for n in (3, 11, 19)]
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager")
    with torch.inference_mode():
        ref = [
            hf.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    cache = CacheConfig(block_size=8, num_kv_blocks=128, enable_prefix_caching=True)
    engine = make_engine(
        folder, 2, cache, max_num_batched_tokens=16, long_prefill_token_threshold=16, max_num_seqs=2
    )
    try:
        windows = [layer.self_attn.sliding_window for layer in engine.loaded.model.decoder_layers()]
        assert windows == [None, WINDOW, WINDOW]
        # two seats' windows and a 16-token step in the windowed group (2 x 4 + 2 blocks), the rest of the
        # 128 blocks of 3 layers to the global layer: what one device plans
        assert [k.shape[0] for k, _ in engine.runner.kv_caches] == [128 * 3 - 2 * 10, 10, 10]
        got = [engine.generate([p], GREEDY)[0] for p in prompts]
        assert engine.stats().prefix_cache_hits >= 2 * 4 * WINDOW
        assert engine.stats().num_free_blocks == engine.stats().num_total_blocks
    finally:
        engine.close()
    assert got == ref
    assert engine.tp is not None
    assert [p.exitcode for p in engine.tp.procs] == [0]


def test_a_rank_with_another_kv_layout_is_refused() -> None:
    """The start-up status carries each KV group's block count: what a rank publishes decodes to what
    rank 0 compares, and a status that is not [string, [integer, ...]] is refused."""
    import json

    from server.core.kv_groups import KVGroupSpec, KVLayout
    from server.distributed.parallel_state import _decode_status
    from server.distributed.worker import ready_status

    layout = KVLayout((KVGroupSpec(364), KVGroupSpec(10, 16)), (0, 1, 1))
    mine = ready_status(layout)
    assert _decode_status(1, json.dumps(mine).encode()) == mine
    other = ready_status(KVLayout((KVGroupSpec(128),), (0, 0, 0)))
    assert _decode_status(1, json.dumps(other).encode()) != mine
    for bad in (["ready", 128], ["ready", [1, True]], ["ready", ["1"]], ["ready"]):
        with pytest.raises(TensorParallelError, match="malformed"):
            _decode_status(1, json.dumps(bad).encode())
