"""/info's `memory`: the server's estimate of where its memory goes (server/memory_report.py), read
from the model's files before loading; its weight bytes agree with what the loader then held."""

from __future__ import annotations

import httpx
from conftest import LiveServer


def test_info_reports_the_memory_estimate(live_server: LiveServer) -> None:
    info = httpx.get(f"{live_server.url}/info", timeout=30).json()
    mem = info["memory"]
    llm = live_server.llm
    assert mem["source"] == "safetensors"
    # fp32 weights: the estimate from the headers equals the bytes the loaded model holds
    assert mem["weight_bytes"] == info["weight_bytes"] == llm.info.weight_bytes
    arch = llm.loaded.arch
    per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 4  # fp32 cache, no windows
    assert mem["kv_bytes_per_token"] == per_token
    assert mem["kv_bytes_per_sequence"] == per_token * llm.max_model_len
    assert mem["max_num_seqs"] == 32
    assert mem["total_bytes"] == mem["weight_bytes"] + mem["kv_cache_bytes"] + mem["runtime_overhead_bytes"]
