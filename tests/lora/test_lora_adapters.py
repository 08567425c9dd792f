"""Adapter validation (clear errors for adapters we cannot serve), the registry's LRU and run-time
load / unload in the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lora_adapters import make_adapter, peft_greedy

from server.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig
from server.engine import LLMEngine
from server.lora.adapter import LoRAAdapterError, load_adapter
from server.lora.registry import LoRAConflictError, LoRANotFoundError, LoRARegistry
from server.models.loader import read_hf_config
from server.models.registry import arch_from_hf
from server.request import SamplingParams


@pytest.fixture(scope="module")
def base(tiny_model_factory) -> Path:  # type: ignore[no-untyped-def]
    return tiny_model_factory("llama", tie=True)


@pytest.fixture(scope="module")
def adapters(base: Path, tiny_model_factory, tmp_path_factory) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("lora-validation")
    other = tiny_model_factory("llama", tie=True, hidden=32, heads=2, kv_heads=1)
    return {
        "ok": make_adapter(base, root / "ok", 4, ("q_proj", "down_proj"), seed=1, std=0.2),
        "ok2": make_adapter(base, root / "ok2", 8, ("v_proj", "up_proj"), seed=2, std=0.2),
        "big": make_adapter(base, root / "big", 32, ("q_proj",), seed=3),
        "other": make_adapter(other, root / "other", 4, ("q_proj",), seed=4),
    }


def registry(base: Path, **kw: int) -> LoRARegistry:
    cfg = LoRAConfig(enable_lora=True, max_lora_rank=16, **kw)  # type: ignore[arg-type]
    return LoRARegistry(cfg, arch_from_hf(read_hf_config(base)), torch.float32)


def test_loaded_weights_fold_scaling(base: Path, adapters: dict[str, Path]) -> None:
    from safetensors.torch import load_file

    arch = arch_from_hf(read_hf_config(base))
    ad = load_adapter("ok", adapters["ok"], arch, 16, torch.float32)
    assert ad.rank == 4 and ad.target_modules == ("down_proj", "q_proj")
    assert set(ad.weights) == {(i, m) for i in range(arch.num_layers) for m in ("q_proj", "down_proj")}
    raw = load_file(str(adapters["ok"] / "adapter_model.safetensors"))
    b = raw["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    torch.testing.assert_close(ad.weights[(1, "q_proj")].b, b * (16.0 / 4))  # lora_alpha / r


@pytest.mark.parametrize(
    ("which", "message"),
    [
        ("other", "an adapter for another model"),
        ("big", "LoRA rank 32 is greater than max_lora_rank 16"),
        ("missing", "No adapter found"),
    ],
)
def test_refused_adapters(
    base: Path, adapters: dict[str, Path], tmp_path: Path, which: str, message: str
) -> None:
    reg = registry(base)
    path = adapters.get(which, tmp_path / "nowhere")
    with pytest.raises(LoRAAdapterError, match=message):
        reg.add(which, str(path))
    assert reg.get(which) is None


def test_corrupt_and_unsupported_files(base: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    reg = registry(base)
    bad = tmp_path / "corrupt"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((adapters["ok"] / "adapter_config.json").read_text())
    (bad / "adapter_model.safetensors").write_bytes(b"\x00\x01garbage")
    with pytest.raises(LoRAAdapterError, match=r"cannot read adapter_model\.safetensors"):
        reg.add("corrupt", str(bad))
    dora = tmp_path / "dora"
    dora.mkdir()
    cfg = json.loads((adapters["ok"] / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    (dora / "adapter_model.safetensors").write_bytes(
        (adapters["ok"] / "adapter_model.safetensors").read_bytes()
    )
    with pytest.raises(LoRAAdapterError, match="DoRA"):
        reg.add("dora", str(dora))
    with pytest.raises(LoRAAdapterError, match=r"invalid adapter_config\.json"):
        (dora / "adapter_config.json").write_text("{not json")
        reg.add("dora", str(dora))


def test_registry_names_and_lru(base: Path, adapters: dict[str, Path]) -> None:
    reg = registry(base, max_loras=1, max_cpu_loras=1)
    a = reg.add("a", str(adapters["ok"]))
    with pytest.raises(LoRAConflictError, match="has already been loaded"):
        reg.add("a", str(adapters["ok2"]))
    b = reg.add("b", str(adapters["ok2"]))
    assert a.lora_int_id != b.lora_int_id and reg.num_cached == 1  # a's weights were evicted
    assert reg.weights(a).rank == 4 and reg.num_cached == 1  # read again from its folder
    reg.remove("a")
    with pytest.raises(LoRANotFoundError, match="cannot be found"):
        reg.remove("a")
    again = reg.add("a", str(adapters["ok"]))
    assert again.lora_int_id not in (a.lora_int_id, b.lora_int_id)  # a new identity: no stale cache


def test_runtime_load_serve_unload(base: Path, adapters: dict[str, Path]) -> None:
    """Load while serving, run under two adapters and the base, unload one while its request is in
    flight: every request finishes with the reference output and no block is leaked."""
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(base), dtype="float32"),
            cache=CacheConfig(block_size=4, num_kv_blocks=64),
            lora=LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2),
        )
    )
    assert engine.lora is not None
    prompt = engine.tokenizer.encode("Once upon a time, in a small village")
    params = SamplingParams(max_tokens=10, temperature=0.0)
    ref_ok = peft_greedy(base, adapters["ok"], [prompt], 10)[0]
    ref_ok2 = peft_greedy(base, adapters["ok2"], [prompt], 10)[0]
    ref_base = peft_greedy(base, None, [prompt], 10)[0]
    assert engine.generate([prompt], params) == [ref_base]
    got: dict[str, list[int]] = {"x": [], "y": [], "z": []}

    def step() -> None:
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
            assert out.error is None

    ok = engine.lora.add("ok", str(adapters["ok"]))
    engine.add_request("x", prompt, params, ok)
    step()
    ok2 = engine.lora.add("ok2", str(adapters["ok2"]))
    engine.add_request("y", prompt, params, ok2)
    engine.add_request("z", prompt, params, None)
    step()
    engine.lora.remove("ok")  # in flight: x keeps its slot until it finishes
    while engine.has_unfinished():
        step()
    assert got == {"x": ref_ok, "y": ref_ok2, "z": ref_base}
    assert engine.lora.get("ok") is None
    assert engine.generate([prompt], params, [ok2]) == [ref_ok2]
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_lora_request_refused_when_disabled(base: Path) -> None:
    from server.request import LoRARequest

    engine = LLMEngine(
        EngineConfig(model=ModelConfig(model=str(base), dtype="float32"), cache=CacheConfig(num_kv_blocks=16))
    )
    with pytest.raises(ValueError, match="--enable-lora"):
        engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2), LoRARequest("x", 1, "/x"))
    with pytest.raises(ValueError, match="need --enable-lora"):
        LoRAConfig(lora_modules=(), allow_runtime_updating=True)


def test_adapter_broken_after_eviction_fails_only_its_requests(
    base: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """An adapter evicted from memory whose file was corrupted since: its requests end with an error,
    the others are served, no block leaks."""
    import shutil

    copy = tmp_path / "fragile"
    shutil.copytree(adapters["ok"], copy)
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(base), dtype="float32"),
            cache=CacheConfig(block_size=4, num_kv_blocks=64),
            lora=LoRAConfig(enable_lora=True, max_loras=1, max_lora_rank=16, max_cpu_loras=1),
        )
    )
    assert engine.lora is not None
    fragile = engine.lora.add("fragile", str(copy))
    ok2 = engine.lora.add("ok2", str(adapters["ok2"]))  # evicts fragile's weights (max_cpu_loras=1)
    (copy / "adapter_model.safetensors").write_bytes(b"broken")
    prompt = engine.tokenizer.encode("Once upon a time")
    params = SamplingParams(max_tokens=4, temperature=0.0)
    engine.add_request("bad", prompt, params, fragile)
    engine.add_request("good", prompt, params, ok2)
    engine.add_request("base", prompt, params, None)
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert outs["bad"][-1].finish_reason == "error" and "could not be loaded" in (outs["bad"][-1].error or "")
    assert sum(len(o.new_token_ids) for o in outs["good"]) == 4
    assert sum(len(o.new_token_ids) for o in outs["base"]) == 4
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
