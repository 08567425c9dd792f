"""benchmarks/real_shape_loads.py (issue 49 item 2): the named loads, the ITL split by other streams'
prefill windows, prefix-cache hit rates from /metrics deltas and from llama-server's `timings`, the
engine state read after a run, and the KV context the harness gives every server."""

from __future__ import annotations

from typing import Any

import pytest
from benchmark_modules import load_benchmark


def _module(file: str) -> Any:
    return load_benchmark(file)


def _loads() -> Any:
    return _module("real_shape_loads.py")


def test_named_loads_have_the_issue_shapes() -> None:
    m = _loads()
    assert {n: m.named_load(n, 2) for n in m.NAMED} == {
        "64_users": m.Load("64_users", 64, 128, 128),
        "128_users_queued": m.Load("128_users_queued", 128, 128, 128),
        "8_users_2048_prompt": m.Load("8_users_2048_prompt", 8, 8, 2048, split_itl=True),
        "8_users_8192_prompt": m.Load("8_users_8192_prompt", 8, 8, 8192, split_itl=True),
        "32_users_shared_prefix_2048": m.Load("32_users_shared_prefix_2048", 32, 64, 128, 2048),
    }
    # fewer long-prompt users: the name says how many ran
    assert m.named_load("8_users_8192_prompt", 1, long_users=3).name == "3_users_8192_prompt"
    with pytest.raises(ValueError, match="unknown load"):
        m.named_load("9_users", 1)
    with pytest.raises(ValueError, match="must be >= 1"):
        m.Load("x", 0, 1, 1)


def _stream(start: float, times: list[float], error: str | None = None) -> Any:
    return _loads().Stream(start=start, chunk_times=times, end=times[-1] if times else start, error=error)


def test_itl_split_by_other_streams_prefill_windows() -> None:
    m = _loads()
    # A decodes from t=1 every 0.1 s; B is sent at 1.25 and prefills until 1.6 (A's gaps slow to 0.2
    # s); after B's first token both decode every 0.1 s.
    a = _stream(0.0, [1.0, 1.1, 1.2, 1.4, 1.6, 1.7, 1.8])
    b = _stream(1.25, [1.6, 1.7, 1.8, 1.9])
    split = m.itl_split([a, b])
    during, quiet = split["during_other_prefill"], split["quiet"]
    # A's gaps (1.2,1.4) and (1.4,1.6) overlap B's window (1.25,1.6); (1.1,1.2) ends before it opens.
    # B's gaps all start after A's window (0,1.0).
    assert during["n"] == 2 and during["p99"] == pytest.approx(0.2)
    assert quiet["n"] == 4 + 3 and quiet["p99"] == pytest.approx(0.1)
    assert split["p99_during_over_quiet"] == pytest.approx(2.0)
    # a stream's own prefill never counts against itself; a failed stream's gaps are not counted (its
    # window, 2-5 s, opens after the other's last gap)
    lone = m.itl_split([_stream(0.0, [1.0, 1.1, 1.2]), _stream(2.0, [5.0, 9.0], error="HTTP 500")])
    assert lone["during_other_prefill"]["n"] == 0 and lone["quiet"]["n"] == 2
    assert lone["p99_during_over_quiet"] is None


def test_summary_counts_failures_and_queue_ttft() -> None:
    m = _loads()
    ok = [_stream(0.0, [float(i + 1), float(i + 1) + 0.1]) for i in range(4)]  # TTFT 1, 2, 3, 4 s
    bad = _stream(0.0, [], error="HTTP 503: busy")
    res = m.summarize_streams([*ok, bad, bad], 5.0, split=False)
    assert (res["requests"], res["completed"], res["failed"]) == (6, 4, 2)
    assert res["errors"] == {"HTTP 503: busy": 2}
    assert res["ttft_s"]["p50"] == pytest.approx(3.0)  # nearest rank of 1, 2, 3, 4
    assert res["ttft_s"]["max"] == pytest.approx(4.0)
    assert res["output_tokens"] == 8 and "itl_split_s" not in res


