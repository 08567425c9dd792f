"""Sliding-window models through the paged engine against transformers (eager attention, which applies the
window mask), with prompts several windows long: a tiny random Mistral (every layer windowed), a Qwen2
with `use_sliding_window` (layers from `max_window_layers` on windowed, the first global) and a Gemma 3
(two windowed layers, then a global one): the interleaved cases, in their own KV layer groups. Greedy tokens equal, prompt logprobs within 1e-4, through chunked prefill, a prefix-cache hit past the
window edge and preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_driver import run_staggered
from prompt_logprobs import engine_prompt_logprobs
from window_models import WINDOW, build_window_model

from server.config import CacheConfig, EngineConfig, ModelConfig
from server.engine import LLMEngine
from server.request import SamplingParams

NEW_TOKENS = 12


@pytest.fixture(scope="module", params=["mistral", "qwen2", "gemma3"])
def model_dir(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path
) -> Path:
    return build_window_model(tmp_path_factory.mktemp(f"swa-{request.param}"), smollm2_dir, request.param)


def _hf(folder: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager")
    hf.generation_config.eos_token_id = None  # run every prompt the full NEW_TOKENS
    return hf


def _hf_greedy(hf, prompts: list[list[int]], n: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    with torch.inference_mode():
        return [
            hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # 3 to 5 windows long, different lengths (so the window edge falls at every block offset)
    return [torch.randint(3, 49152, (3 * WINDOW + 7 * i,), generator=g).tolist() for i in range(n)]


def _engine(folder: Path, backend: str, **kw: object) -> LLMEngine:
    cache = kw.pop("cache", CacheConfig(block_size=8, num_kv_blocks=128))
    cfg = EngineConfig(
        model=ModelConfig(model=str(folder), dtype="float32"),
        cache=cache,  # type: ignore[arg-type]
        attention_backend=backend,
        **kw,  # type: ignore[arg-type]
    )
    return LLMEngine(cfg)


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def test_the_config_window_reaches_every_layer(model_dir: Path) -> None:
    engine = _engine(model_dir, "torch")
    windows = [layer.self_attn.sliding_window for layer in engine.loaded.model.decoder_layers()]
    expect = {
        "MistralForCausalLM": [WINDOW] * 3,
        "Qwen2ForCausalLM": [None, WINDOW, WINDOW],
        "Gemma3ForCausalLM": [WINDOW, WINDOW, None],
    }
    assert windows == expect[engine.loaded.arch.architecture]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_parity_staggered_and_chunked(model_dir: Path, backend: str) -> None:
    hf = _hf(model_dir)
    prompts = _prompts(5, seed=1)
    ref = _hf_greedy(hf, prompts, NEW_TOKENS)
    # staggered arrivals: prefills beside decodes in one step
    engine = _engine(model_dir, backend)
    assert run_staggered(engine, prompts, GREEDY) == ref
    # an 11-token budget: every prompt chunked, chunk boundaries at every offset against the window edge
    engine = _engine(model_dir, backend, max_num_batched_tokens=11, long_prefill_token_threshold=11)
    assert run_staggered(engine, prompts, GREEDY) == ref
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_parity_under_preemption(model_dir: Path) -> None:
    hf = _hf(model_dir)
    prompts = _prompts(4, seed=2)
    ref = _hf_greedy(hf, prompts, NEW_TOKENS)
    # 12 blocks of 8 tokens cannot hold 4 sequences of 60-80 tokens at once, even with Mistral's blocks
    # out of the window freed (each still needs its window's and its chunk's blocks)
    engine = _engine(
        model_dir, "cpu", cache=CacheConfig(block_size=8, num_kv_blocks=12), max_num_batched_tokens=32
    )
    assert run_staggered(engine, prompts, GREEDY) == ref
    assert engine.stats().num_preemptions > 0
    assert _held_per_layer(engine) == [0] * len(windows_of(engine))


def test_prefix_cache_hit_past_the_window_edge(model_dir: Path) -> None:
    """A shared 5-window prefix, then different tails: the later prompts reuse the first one's blocks, all
    of the prefix past the window for their last tokens, and still equal transformers."""
    hf = _hf(model_dir)
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(3, 49152, (5 * WINDOW,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 49152, (n,), generator=g).tolist() for n in (3, 9, 21)]
    ref = _hf_greedy(hf, prompts, NEW_TOKENS)
    engine = _engine(
        model_dir, "cpu", cache=CacheConfig(block_size=8, num_kv_blocks=128, enable_prefix_caching=True)
    )
    assert [engine.generate([p], GREEDY)[0] for p in prompts] == ref
    stats = engine.stats()
    assert stats.prefix_cache_hits >= 2 * 5 * WINDOW
    assert stats.num_free_blocks == stats.num_total_blocks


def test_prompt_logprobs_match(model_dir: Path) -> None:
    hf = _hf(model_dir)
    prompt = _prompts(1, seed=5)[0] + _prompts(1, seed=6)[0]  # 6 windows
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1].double()
    ref = logits.log_softmax(-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    engine = _engine(model_dir, "cpu", max_num_batched_tokens=40, long_prefill_token_threshold=40)
    got = engine_prompt_logprobs(engine, prompt)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def _held_per_layer(engine: LLMEngine) -> list[int]:
    """Blocks each layer's KV cache holds now: its group's pool (one pool for all before KV groups)."""
    groups = getattr(engine.kv, "groups", None)
    out = []
    for layer in engine.loaded.model.decoder_layers():
        pool = groups[layer.self_attn.kv_group].pool if groups else engine.kv.pool
        out.append(pool.num_blocks - pool.num_free_blocks)
    return out


def test_a_windowed_model_holds_its_window_only(model_dir: Path) -> None:
    """Every windowed layer holds about W / block_size + 1 blocks of 8 however long the request grows,
    blocks out of the window going back to the pool: Mistral's one group, and Qwen2's and Gemma 3's windowed
    layers in their own group beside the global layer, which keeps all 11 (kv_groups.py). An abort mid-decode
    leaves every group's pool whole."""
    engine = _engine(
        model_dir, "cpu", max_num_batched_tokens=16, long_prefill_token_threshold=16, max_num_seqs=2
    )
    windows = [layer.self_attn.sliding_window for layer in engine.loaded.model.decoder_layers()]
    prompt = _prompts(1, seed=9)[0]  # 48 tokens
    engine.add_request("r", prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    most = [0] * len(windows)
    while engine.has_unfinished():
        engine.step()
        most = [max(m, h) for m, h in zip(most, _held_per_layer(engine), strict=True)]
    # a window's 16 tokens span at most 3 blocks of 8, plus the blocks of a 16-token chunk; a global
    # layer the whole 48 + 40 tokens
    assert most == [-(-(48 + 40) // 8) if w is None else most[i] for i, w in enumerate(windows)]
    assert all(m <= 3 + 2 for m, w in zip(most, windows, strict=True) if w is not None)
    if None in windows:  # Qwen2, Gemma 3: 1 global layer x 11 blocks + 2 windowed x 5 at most, not 3 x 11
        assert sum(most) <= 11 + 2 * 5
        # the windowed group's tensors are sized for 2 sequences' windows and a 16-token step (2 x 4 + 2
        # blocks: kv_groups.plan_kv_layout), the rest of the bytes (128 blocks of 3 layers) went to the
        # global layer
        sizes = [k.shape[0] for k, _ in engine.runner.kv_caches]
        assert sizes == [128 * 3 - 2 * 10 if w is None else 10 for w in windows]
    engine.add_request("a", prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for _ in range(6):
        engine.step()
    assert max(_held_per_layer(engine)) > 0
    engine.abort_request("a")
    engine.step()
    assert _held_per_layer(engine) == [0] * len(windows)


def test_parity_with_a_windowed_group_of_ten_blocks(model_dir: Path) -> None:
    """Two seats and 16-token steps: Qwen2's and Gemma 3's windowed group gets 10 blocks (kv_groups.py), reused over and
    over by chunked prefills; then prefix hits past the window edge, served by the windowed group's last
    window and the global layer's whole prefix. Transformers' tokens still, nothing leaked."""
    hf = _hf(model_dir)
    prompts = _prompts(4, seed=3)
    g = torch.Generator().manual_seed(8)
    shared = torch.randint(3, 49152, (5 * WINDOW,), generator=g).tolist()
    tails = [shared + torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 13)]
    ref = _hf_greedy(hf, prompts + tails, NEW_TOKENS)
    engine = _engine(
        model_dir,
        "cpu",
        cache=CacheConfig(block_size=8, num_kv_blocks=128, enable_prefix_caching=True),
        max_num_batched_tokens=16,
        long_prefill_token_threshold=16,
        max_num_seqs=2,
    )
    if None in windows_of(engine):
        sizes = [k.shape[0] for k, _ in engine.runner.kv_caches]
        assert sizes == [128 * 3 - 2 * 10 if w is None else 10 for w in windows_of(engine)]
    assert run_staggered(engine, prompts, GREEDY) == ref[:4]
    assert [engine.generate([p], GREEDY)[0] for p in tails] == ref[4:]
    assert engine.stats().prefix_cache_hits >= 4 * WINDOW
    assert _held_per_layer(engine) == [0] * len(windows_of(engine))


def windows_of(engine: LLMEngine) -> list[int | None]:
    return [layer.self_attn.sliding_window for layer in engine.loaded.model.decoder_layers()]


def test_ngram_speculation_parity(model_dir: Path) -> None:
    """Drafts accepted and rejected over a windowed model (rejected drafts' blocks given back with blocks
    already out of the window in the table): transformers' tokens still."""
    from server.spec_decode.config import SpeculativeConfig

    hf = _hf(model_dir)
    g = torch.Generator().manual_seed(12)
    # repeated phrases: the n-gram proposer finds drafts; the random model mostly rejects them
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() * 5 for n in (9, 13)]
    ref = _hf_greedy(hf, prompts, 24)
    spec = SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=3)
    engine = _engine(model_dir, "cpu", cache=CacheConfig(block_size=4, num_kv_blocks=128), speculative=spec)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert run_staggered(engine, prompts, params) == ref
    stats = engine.stats()
    assert stats.spec_num_draft_tokens > 0
    assert stats.num_free_blocks == stats.num_total_blocks


def test_info_shows_the_kv_groups(model_dir: Path) -> None:
    """/info names each KV layer group (kv_groups.py) with its layers, blocks of one layer and window,
    over real HTTP: one group for Mistral's every-layer window, the global layer's group and the windowed
    layers' smaller one for Qwen2 and Gemma 3, as the runner sized their caches; the engine's stats count
    the blocks of every group."""
    import httpx
    from serving import free_port, serve_in_thread

    from server.api.app import create_app
    from server.api.state import ServerState
    from server.config import ServerConfig

    engine_cfg = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32"),
        cache=CacheConfig(block_size=8, num_kv_blocks=128),
        max_num_seqs=2,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=16,
        num_threads=1,
    )
    llm = LLMEngine(engine_cfg)
    windows = windows_of(llm)
    sizes = [k.shape[0] for k, _ in llm.runner.kv_caches]
    port = free_port()
    state = ServerState(
        ServerConfig(engine=engine_cfg, host="127.0.0.1", port=port), engine_factory=lambda: llm
    )
    running = serve_in_thread(create_app(state), port)
    try:
        groups = httpx.get(f"{running.url}/info", timeout=60).json()["kv_groups"]
    finally:
        running.stop()
    if None in windows:
        assert groups == [
            {
                "layers": [i for i, w in enumerate(windows) if w is None],
                "blocks": 128 * 3 - 2 * 10,
                "sliding_window": None,
            },
            {
                "layers": [i for i, w in enumerate(windows) if w is not None],
                "blocks": 10,
                "sliding_window": WINDOW,
            },
        ]
    else:
        assert groups == [{"layers": [0, 1, 2], "blocks": 128, "sliding_window": WINDOW}]
    assert [groups[0 if w is None else len(groups) - 1]["blocks"] for w in windows] == sizes
    # the engine's block counts cover every group, so free == total means no group holds a block
    stats = llm.stats()
    assert stats.num_total_blocks == stats.num_free_blocks == sum(g["blocks"] for g in groups)
