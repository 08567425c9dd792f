"""Limits: request bodies over the payload limit (default 2 MB) get 413, with or without a
Content-Length; the API key is checked with hmac.compare_digest (constant time); prompts and outputs
never appear in log records at INFO or above."""

from __future__ import annotations

import hmac
import json
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from rel_support import API_KEY, InProcServer, http_status_counts, new_marker

DEFAULT_LIMIT = 2_000_000


def test_rel_limits_payload_default_is_2mb() -> None:
    from server.cli import build_parser, config_from_args
    from server.config import ServerConfig

    args = build_parser(environ={}).parse_args([])
    assert config_from_args(args).max_payload_bytes == DEFAULT_LIMIT
    assert ServerConfig().max_payload_bytes == DEFAULT_LIMIT
    args = build_parser(environ={"PAYLOAD_LIMIT": "64KiB"}).parse_args([])
    assert config_from_args(args).max_payload_bytes == 64 * 1024


@pytest.mark.parametrize(
    ("path", "openai"),
    [
        ("/generate", False),
        ("/generate_stream", False),
        ("/v1/completions", True),
        ("/v1/chat/completions", True),
    ],
)
def test_rel_limits_body_over_limit_gets_413(rel_server: InProcServer, path: str, openai: bool) -> None:
    assert rel_server.state.config.max_payload_bytes == DEFAULT_LIMIT
    filler = "x" * (DEFAULT_LIMIT + 10)
    body = (
        {"prompt": filler, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        if openai
        else {"inputs": filler, "parameters": {"max_new_tokens": 2}}
    )
    r = httpx.post(f"{rel_server.url}{path}", json=body, headers=rel_server.auth, timeout=60)
    assert r.status_code == 413, r.text[:300]
    if openai:
        assert r.json()["error"]["code"] == 413
    else:
        assert r.json()["error_type"] == "payload_too_large"


def test_rel_limits_chunked_body_over_limit_gets_413(rel_server: InProcServer) -> None:
    """No Content-Length (chunked upload): the limit is enforced while reading, not trusted from a header."""
    chunk = b" " * 65536

    def body() -> Iterator[bytes]:
        yield b'{"inputs": "hello", "parameters": {"max_new_tokens": 2}'
        for _ in range(DEFAULT_LIMIT // len(chunk) + 2):
            yield chunk
        yield b"}"

    r = httpx.post(
        f"{rel_server.url}/generate",
        content=body(),
        headers={**rel_server.auth, "content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413, r.text[:300]
    assert r.json()["error_type"] == "payload_too_large"


def test_rel_limits_body_just_under_limit_is_served(rel_server: InProcServer) -> None:
    padding = " " * (DEFAULT_LIMIT - 200)  # JSON whitespace: a big body, a short prompt
    raw = f'{{"inputs": "hello there",{padding}"parameters": {{"max_new_tokens": 2, "details": true}}}}'
    assert len(raw) < DEFAULT_LIMIT
    r = httpx.post(
        f"{rel_server.url}/generate",
        content=raw.encode(),
        headers={**rel_server.auth, "content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 200, r.text[:300]
    assert r.json()["details"]["generated_tokens"] == 2


@pytest.fixture
def compare_spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Records hmac.compare_digest calls; `force` overrides its answer to prove the server obeys it."""
    real = hmac.compare_digest
    spy: dict[str, Any] = {"calls": [], "force": None}

    def compare(a: Any, b: Any) -> bool:
        spy["calls"].append((a, b))
        return real(a, b) if spy["force"] is None else bool(spy["force"])

    monkeypatch.setattr(hmac, "compare_digest", compare)
    yield spy


def test_rel_limits_api_key_uses_constant_time_compare(
    rel_server: InProcServer, compare_spy: dict[str, Any]
) -> None:
    url = f"{rel_server.url}/generate"
    body = {"inputs": "key check", "parameters": {"max_new_tokens": 1}}
    same_length_wrong = "x" * len(API_KEY)

    assert httpx.post(url, json=body, timeout=30).status_code == 401  # no header: nothing to compare
    for wrong in (same_length_wrong, "short", API_KEY + "x"):
        compare_spy["calls"].clear()
        r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {wrong}"}, timeout=30)
        assert r.status_code == 401, wrong
        assert compare_spy["calls"] == [(wrong.encode(), API_KEY.encode())]

    compare_spy["calls"].clear()
    r = httpx.post(url, json=body, headers=rel_server.auth, timeout=30)
    assert r.status_code == 200
    assert compare_spy["calls"] == [(API_KEY.encode(), API_KEY.encode())]

    # The decision is compare_digest's alone: overriding its answer flips the outcome both ways.
    compare_spy["force"] = False
    assert httpx.post(url, json=body, headers=rel_server.auth, timeout=30).status_code == 401
    compare_spy["force"] = True
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}, timeout=30).status_code == 200


def _record_texts(records: list[logging.LogRecord]) -> list[str]:
    fmt = logging.Formatter()
    out = []
    for rec in records:
        text = rec.getMessage()
        if rec.exc_info:
            text += "\n" + fmt.formatException(rec.exc_info)
        if rec.exc_text:
            text += "\n" + rec.exc_text
        if rec.stack_info:
            text += "\n" + rec.stack_info
        out.append(text)
    return out


def test_rel_limits_prompts_and_outputs_not_logged_at_info(
    rel_server: InProcServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    marker = new_marker()
    url, auth = rel_server.url, rel_server.auth
    outputs: list[str] = []
    with httpx.Client(base_url=url, headers=auth, timeout=60) as c:
        r = c.post("/generate", json={"inputs": f"{marker} one", "parameters": {"max_new_tokens": 12}})
        outputs.append(r.json()["generated_text"])
        with c.stream(
            "POST", "/generate_stream", json={"inputs": f"{marker} two", "parameters": {"max_new_tokens": 12}}
        ) as s:
            last = [ln for ln in s.iter_lines() if ln.startswith("data:")][-1]
        outputs.append(json.loads(last[5:])["generated_text"])
        r = c.post("/v1/completions", json={"prompt": f"{marker} three", "max_tokens": 12})
        outputs.append(r.json()["choices"][0]["text"])
        r = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": f"{marker} four"}], "max_tokens": 12},
        )
        outputs.append(r.json()["choices"][0]["message"]["content"])
        with c.stream(
            "POST", "/v1/completions", json={"prompt": f"{marker} five", "max_tokens": 12, "stream": True}
        ) as s:
            s.read()
        # Error paths: a prompt over the limit, wrong types, malformed JSON, an unknown model.
        assert c.post("/generate", json={"inputs": f"{marker} " * 200}).status_code == 422
        assert (
            c.post("/generate", json={"inputs": marker, "parameters": {"top_k": marker}}).status_code == 422
        )
        bad = f'{{"inputs": "{marker}", '.encode()
        assert (
            c.post("/generate", content=bad, headers={"content-type": "application/json"}).status_code == 422
        )
        assert c.post("/v1/completions", json={"prompt": marker, "model": marker}).status_code == 404
        assert c.post("/v1/chat/completions", json={"messages": [{"role": marker}]}).status_code == 400
        r = c.post("/tokenize", json={"inputs": f"{marker} six"})
        assert r.status_code == 200
    outputs = [o for o in outputs if len(o) >= 12]
    assert len(outputs) >= 3, outputs

    records = [rec for rec in caplog.records if rec.levelno >= logging.INFO]
    assert any(rec.name == "server.api.access" for rec in records), "access log not captured"
    texts = _record_texts(records)
    assert not [t for t in texts if marker in t]
    assert not [(o, t) for o in outputs for t in texts if o in t]


def test_rel_limits_disconnect_while_sending_body_is_not_a_server_error(
    rel_server: InProcServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that goes away halfway through its request body (an impatient client on a busy server)
    is a cancelled request (499 in the metrics), not a 500 with a logged traceback."""
    caplog.set_level(logging.INFO)
    host, port = rel_server.url.removeprefix("http://").split(":")
    paths = ("/generate", "/v1/completions", "/tokenize")

    def counts() -> dict[tuple[str, str], float]:
        text = httpx.get(f"{rel_server.url}/metrics", timeout=10).text
        return {k: v for k, v in http_status_counts(text).items() if k[0] in paths}

    before = counts()
    for path in paths:
        with socket.create_connection((host, int(port)), timeout=10) as s:
            head = (
                f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
                "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
            )
            s.sendall(head.encode() + b'{"inputs": "half a bo')
            time.sleep(0.3)  # the server is now waiting for the rest of the body
    deadline = time.monotonic() + 120  # the loaded server sees the hang-ups when it next runs
    while sum(counts().values()) - sum(before.values()) < len(paths):
        assert time.monotonic() < deadline, "the server never finished the abandoned requests"
        time.sleep(0.1)
    after = counts()
    new = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    assert not [k for k in new if k[1].startswith("5")], new
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    assert rel_server.state.in_flight == 0
