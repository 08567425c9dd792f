"""benchmarks/real_shapes_served.py's bookkeeping (issues 44/47/49): ratios come from the same rounds
within a phase and are marked when they cross phases, failed runs count for nothing, memory is compared
ours-on-GGUF against llama-server, and each server gets the command that serves the right file."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _served() -> Any:
    name = "kubeinfer_benchmarks_real_shapes_served"
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, str(BENCH))  # it imports its neighbours, as when run as a script
    spec = importlib.util.spec_from_file_location(name, BENCH / "real_shapes_served.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _run(server: str, phase: int, rnd: int, tok_s: float, ttft: float, completed: int = 4) -> dict[str, Any]:
    return {
        "model": "m",
        "server": server,
        "phase": phase,
        "load": "1_user",
        "round": rnd,
        "requests": 4,
        "completed": completed,
        "output_tokens": 256,
        "output_tokens_per_s": tok_s,
        "ttft_s": {"p50": ttft, "p99": ttft},
        "itl_s": {"p50": 0.01, "p99": 0.02},
    }


def test_ratios_pair_rounds_within_a_phase_and_mark_those_across() -> None:
    s = _served()
    runs = [
        _run("ours-gguf", 0, 0, 30.0, 0.2),
        _run("llama", 0, 0, 20.0, 0.4),
        _run("ours-gguf", 0, 1, 10.0, 0.2),  # a slow round for both: its ratio is still 1.0
        _run("llama", 0, 1, 10.0, 0.4),
        _run("ours-gguf", 0, 2, 40.0, 0.2),
        _run("llama", 0, 2, 20.0, 0.4),
        _run("vllm-bf16", 1, 0, 5.0, 1.0),
        _run("vllm-bf16", 1, 1, 15.0, 1.0, completed=3),  # a failed request: the run measured nothing
    ]
    summary = s.summarize(runs)
    assert summary["m"]["ours-gguf"]["1_user"]["output_tokens_per_s"] == 30.0  # median of 30, 10, 40
    assert summary["m"]["vllm-bf16"]["1_user"]["output_tokens_per_s"] == 5.0
    rat = s.ratios(runs, summary)["m"]
    same = rat["ours-gguf_vs_llama"]["1_user"]
    # per-round ratios 1.5, 1.0, 2.0 -> 1.5; the ratio of the medians would be 30 / 20 = 1.5 too, so
    # check the rounds themselves
    assert same["output_tokens_per_s"]["rounds"] == [1.5, 1.0, 2.0]
    assert same["output_tokens_per_s"]["same_phase"] is True
    assert same["ttft_p50_s"]["median"] == 0.5
    across = rat["ours-gguf_vs_vllm-bf16"]["1_user"]["output_tokens_per_s"]
    assert across == {"median": 6.0, "same_phase": False}
    assert "llama_vs_vllm-bf16" not in rat  # peers are not compared with each other


def test_memory_ratio_is_ours_gguf_over_llama_loaded() -> None:
    s = _served()
    servers = {
        "m": {
            "ours-gguf": {"rss_bytes_loaded": 3 << 30, "rss_bytes_after_runs": 4 << 30},
            "llama": {"rss_bytes_loaded": 2 << 30, "rss_bytes_after_runs": 2 << 30},
            "ours-hf": {"rss_bytes_loaded": 9 << 30},
        },
        "only-ours": {"ours-gguf": {"rss_bytes_loaded": 1 << 30}},
    }
    assert s.memory_ratios(servers) == {"m": {"loaded": 1.5, "after_runs": 2.0}}


@pytest.mark.parametrize("server", ["ours-gguf", "ours-hf", "llama", "vllm-bf16"])
def test_each_server_serves_its_file(tmp_path: Path, server: str) -> None:
    s = _served()
    folder = tmp_path / "gemma-3-1b"
    folder.mkdir()
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    cfg = {"num_hidden_layers": 26, "num_key_value_heads": 1, "head_dim": 256, "hidden_size": 1152}
    (folder / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 4}))
    gguf = folder / "gemma-3-1b-Q4_K_M.gguf"
    path = gguf if server in ("ours-gguf", "llama") else folder
    cmd, env = s.command(s.Target(server, "gemma-3-1b", path), 8123, tmp_path / "peers", 2)
    assert str(path) in cmd and "8123" in cmd
    if server == "ours-gguf":  # our GGUF tokenizer reader drops llama.cpp's template: the folder's
        assert cmd[cmd.index("--chat-template") + 1] == str(folder / "chat_template.jinja")
    if server.startswith("ours"):  # llama-server's 8,192 tokens of bf16 K and V in all 26 layers
        assert int(cmd[cmd.index("--kv-cache-memory") + 1]) == 8192 * 26 * 1 * 256 * 2 * 2
    if server == "llama":  # one KV region for all slots: one slot can take the 4,096-token prompt
        assert "-kvu" in cmd and cmd[cmd.index("-c") + 1] == "8192"
    if server == "vllm-bf16":
        assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
        assert env["VLLM_CPU_KVCACHE_SPACE"] == str(s.KV_GIB)
    with pytest.raises(ValueError, match="unknown server"):
        s.command(s.Target("tgi", "m", path), 1, tmp_path, 2)


def test_a_server_that_exits_while_loading_is_reported_not_waited_for(tmp_path: Path) -> None:
    import subprocess
    import time

    s = _served()
    log = tmp_path / "x.log"
    log.write_text("boom: unsupported architecture\n")
    proc = subprocess.Popen(["true"])
    proc.wait()
    spec = s._PeerSpec("ours-gguf", "ours")
    srv = s.Running(spec, "http://127.0.0.1:9", proc.pid, log, "true", proc)
    t0 = time.monotonic()
    failed = s.wait_all([srv], timeout_s=60)
    assert time.monotonic() - t0 < 30
    assert (
        "exited before becoming ready" in failed[proc.pid] and "unsupported architecture" in failed[proc.pid]
    )


def test_sampling_fields_parse_into_each_requests_body() -> None:
    served = _served()
    assert served._sampling_fields("temperature=0.7,top_p=0.9,top_k=40") == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
    }
    assert served._sampling_fields("") == {}
    for bad in ("temperature", "beam=2", "top_k=x"):
        with pytest.raises((served.argparse.ArgumentTypeError, ValueError)):
            served._sampling_fields(bad)
