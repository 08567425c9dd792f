"""`python -m server` under a 1,000-request soak (both APIs, streaming and not, disconnects, bad input,
bursts beyond --max-concurrent-requests), then SIGTERM while 16 streams run (the last test: it ends
the server). The soak figures are printed and written to /tmp/kubeinfer-soak-report.json."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from rel_soak import SoakConfig, report_json, run_soak
from rel_support import ServerProcess, start_server

MAX_INPUT, MAX_TOTAL, MAX_CONCURRENT = 64, 192, 24
DRAIN_TIMEOUT_S = 60.0
REPORT_PATH = Path("/tmp/kubeinfer-soak-report.json")
RSS_GROWTH_BOUND = 0.10


@pytest.fixture(scope="module")
def soak_server(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    model = tiny_model_factory("llama")
    log_path = tmp_path_factory.mktemp("soak") / "server.log"
    srv = start_server(
        model,
        log_path,
        "--max-concurrent-requests",
        str(MAX_CONCURRENT),
        "--max-input-tokens",
        str(MAX_INPUT),
        "--max-total-tokens",
        str(MAX_TOTAL),
        # Fewer sequences than admitted requests and a small KV cache: requests wait and get preempted.
        "--max-num-seqs",
        "16",
        "--num-kv-blocks",
        "48",
        "--drain-timeout",
        str(DRAIN_TIMEOUT_S),
        "--log-level",
        "info",
    )
    yield srv
    srv.stop()


def test_rel_soak_1000_requests(soak_server: ServerProcess) -> None:
    cfg = SoakConfig(
        num_requests=1000,
        concurrency=20,
        max_input_tokens=MAX_INPUT,
        max_total_tokens=MAX_TOTAL,
        max_concurrent_requests=MAX_CONCURRENT,
    )
    report = run_soak(soak_server.url, soak_server.pid, cfg)
    figures = report_json(report)
    REPORT_PATH.write_text(json.dumps(figures, indent=2))
    print("\nsoak report:", json.dumps(figures, indent=2))

    assert report.requests == 1000
    assert report.unexpected == [], report.unexpected[:20]
    statuses = {int(s) for s in report.statuses if s != "None"}
    assert not {s for s in statuses if s >= 500}, report.statuses
    assert report.server_5xx == 0  # the server's own count agrees (no 5xx the client did not see)
    # Every kind of traffic happened, and bursts overran --max-concurrent-requests.
    assert report.outcomes["completed"] >= 300
    assert report.outcomes["disconnected"] >= 50
    assert report.outcomes["rejected_4xx"] >= 100
    assert report.outcomes["rejected_429"] >= 1
    for kind in ("over_limit", "malformed_json", "wrong_type", "huge_max_new", "too_large"):
        assert report.by_kind[kind].get("rejected_4xx", 0) >= 1, kind
    assert report.peak_running >= 8  # real concurrency reached the engine
    # Nothing left behind: no KV blocks, no running or waiting requests, no admission slots.
    assert report.final_kv_cache_usage_perc == 0.0
    assert report.final_running == 0.0
    assert report.final_waiting == 0.0
    assert report.final_in_flight == 0.0
    # Memory settles: RSS after the 1,000th request within 10% of RSS after the 200th.
    assert set(report.rss_bytes_at) == {"200", "1000"}
    assert report.rss_growth_frac < RSS_GROWTH_BOUND, report.rss_bytes_at
    # Prompts and outputs never reach the server's INFO log.
    log = soak_server.log_text()
    assert "POST /generate" in log  # the access log is on, so the check below has teeth
    assert report.marker_prefix not in log
    # Bad input, disconnects and overload are routine: none of them may log an error or a traceback.
    noisy = [ln for ln in log.splitlines() if " ERROR " in ln or " WARNING " in ln or "Traceback" in ln]
    assert not noisy, noisy[:5]
    assert len(report.output_samples) >= 50
    leaked = [t for t in report.output_samples if t in log]
    assert not leaked, leaked[:3]


def test_rel_soak_keep_alive_outlives_client_pools(soak_server: ServerProcess) -> None:
    """An idle keep-alive connection survives longer than httpx's (and so openai's) 5 s pool expiry: the
    client always drops it first, so no request is sent on a connection the server is closing."""
    host, port = soak_server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", "/health")
        first = conn.getresponse()
        first.read()
        sock = conn.sock
        assert first.status == 200 and sock is not None
        time.sleep(6.0)
        conn.request("GET", "/health")
        again = conn.getresponse()
        again.read()
        assert again.status == 200
        assert conn.sock is sock  # the same connection, not a reconnect
    finally:
        conn.close()


async def _drain_stream(
    client: httpx.AsyncClient, i: int, started: asyncio.Event, counts: list[int], sigterm_at: list[float]
) -> dict[str, Any]:
    """One long stream; counts its token events and how many arrived after SIGTERM."""
    after = 0
    tgi = i % 2 == 0
    if tgi:
        path = "/generate_stream"
        body: dict[str, Any] = {"inputs": f"drain {i} river stone", "parameters": {"max_new_tokens": 40}}
    else:
        path = "/v1/completions"
        body = {"prompt": f"drain {i} river stone", "max_tokens": 40, "stream": True, "ignore_eos": True}
    events: list[str] = []
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            events.append(line[5:].strip())
            counts[i] += 1
            if counts[i] == 1 and all(counts):
                started.set()
            if sigterm_at:
                after += 1
    if tgi:
        last = json.loads(events[-1])
        assert "error" not in last, last
        assert last["generated_text"] is not None and last["details"]["generated_tokens"] >= 1, last
        return {"tokens": last["details"]["generated_tokens"], "after_sigterm": after}
    assert events[-1] == "[DONE]", events[-2:]
    frames = [json.loads(e) for e in events[:-1]]
    assert not any("error" in f for f in frames), frames[-1]
    assert frames[-1]["choices"][0]["finish_reason"] == "length", frames[-1]
    return {"tokens": 40, "after_sigterm": after}


def test_rel_soak_drain_sigterm_with_16_streams(soak_server: ServerProcess) -> None:
    """Last in the module: SIGTERM while 16 streams run. They all finish, new requests get 503, /ready
    turns 503, and the process exits 0 within the drain timeout."""
    srv = soak_server
    n = 16

    async def scenario() -> tuple[list[dict[str, Any]], list[tuple[str, int, Any]], float]:
        counts = [0] * n
        started = asyncio.Event()
        sigterm_at: list[float] = []
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
            streams = [
                asyncio.create_task(_drain_stream(client, i, started, counts, sigterm_at)) for i in range(n)
            ]
            await asyncio.wait_for(started.wait(), 60)  # every stream admitted and producing tokens
            srv.sigterm()
            sigterm_at.append(time.monotonic())
            rejected: list[tuple[str, int, Any]] = []
            deadline = time.monotonic() + 60  # the signal lands when the loaded server next runs
            while (await client.get("/ready")).status_code != 503:
                assert time.monotonic() < deadline, "/ready did not turn 503 after SIGTERM"
                await asyncio.sleep(0.05)
            rejected.append(("/ready", 503, (await client.get("/ready")).json()))
            for path, body in (
                ("/generate", {"inputs": "late", "parameters": {"max_new_tokens": 2}}),
                ("/generate_stream", {"inputs": "late", "parameters": {"max_new_tokens": 2}}),
                ("/v1/completions", {"prompt": "late", "max_tokens": 2}),
                (
                    "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "late"}], "max_tokens": 2},
                ),
            ):
                r = await client.post(path, json=body)
                rejected.append((path, r.status_code, r.json()))
            results = await asyncio.gather(*streams)
        return list(results), rejected, sigterm_at[0]

    results, rejected, sigterm_at = asyncio.run(scenario())
    rc = srv.proc.wait(timeout=DRAIN_TIMEOUT_S + 15)
    exit_after = time.monotonic() - sigterm_at
    print(f"\ndrain: {n} streams finished, exit code {rc} {exit_after:.1f} s after SIGTERM; {results}")

    assert len(results) == n
    assert all(r["tokens"] >= 1 for r in results)
    # The streams were mid-generation at SIGTERM, and kept streaming through the drain.
    assert sum(r["after_sigterm"] for r in results) >= n
    for path, status, body in rejected:
        assert status == 503, (path, status, body)
        if path.startswith("/v1/"):
            assert body["error"]["type"] == "ServiceUnavailableError", body
        elif path != "/ready":
            assert body["error_type"] == "unavailable", body
    assert rc == 0
    assert exit_after < DRAIN_TIMEOUT_S
    assert "drained; shutting down" in srv.log_text()
