"""`python -m server` as a subprocess: probes while loading, JSON logs and the startup summary, API key,
token limits, 429 under --max-concurrent-requests, client disconnects aborting engine requests (KV
usage back to 0 in /metrics), and SIGTERM draining an admitted request before exiting 0 (last test)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
import text_generation
from conftest import scrape_metric
from serving import free_port, wait_ready

REPO = Path(__file__).resolve().parents[2]
KEY = "test-secret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_INPUT, MAX_TOTAL = 48, 96

pytestmark = pytest.mark.slow  # a separate server process loads the model (~15-40 s on 2 shared cores)
# Greedy SmolLM2 keeps counting here for well over 80 tokens (no early EOS).
COUNTING = "1, 2, 3, 4, 5,"
# The stream in flight at SIGTERM: long enough that the server is still draining while the test reads
# /ready, /health and a refused request after it (the prompt plus these fit --max-total-tokens).
DRAINED_TOKENS = 80


@dataclass
class ProcServer:
    url: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    loading_ready: tuple[int, dict] | None = None
    loading_health: int | None = None
    extra: dict = field(default_factory=dict)

    def metric(self, name: str) -> float:
        return scrape_metric(self.url, name, 0.0)

    def log_lines(self) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines()


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1"
    )
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.pop("API_KEY", None)
    return env


@pytest.fixture(scope="module")
def proc_server(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcServer]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("proc") / "server.log"
    env = _env()
    env["API_KEY"] = KEY  # read from the environment, as in a Kubernetes Secret
    cmd = [
        sys.executable,
        "-m",
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--num-kv-blocks",
        "64",
        "--max-concurrent-requests",
        "2",
        "--max-input-tokens",
        str(MAX_INPUT),
        "--max-total-tokens",
        str(MAX_TOTAL),
        "--drain-timeout",
        "60",
        "--log-format",
        "json",
        "--num-threads",
        "1",
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    srv = ProcServer(url=url, port=port, proc=proc, log_path=log_path)
    deadline = time.monotonic() + 300  # importing torch alone takes minutes on a loaded machine
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            r = httpx.get(f"{url}/ready", timeout=2)
            srv.loading_ready = (r.status_code, r.json())
            srv.loading_health = httpx.get(f"{url}/health", timeout=2).status_code
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    wait_ready(url)
    yield srv
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def test_api_proc_help_lists_flags_and_env() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "server", "--help"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    out = " ".join(out.split())  # help lines wrap anywhere between words
    for flag, env in [
        ("--model", "MODEL_ID"),
        ("--port", "PORT"),
        ("--max-concurrent-requests", "MAX_CONCURRENT_REQUESTS"),
        ("--max-input-tokens", "MAX_INPUT_TOKENS"),
        ("--max-total-tokens", "MAX_TOTAL_TOKENS"),
        ("--api-key", "API_KEY"),
        ("--quantize", "QUANTIZE"),
        ("--dtype", "DTYPE"),
        ("--drain-timeout", None),
        ("--log-format", None),
        ("--enable-prefix-caching", "ENABLE_PREFIX_CACHING"),
        ("--kv-cache-memory", None),
        ("--num-kv-blocks", None),
        ("--block-size", None),
        ("--max-num-seqs", None),
        ("--max-num-batched-tokens", None),
        ("--served-model-name", None),
        ("--host", None),
        ("--max-payload-bytes", "PAYLOAD_LIMIT"),
        ("--attention-backend", None),
        ("--cache-dir", "KUBEINFER_CACHE_DIR"),
    ]:
        assert flag in out, flag
        if env:
            assert f"[env: {env}]" in out, env


def test_api_proc_probes_while_loading_and_startup_log(proc_server: ProcServer) -> None:
    assert proc_server.loading_ready == (503, {"status": "loading"})
    assert proc_server.loading_health == 200
    records = [json.loads(line) for line in proc_server.log_lines() if line.startswith("{")]
    assert records, "expected JSON log lines"
    summary = [r["message"] for r in records if r["message"].startswith("ready: ")]
    assert len(summary) == 1
    for part in (
        "model=",
        "architecture=LlamaForCausalLM",
        "dtype=float32",
        "quantization=",
        "parameters=",
        "kv_blocks=64",
        "max_concurrent_sequences=",
        f"url=http://127.0.0.1:{proc_server.port}",
    ):
        assert part in summary[0], part


def test_api_proc_api_key(proc_server: ProcServer) -> None:
    url = proc_server.url
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}
    r = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert r.status_code == 401 and r.json()["error_type"] == "unauthorized"
    r = httpx.post(f"{url}/generate", json=body, headers={"Authorization": "Bearer wrong"}, timeout=60)
    assert r.status_code == 401
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    for path in ("/health", "/ready", "/metrics", "/info"):
        assert httpx.get(f"{url}{path}", timeout=60).status_code == 200, path
    r = httpx.post(f"{url}/generate", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["generated_text"]
    model = httpx.get(f"{url}/v1/models", headers=AUTH, timeout=60).json()["data"][0]["id"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).completions.create(
            model=model, prompt="x"
        )
    ok = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY).completions.create(
        model=model, prompt="Hello", max_tokens=2
    )
    assert ok.usage.completion_tokens == 2
    assert (
        text_generation.Client(url, headers=AUTH).generate("Hello", max_new_tokens=2).details.generated_tokens
        == 2
    )


def test_api_proc_token_limits(proc_server: ProcServer) -> None:
    url = proc_server.url
    long_prompt = "one two three four five six seven eight nine ten " * 8  # ~80 tokens
    r = httpx.post(
        f"{url}/generate",
        json={"inputs": long_prompt, "parameters": {"max_new_tokens": 2}},
        headers=AUTH,
        timeout=60,
    )
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    assert str(MAX_INPUT) in r.json()["error"] and str(MAX_TOTAL) in r.json()["error"]
    r = httpx.post(
        f"{url}/generate",
        json={"inputs": "Hello", "parameters": {"max_new_tokens": MAX_TOTAL}},
        headers=AUTH,
        timeout=60,
    )
    assert (
        r.status_code == 422 and "max_new_tokens" in r.json()["error"] and str(MAX_TOTAL) in r.json()["error"]
    )
    r = httpx.post(
        f"{url}/v1/completions", json={"prompt": long_prompt, "max_tokens": 2}, headers=AUTH, timeout=60
    )
    assert r.status_code == 400 and str(MAX_INPUT) in r.json()["error"]["message"]
    r = httpx.post(
        f"{url}/v1/chat/completions",
        headers=AUTH,
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_TOTAL},
        timeout=60,
    )
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    # Without max_new_tokens the default stays within the limits (this prompt ends at once with EOS).
    r = httpx.post(
        f"{url}/generate", json={"inputs": "Write a long story about a dragon."}, headers=AUTH, timeout=60
    )
    assert r.status_code == 200, r.text
    # TGI's truncate keeps the last N prompt tokens, so the long prompt now fits.
    params = {"max_new_tokens": 2, "truncate": 10, "decoder_input_details": True, "details": True}
    r = httpx.post(
        f"{url}/generate", json={"inputs": long_prompt, "parameters": params}, headers=AUTH, timeout=60
    )
    assert r.status_code == 200 and r.headers["x-prompt-tokens"] == "10"
    tokens = httpx.post(f"{url}/tokenize", json={"inputs": long_prompt}, headers=AUTH, timeout=60).json()
    assert [t["id"] for t in r.json()["details"]["prefill"]] == [t["id"] for t in tokens[-10:]]
    assert proc_server.metric("vllm:num_requests_running") == 0


def _wait_metric(srv: ProcServer, name: str, value: float, timeout_s: float = 60.0) -> float:
    deadline = time.monotonic() + timeout_s
    current = srv.metric(name)
    while current != value and time.monotonic() < deadline:
        time.sleep(0.05)
        current = srv.metric(name)
    return current


def test_api_proc_overload_and_stream_disconnect(proc_server: ProcServer) -> None:
    url = proc_server.url
    aborts_before = _abort_count(proc_server)
    body = {"inputs": COUNTING, "parameters": {"max_new_tokens": 80}}
    clients = [httpx.Client(timeout=60) for _ in range(2)]
    streams = []
    for c in clients:
        s = c.send(c.build_request("POST", f"{url}/generate_stream", json=body, headers=AUTH), stream=True)
        assert s.status_code == 200
        lines = s.iter_lines()
        # First token arrived: the request is running. (Dropping the iterator would close the connection.)
        while not next(lines):
            pass
        streams.append((s, lines))
    assert proc_server.metric("vllm:num_requests_running") == 2
    assert proc_server.metric("vllm:kv_cache_usage_perc") > 0
    r = httpx.post(f"{url}/generate", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 429 and r.json()["error_type"] == "overloaded"
    # Rejected at once, not queued until a slot freed: both streams are still running after the 429 (a
    # wall-clock bound on the 429 failed on a loaded machine; their 80 tokens outlast a prompt refusal).
    assert proc_server.metric("vllm:num_requests_running") == 2
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=AUTH, timeout=60)
    assert r.status_code == 429 and r.json()["error"]["code"] == 429
    with pytest.raises(text_generation.errors.OverloadedError):
        text_generation.Client(url, headers=AUTH).generate("x", max_new_tokens=2)
    for (s, _), c in zip(streams, clients, strict=True):
        s.close()
        c.close()
    assert _wait_metric(proc_server, "vllm:num_requests_running", 0) == 0
    assert _wait_metric(proc_server, "vllm:kv_cache_usage_perc", 0) == 0
    assert _abort_count(proc_server) - aborts_before == 2
    assert proc_server.metric("kubeinfer_requests_in_flight") == 0


def test_api_proc_nonstreaming_disconnect(proc_server: ProcServer) -> None:
    gen_before = proc_server.metric("vllm:generation_tokens_total")
    aborts_before = _abort_count(proc_server)
    payload = json.dumps({"inputs": COUNTING, "parameters": {"max_new_tokens": 80}}).encode()
    head = (
        f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", proc_server.port))
    sock.sendall(head + payload)
    assert _wait_metric(proc_server, "vllm:num_requests_running", 1) == 1
    sock.close()
    assert _wait_metric(proc_server, "vllm:num_requests_running", 0) == 0
    assert _wait_metric(proc_server, "vllm:kv_cache_usage_perc", 0) == 0
    assert _abort_count(proc_server) - aborts_before == 1
    assert proc_server.metric("vllm:generation_tokens_total") - gen_before < 80


def _abort_count(srv: ProcServer) -> float:
    text = httpx.get(f"{srv.url}/metrics", timeout=60).text
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_api_proc_sigterm_drains_then_exits_0(proc_server: ProcServer) -> None:
    """Runs last in this module: it stops the server."""
    url = proc_server.url
    events: list[dict] = []
    first = threading.Event()
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            body = {"inputs": COUNTING, "parameters": {"max_new_tokens": DRAINED_TOKENS}}
            with httpx.stream("POST", f"{url}/generate_stream", json=body, headers=AUTH, timeout=120) as s:
                for line in s.iter_lines():
                    if line:
                        events.append(json.loads(line.removeprefix("data:")))
                        first.set()
        except BaseException as e:
            errors.append(e)
            first.set()

    t = threading.Thread(target=consume)
    t.start()
    assert first.wait(60)
    proc_server.proc.send_signal(signal.SIGTERM)
    # The signal handler runs when the server's event loop next gets the CPU: wait for it (a fixed
    # 0.3 s sleep read /ready before it on a loaded machine).
    deadline = time.monotonic() + 60
    while (r := httpx.get(f"{url}/ready", timeout=30)).status_code != 503:
        assert time.monotonic() < deadline, "/ready did not turn 503 after SIGTERM"
        time.sleep(0.05)
    assert r.json() == {"status": "draining"}
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    r = httpx.post(
        f"{url}/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2}}, headers=AUTH, timeout=30
    )
    assert r.status_code == 503
    t.join(120)
    assert not errors, errors
    assert events[-1]["details"]["generated_tokens"] == DRAINED_TOKENS and events[-1]["generated_text"]
    assert proc_server.proc.wait(60) == 0
    assert any("drained" in line for line in proc_server.log_lines())