def test_prefix_cache_rate_from_llama_timings() -> None:
    m = _loads()
    s1, s2 = _stream(0.0, [1.0]), _stream(0.0, [1.0])
    s1.cached_tokens, s1.computed_tokens = 0, 2100  # the first fills the slot
    s2.cached_tokens, s2.computed_tokens = 2000, 100
    res = m.summarize_streams([s1, s2], 1.0, split=False)
    assert res["prefix_cache_from_responses"] == {
        "hit_tokens": 2000,
        "prompt_tokens": 4200,
        "hit_rate": 0.4762,
    }


METRICS_BEFORE = """# HELP vllm:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{model_name="m"} 100.0
vllm:prefix_cache_queries_created{model_name="m"} 1.7e9
vllm:prefix_cache_hits_total{model_name="m"} 10.0
vllm:num_requests_running{model_name="m"} 3.0
"""

METRICS_AFTER = """vllm:prefix_cache_queries_total{model_name="m"} 4300.0
vllm:prefix_cache_hits_total{model_name="m"} 2010.0
vllm:num_requests_running{model_name="m"} 0.0
vllm:num_requests_waiting{model_name="m"} 0.0
vllm:kv_cache_usage_perc{model_name="m"} 0.0
vllm:num_preemptions_total{model_name="m"} 2.0
"""


def test_prefix_cache_delta_and_engine_state_from_metrics() -> None:
    m = _loads()
    before, after = m.prometheus_values(METRICS_BEFORE), m.prometheus_values(METRICS_AFTER)
    assert m.prefix_cache_delta(before, after) == {
        "hit_tokens": 2000,
        "query_tokens": 4200,
        "hit_rate": 0.4762,
    }
    assert m.prefix_cache_delta({}, after) is None  # llama-server exports neither counter
    assert m.engine_state(after) == {
        "num_requests_running": 0.0,
        "num_requests_waiting": 0.0,
        "kv_cache_usage_perc": 0.0,
        "num_preemptions": 2.0,
    }


def test_ours_metrics_endpoint_names_match_what_the_client_reads() -> None:
    """The harness reads ours' /metrics with vLLM's names: a rename in server/metrics.py must show here."""
    from server.core.outputs import SchedulerStats
    from server.metrics import ServerMetrics

    stats = SchedulerStats(
        num_running=0,
        num_waiting=0,
        kv_cache_usage=0.25,
        num_free_blocks=3,
        num_total_blocks=4,
        prefix_cache_queries=4200,
        prefix_cache_hits=2000,
        num_preemptions=1,
        num_prompt_tokens=2200,
        num_generation_tokens=64,
    )
    metrics = ServerMetrics("m", lambda: stats, lambda: 0, lambda: True)
    m = _loads()
    values = m.prometheus_values(metrics.render().decode())
    zero = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    assert m.prefix_cache_delta(zero, values) == {
        "hit_tokens": 2000,
        "query_tokens": 4200,
        "hit_rate": 0.4762,
    }
    assert m.engine_state(values) == {
        "num_requests_running": 0.0,
        "num_requests_waiting": 0.0,
        "kv_cache_usage_perc": 0.25,
        "num_preemptions": 1.0,
    }


def test_context_holds_the_heaviest_load() -> None:
    s = _module("real_shapes_served.py")
    m = _loads()
    assert s.context_tokens([m.Load("1_user", 1, 4, 128)], 64) == 8192  # like llama-server's default
    # 8 users of 8,192-token prompts and 64 new tokens each hold 66,048 tokens at once
    assert s.context_tokens([m.named_load("8_users_8192_prompt", 1)], 64) == 66560
    # llama-server's slots each copy a shared prefix: 32 x 2,192 = 70,144, rounded up to 1,024
    assert s.context_tokens([m.named_load("32_users_shared_prefix_2048", 1)], 16) == 70656
    assert s.base_server("ours-gguf-itl2") == "ours-gguf" and s.base_server("llama") == "llama"
