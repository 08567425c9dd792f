"""SIGTERM with requests that cannot finish before the drain deadline (issue 25, item 10): a real
`python -m server` process with `--drain-timeout 0` and requests made long (ignore_eos, max_tokens up to
the context) on a tiny random model. Each cut request ends in its API's shape - OpenAI streams a final
`data: {"error": ...}` then `data: [DONE]`, TGI streams `data:{"error", "error_type"}`, unary calls get
a 503 body naming the shutdown - and the process exits 3 (EXIT_REQUESTS_CUT), not 0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import scrape_metric
from serving import free_port, wait_ready

REPO = Path(__file__).resolve().parents[2]
LONG = 900  # tokens: the tiny model's context is 1024

pytestmark = pytest.mark.slow  # a server process of its own


def _start(model: Path, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1"
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.pop("API_KEY", None)
    cmd = [
        sys.executable,
        "-m",
        "server",
        "--model",
        str(model),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--num-threads",
        "1",
        "--drain-timeout",
        "0",
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url)
    except BaseException:
        proc.kill()
        raise
    return proc, url


def test_drain_deadline_cuts_in_shape_and_exit_code(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    proc, url = _start(tiny_model_factory("llama"), tmp_path / "server.log")
    try:
        results: dict[str, Any] = {}
        streaming = threading.Event()
        seen: set[str] = set()

        def stream(name: str, path: str, body: dict[str, Any]) -> None:
            lines: list[str] = []
            try:
                with httpx.stream("POST", f"{url}{path}", json=body, timeout=300) as r:
                    results[name + ":status"] = r.status_code
                    for line in r.iter_lines():
                        if line:
                            lines.append(line)
                            seen.add(name)
                            if len(seen) == 2:
                                streaming.set()
            except httpx.HTTPError as e:  # a broken stream: what the fix removes
                lines.append(f"BROKEN {type(e).__name__}")
            results[name] = lines

        def unary(name: str, path: str, body: dict[str, Any]) -> None:
            try:
                r = httpx.post(f"{url}{path}", json=body, timeout=300)
                results[name] = (r.status_code, r.json())
            except (httpx.HTTPError, ValueError) as e:
                results[name] = ("BROKEN", repr(e))

        openai_body = {"model": "tiny", "prompt": "Once upon", "max_tokens": LONG, "ignore_eos": True}
        tgi_body = {"inputs": "Once upon", "parameters": {"max_new_tokens": LONG}}
        threads = [
            threading.Thread(
                target=stream, args=("oai-stream", "/v1/completions", {**openai_body, "stream": True})
            ),
            threading.Thread(target=stream, args=("tgi-stream", "/generate_stream", tgi_body)),
            threading.Thread(target=unary, args=("oai-unary", "/v1/completions", openai_body)),
            threading.Thread(target=unary, args=("tgi-unary", "/generate", tgi_body)),
        ]
        for t in threads:
            t.start()
        assert streaming.wait(120), results
        deadline = time.monotonic() + 60
        while scrape_metric(url, "kubeinfer_requests_in_flight", 0.0) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    log_text = (tmp_path / "server.log").read_text(errors="replace")

    oai = results["oai-stream"]
    assert oai[-1] == "data: [DONE]", (oai[-3:], log_text[-3000:])
    err = json.loads(oai[-2].removeprefix("data: "))["error"]
    assert (
        err["code"] == 503 and err["type"] == "ServiceUnavailableError" and "shutting down" in err["message"]
    )

    tgi = results["tgi-stream"]
    last = json.loads(tgi[-1].removeprefix("data:"))
    assert last["error_type"] == "unavailable" and "shutting down" in last["error"], tgi[-2:]

    status, body = results["oai-unary"]
    assert status == 503 and "shutting down" in body["error"]["message"], (status, body)
    status, body = results["tgi-unary"]
    assert status == 503 and body["error_type"] == "unavailable" and "drain deadline" in body["error"]

    assert code == 3, log_text[-2000:]
    assert "cutting them" in log_text
