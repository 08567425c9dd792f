"""Security round 2, server side (issue 45), over real HTTP on loopback against a tiny random Qwen2
served with the production uvicorn settings (`server.api.server.uvicorn_config`):
- slow request bodies: 130 connections that send a head and one byte of their body take no
  --max-concurrent-requests slot (admission after the body), a normal request is still served, and
  each slow one is answered 408 and closed at --timeout-request-body;
- connection caps (--limit-concurrency, --limit-concurrency-per-client) refuse at accept with 503;
- a web page cannot drive a keyless loopback server: management routes refuse cross-site requests, and
  a loopback-bound server answers only loopback Host names (DNS rebinding);
- /v1/models shows no server paths, no redirect is built from Host, adapter names may not be the base
  model's nor hold bidi/control characters.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from lora_adapters import make_adapter
from serving import free_port, serve_in_thread

BODY_TIMEOUT_S = 4.0  # long enough to open 130 connections and serve one request on a loaded machine
SLOW_CLIENTS = 130  # over the default --max-concurrent-requests (128)


@dataclass
class SecServer:
    url: str
    port: int
    state: Any
    allowed: Path


@pytest.fixture(scope="module")
def sec(tiny_model_factory, tmp_path_factory) -> Iterator[SecServer]:  # type: ignore[no-untyped-def]

    from server.api.app import create_app
    from server.api.server import uvicorn_config
    from server.api.state import ServerState
    from server.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, ServerConfig
    from server.engine import LLMEngine

    base = tiny_model_factory("qwen2", tie=False, heads=4, kv_heads=2)
    allowed = tmp_path_factory.mktemp("sec2") / "allowed"
    make_adapter(base, allowed / "good", 4, ("q_proj",), seed=1)
    engine_cfg = EngineConfig(
        model=ModelConfig(model=str(base), dtype="float32", served_model_name="tiny"),
        cache=CacheConfig(block_size=8, num_kv_blocks=64),
        num_threads=1,
        lora=LoRAConfig(
            enable_lora=True,
            max_lora_rank=8,
            max_cpu_loras=4,
            allow_runtime_updating=True,
            allowed_paths=(str(allowed),),
        ),
    )
    llm = LLMEngine(engine_cfg)
    port = free_port()
    config = ServerConfig(
        engine=engine_cfg,
        host="127.0.0.1",
        port=port,
        max_total_tokens=128,
        timeout_request_body_s=BODY_TIMEOUT_S,
    )
    assert config.max_concurrent_requests < SLOW_CLIENTS
    state = ServerState(config, engine_factory=lambda: llm)
    running = serve_in_thread(
        create_app(state), port, make_config=lambda app: uvicorn_config(app, config), name="api-sec2-server"
    )
    url = running.url
    yield SecServer(url, port, state, allowed)
    running.stop()


def _message(r: httpx.Response) -> str:
    """The error message in either route family's shape (TGI: a string; OpenAI: an object)."""
    error = r.json()["error"]
    return error if isinstance(error, str) else error["message"]


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket timeout: it never did)."""
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


# ---- item 1: slow bodies ----------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
def test_slow_bodies_do_not_lock_out_other_clients(sec: SecServer, path: str) -> None:
    socks: list[socket.socket] = []
    try:
        for _ in range(SLOW_CLIENTS):
            s = socket.create_connection(("127.0.0.1", sec.port), timeout=60)
            s.sendall(
                f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                "Content-Length: 100\r\n\r\n{".encode()
            )  # one byte of a 100-byte body, then nothing
            socks.append(s)
        threading.Event().wait(0.5)  # the server has parsed their heads (and, before the fix, admitted them)
        body = (
            {"model": "tiny", "prompt": "hello", "max_tokens": 2, "temperature": 0}
            if path == "/v1/completions"
            else {"inputs": "hello", "parameters": {"max_new_tokens": 2}}
        )
        r = httpx.post(sec.url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        for s in socks:
            data = _read_until_closed(s)  # raises socket.timeout if the server keeps it open
            assert data.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), data[:200]
    finally:
        for s in socks:
            s.close()
    assert sec.state.in_flight == 0
    assert httpx.get(f"{sec.url}/health", timeout=10).status_code == 200


def test_body_timeout_closes_a_connection_whose_route_answered_early(sec: SecServer) -> None:
    """A route that answers without reading the body (here a 404) does not keep a trickling body's
    connection open past the deadline."""
    s = socket.create_connection(("127.0.0.1", sec.port), timeout=60)
    try:
        s.sendall(b"POST /no-such-route HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{")
        data = _read_until_closed(s)
        assert data.startswith(b"HTTP/1.1 404 "), data[:200]
        assert b"408 Request Timeout" not in data  # no second response after the first
    finally:
        s.close()


def test_request_limit_flags() -> None:
    from server.cli import build_parser, config_from_args
    from server.config import ServerConfig

    env = {
        "KUBEINFER_TIMEOUT_REQUEST_BODY": "12.5",
        "KUBEINFER_LIMIT_CONCURRENCY": "300",
        "KUBEINFER_LIMIT_CONCURRENCY_PER_CLIENT": "40",
    }
    cfg = config_from_args(build_parser(env).parse_args([]))
    assert (cfg.timeout_request_body_s, cfg.limit_concurrency, cfg.limit_concurrency_per_client) == (
        12.5,
        300,
        40,
    )
    default = config_from_args(build_parser({}).parse_args([]))
    assert (
        default.timeout_request_body_s,
        default.limit_concurrency,
        default.limit_concurrency_per_client,
    ) == (
        60.0,
        1024,
        256,
    )
    for bad in (
        {"timeout_request_body_s": 0.0},
        {"limit_concurrency": 0},
        {"limit_concurrency_per_client": 0},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerConfig(**bad)  # type: ignore[arg-type]


def _connect_from(source: str, port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(30)
    s.bind((source, 0))  # Linux answers for all of 127.0.0.0/8: distinct client addresses on loopback
    s.connect(("127.0.0.1", port))
    return s


def _get(s: socket.socket) -> bytes:
    s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    data = b""
    while not data.endswith(b"ok"):
        chunk = s.recv(4096)
        assert chunk, data
        data += chunk
    return data


def test_connection_caps_refuse_at_accept() -> None:
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from server.api.limits import ConnectionCaps, with_head_timeout

    async def app(scope: Any, receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    port = free_port()
    caps = ConnectionCaps(total_limit=5, per_client_limit=3)
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_config=None,
        lifespan="off",
        http=with_head_timeout(AutoHTTPProtocol, 30.0, 30.0, caps),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    held: list[socket.socket] = []
    try:
        deadline = 2400
        while not server.started and deadline:
            threading.Event().wait(0.05)
            deadline -= 1
        for _ in range(3):
            held.append(_connect_from("127.0.0.1", port))
            assert _get(held[-1]).startswith(b"HTTP/1.1 200 ")
        refused = _connect_from("127.0.0.1", port)  # a 4th from the same address
        assert _read_until_closed(refused).startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
        refused.close()
        for _ in range(2):
            held.append(_connect_from("127.0.0.2", port))
            assert _get(held[-1]).startswith(b"HTTP/1.1 200 ")
        refused = _connect_from("127.0.0.3", port)  # a 6th in total
        assert _read_until_closed(refused).startswith(b"HTTP/1.1 503 ")
        refused.close()
        held.pop(0).close()  # a slot frees when a connection closes
        deadline = 200
        while caps.total > 4 and deadline:
            threading.Event().wait(0.05)
            deadline -= 1
        held.append(_connect_from("127.0.0.3", port))
        assert _get(held[-1]).startswith(b"HTTP/1.1 200 ")
    finally:
        for s in held:
            s.close()
        server.should_exit = True
        thread.join(10)


# ---- item 2: browsers driving a loopback server ------------------------------------------------------
@pytest.mark.parametrize(
    "headers",
    [
        {"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"},
        {"Origin": "http://evil.example"},  # an older browser without Fetch Metadata
        {"Sec-Fetch-Site": "cross-site"},
        {"Origin": "null"},  # a sandboxed frame or a data: page
        {"Origin": "http://127.0.0.1:1"},  # another port is another origin
    ],
)
@pytest.mark.parametrize("path", ["/reset_prefix_cache", "/flush_cache", "/v1/load_lora_adapter"])
def test_management_routes_refuse_cross_site(sec: SecServer, path: str, headers: dict[str, str]) -> None:
    """A page's no-preflight POST (text/plain) to a keyless loopback server's management route: 403."""
    r = httpx.post(
        sec.url + path,
        content=b'{"lora_name": "x", "lora_path": "/tmp"}',
        headers={"Content-Type": "text/plain", **headers},
        timeout=30,
    )
    assert r.status_code == 403, r.text
    assert "cross-" in _message(r)


def test_management_routes_serve_same_origin_and_non_browsers(sec: SecServer) -> None:
    for headers in (
        {},  # curl, the operator
        {"Origin": sec.url, "Sec-Fetch-Site": "same-origin"},  # the playground
        {"Sec-Fetch-Site": "none"},  # typed into the address bar
    ):
        r = httpx.post(sec.url + "/reset_prefix_cache", headers=headers, timeout=30)
        assert r.status_code == 200, (headers, r.text)


@pytest.mark.parametrize(
    "host", ["evil.example", "evil.example:{port}", "127.0.0.1.nip.io:{port}", "0.0.0.0:{port}"]
)
def test_loopback_server_refuses_other_host_names(sec: SecServer, host: str) -> None:
    """DNS rebinding: a page whose name now resolves to 127.0.0.1 calls the server as same-origin."""
    host = host.format(port=sec.port)
    r = httpx.get(sec.url + "/v1/models", headers={"Host": host}, timeout=30)
    assert r.status_code == 403, r.text
    assert "Invalid Host header" in _message(r)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 1}
    r = httpx.post(sec.url + "/v1/completions", json=body, headers={"Host": host, "Origin": f"http://{host}"})
    assert r.status_code == 403, r.text
    r = httpx.post(sec.url + "/generate", json={"inputs": "hi"}, headers={"Host": host}, timeout=30)
    assert r.status_code == 403 and "Invalid Host header" in r.json()["error"], r.text  # TGI's shape


@pytest.mark.parametrize(
    "host", ["localhost:{port}", "127.0.0.1:{port}", "[::1]:{port}", "LOCALHOST", "127.0.0.2"]
)
def test_loopback_server_serves_loopback_host_names(sec: SecServer, host: str) -> None:
    r = httpx.get(sec.url + "/v1/models", headers={"Host": host.format(port=sec.port)}, timeout=30)
    assert r.status_code == 200, r.text


def test_host_check_only_on_a_loopback_bind() -> None:
    from server.api.admin import host_refusal

    scope = {"headers": [(b"host", b"my-model.default.svc.cluster.local:8080")]}
    assert host_refusal(scope, bound_to_loopback=False) is None
    assert host_refusal(scope, bound_to_loopback=True) is not None


# ---- item 3: small leaks and confusions ----------------------------------------------------------
def _load(sec: SecServer, name: str, folder: str = "good") -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(sec.allowed / folder)}
    return httpx.post(sec.url + "/v1/load_lora_adapter", json=body, timeout=60)


def test_models_list_shows_no_server_paths(sec: SecServer) -> None:
    """Only a caller who may manage adapters sees their folders (the operator's sync compares them);
    on this keyless loopback server that is a local non-browser client, not a cross-site page (CORS
    lets any page read /v1/models) nor, by the same rule, anyone on a keyless non-loopback server."""
    r = _load(sec, "listed")
    assert r.status_code == 200, r.text
    try:
        for headers in ({"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"}):
            models = httpx.get(sec.url + "/v1/models", headers=headers, timeout=30)
            assert models.status_code == 200
            entry = next(m for m in models.json()["data"] if m["id"] == "listed")
            assert entry["parent"] == "tiny" and entry["object"] == "model" and "max_model_len" in entry
            assert str(sec.allowed) not in models.text and entry["root"] == "listed", entry
        local = httpx.get(sec.url + "/v1/models", timeout=30).json()["data"]
        assert next(m for m in local if m["id"] == "listed")["root"] == str(sec.allowed / "good")
    finally:
        httpx.post(sec.url + "/v1/unload_lora_adapter", json={"lora_name": "listed"}, timeout=30)


def test_models_root_for_managers_only() -> None:
    """The rule /v1/models applies (server/api/openai.py): keyless non-loopback servers manage nothing."""
    from server.api.admin import ManagementGuard

    scope: dict[str, Any] = {"headers": []}
    assert ManagementGuard(None, None, "0.0.0.0").refusal(scope) is not None
    assert ManagementGuard(None, "adm", "0.0.0.0").refusal(scope) is not None
    assert (
        ManagementGuard(None, "adm", "0.0.0.0").refusal({"headers": [(b"authorization", b"Bearer adm")]})
        is None
    )


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost:1"])
def test_no_redirect_built_from_host(sec: SecServer, host: str) -> None:
    r = httpx.get(sec.url + "/v1/models/", headers={"Host": host}, timeout=30, follow_redirects=False)
    assert r.status_code == 404, (r.status_code, r.headers)
    assert "location" not in r.headers


@pytest.mark.parametrize(
    "name",
    [
        "tiny",  # the base model's served name
        "good\u202eexe.txt",  # a right-to-left override: displays as "goodtxt.exe"
        "ti\u200bny",  # a zero-width space: displays as the base model's name
        "a\u2066b",  # a bidi isolate
        "a\u0085b",  # a C1 control (NEL)
        "a\u2028b",  # a line separator
    ],
)
def test_adapter_names_refused(sec: SecServer, name: str) -> None:
    r = _load(sec, name)
    try:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "lora_name", r.text
    finally:
        if r.status_code == 200:
            httpx.post(sec.url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30)
    assert name not in [m["id"] for m in httpx.get(sec.url + "/v1/models", timeout=30).json()["data"][1:]]
