"""The management routes (LoRA load/unload, prefix-cache flush) over real HTTP: never open to the
network without a credential, the admin key opens them, generation stays as --api-key says.

The servers' models never load: a request the guard lets through reaches its route and gets the
route's 503 ("still loading"); one it refuses gets 401/403 from the guard before any route runs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serving import free_port, serve_in_thread

MANAGEMENT = [
    ("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/tmp"}),
    ("/v1/unload_lora_adapter", {"lora_name": "sql"}),
    ("/flush_cache", {}),
    ("/reset_prefix_cache", {}),
]
ADMIN = "admin-token-123"
USER = "user-key-456"


def _serve(**config: Any) -> Iterator[str]:
    """A server whose config says `config` (host defaults to the pods' 0.0.0.0), bound to 127.0.0.1."""

    from server.api.app import create_app
    from server.api.state import ServerState
    from server.config import EngineConfig, LoRAConfig, ServerConfig

    port = free_port()
    engine = EngineConfig(lora=LoRAConfig(enable_lora=True, allow_runtime_updating=True))
    cfg = ServerConfig(**{"engine": engine, "host": "0.0.0.0", "port": port, **config})
    app = create_app(ServerState(cfg), load_on_startup=False)
    running = serve_in_thread(app, port, until="listening")
    yield running.url
    running.stop(timeout_s=10)


@pytest.fixture(scope="module")
def open_server() -> Iterator[str]:
    """No key at all, listening on every address: what a model with adapters and no apiKeySecretRef ran."""
    yield from _serve()


@pytest.fixture(scope="module")
def admin_server() -> Iterator[str]:
    yield from _serve(admin_api_key=ADMIN)


@pytest.fixture(scope="module")
def both_keys_server() -> Iterator[str]:
    yield from _serve(admin_api_key=ADMIN, api_key=USER)


@pytest.fixture(scope="module")
def local_server() -> Iterator[str]:
    yield from _serve(host="127.0.0.1")


def _post(url: str, path: str, body: dict[str, Any], token: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=10)


@pytest.mark.parametrize(("path", "body"), MANAGEMENT)
def test_api_management_refused_without_any_key(open_server: str, path: str, body: dict[str, Any]) -> None:
    r = _post(open_server, path, body)
    assert r.status_code == 403, r.text
    assert "--admin-api-key" in r.text
    # generation stays open (it reaches the route, which is still loading)
    assert _post(open_server, "/v1/completions", {"prompt": "hi"}).status_code == 503


@pytest.mark.parametrize(("path", "body"), MANAGEMENT)
def test_api_management_needs_the_admin_key(admin_server: str, path: str, body: dict[str, Any]) -> None:
    for token in (None, "wrong", ADMIN + "x"):
        r = _post(admin_server, path, body, token)
        assert r.status_code == 401, (token, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
    assert _post(admin_server, path, body, ADMIN).status_code == 503  # let through to the route
    # the admin key alone does not close generation (no --api-key set)
    assert _post(admin_server, "/v1/completions", {"prompt": "hi"}).status_code == 503


def test_api_user_key_is_no_admin_key(both_keys_server: str) -> None:
    url = both_keys_server
    for path, body in MANAGEMENT:
        assert _post(url, path, body, USER).status_code == 401
        assert _post(url, path, body, ADMIN).status_code == 503
    # generation: the users' key or the admin key (the operator reads /v1/models with it)
    assert _post(url, "/v1/completions", {"prompt": "hi"}).status_code == 401
    assert _post(url, "/v1/completions", {"prompt": "hi"}, USER).status_code == 503
    assert _post(url, "/v1/completions", {"prompt": "hi"}, ADMIN).status_code == 503
    r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    assert r.status_code != 401


def test_api_management_open_on_loopback_for_development(local_server: str) -> None:
    for path, body in MANAGEMENT:
        assert _post(local_server, path, body).status_code == 503


def test_api_admin_key_flag_and_env() -> None:
    from server.cli import build_parser, config_from_args

    args = build_parser({"KUBEINFER_ADMIN_API_KEY": "from-env"}).parse_args([])
    assert config_from_args(args).admin_api_key == "from-env"
    args = build_parser({}).parse_args(["--admin-api-key", "zq-secret-zq"])
    cfg = config_from_args(args)
    assert cfg.admin_api_key == "zq-secret-zq" and "zq-secret-zq" not in repr(cfg)


def test_api_operator_client_gets_through_with_the_models_admin_key(admin_server: str) -> None:
    """The operator's own HTTP client (adapter_sync.UrllibPodHTTP) against the real server."""
    from kubeinfer_operator.adapter_sync import UrllibPodHTTP

    body = {"lora_name": "sql", "lora_path": "/tmp"}
    refused = UrllibPodHTTP().post(f"{admin_server}/v1/load_lora_adapter", body, 10)
    assert refused.status == 401
    reached = UrllibPodHTTP(ADMIN).post(f"{admin_server}/v1/load_lora_adapter", body, 10)
    assert reached.status == 503 and "loading" in str(reached.body)  # the route itself answered
