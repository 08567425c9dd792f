"""Who may call the routes that change server state (the management routes).

Generation is guarded by the users' `--api-key` (open when none is set). The management routes
(loading and unloading LoRA adapters, flushing the prefix cache) never are open to the network:

- `--admin-api-key` set: only `Authorization: Bearer <admin key>` opens them (401 otherwise). The
  admin key opens every other route too, so the operator needs one credential per pod.
- else `--api-key` set: the users' key opens them (whoever holds it runs the server).
- neither: 403, unless the server listens on a loopback address only (`make serve` binds 127.0.0.1):
  nothing outside the machine can reach it then, so a developer needs no key.

The operator gives each InferenceModel's pods their own admin key (operator/kubeinfer_operator/
credentials.py) and sends it from its adapter sync.

Browsers reach loopback servers too: a web page can send a "simple" cross-origin POST (`Content-Type:
text/plain`, no preflight) to http://127.0.0.1:8080, or rebind its own DNS name to 127.0.0.1 and
call the server as same-origin. Two checks close both, keys or not:
- `cross_site_refusal`: the management routes refuse a request whose `Sec-Fetch-Site` is
  `cross-site` or `same-site` (Fetch Metadata, sent by every current browser) or whose `Origin` is
  not the request's own host (`null` included): 403. Clients other than browsers send neither header.
- `host_refusal`: a server bound to a loopback address answers only loopback Host names
  (`localhost`, 127.0.0.0/8, `[::1]`, any port); another name (a rebound DNS name) gets 403 on
  every route, as webpack-dev-server's and Vite's "Invalid Host header" and Jupyter's host check do.
  A server bound beyond loopback is reached by names we cannot know (Services, ingresses): no check.
The chat playground is same-origin and served by a loopback name locally, so it passes both.
"""

from __future__ import annotations

import hmac
import ipaddress

from starlette.types import Scope

from .errors import APIError, ErrorKind

# POST routes that change what the server serves or has cached (generation and the read-only
# /tokenize and /detokenize are not among them).
MANAGEMENT_PATHS = frozenset(
    {"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/flush_cache", "/reset_prefix_cache"}
)


def is_loopback(host: str) -> bool:
    """Whether a bind address reaches this machine only ("localhost", 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return bytes(value).decode("latin-1")
    return None


def _host_name(host: str) -> str:
    """The name part of a Host header or an Origin's authority ("[::1]:8080" -> "[::1]")."""
    if host.startswith("["):
        return host.partition("]")[0] + "]"
    return host.rpartition(":")[0] if ":" in host else host


def host_refusal(scope: Scope, bound_to_loopback: bool) -> APIError | None:
    """403 when a loopback-bound server is called by a Host name that is not loopback (DNS rebinding)."""
    if not bound_to_loopback:
        return None
    host = _header(scope, b"host")
    if host is None:
        return None  # HTTP/1.0 without Host: not a browser, which always sends one
    if is_loopback(_host_name(host.strip().lower())):
        return None
    return APIError(
        ErrorKind.FORBIDDEN,
        "Invalid Host header: a server listening on a loopback address answers only localhost, "
        "127.0.0.1 or [::1] (DNS rebinding protection)",
    )


def cross_site_refusal(scope: Scope) -> APIError | None:
    """403 when a browser sends a management request from another site or origin."""
    site = _header(scope, b"sec-fetch-site")
    if site is not None and site.strip().lower() in ("cross-site", "same-site"):
        return APIError(ErrorKind.FORBIDDEN, "management routes refuse cross-site requests (Sec-Fetch-Site)")
    origin = _header(scope, b"origin")
    if origin is None:
        return None
    host = (_header(scope, b"host") or "").strip().lower()
    _, sep, authority = origin.strip().lower().partition("://")
    if not sep or authority.rstrip("/") != host:
        return APIError(
            ErrorKind.FORBIDDEN, "management routes refuse cross-origin requests (Origin is not this host)"
        )
    return None


def bearer_token(scope: Scope) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header, or None."""
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer":
                return bytes(token.strip())
    return None


def matches(token: bytes | None, key: bytes | None) -> bool:
    return token is not None and key is not None and hmac.compare_digest(token, key)


class ManagementGuard:
    """Decides a management route's request from the configured keys and the bind address."""

    def __init__(self, api_key: str | None, admin_api_key: str | None, host: str) -> None:
        self._user = api_key.encode() if api_key else None
        self._admin = admin_api_key.encode() if admin_api_key else None
        self._local = is_loopback(host)

    def is_admin(self, token: bytes | None) -> bool:
        return matches(token, self._admin)

    def refusal(self, scope: Scope) -> APIError | None:
        """None when the request may go on, else the error it gets (401 or 403)."""
        token = bearer_token(scope)
        if self._admin is not None:
            if matches(token, self._admin):
                return None
            return APIError(
                ErrorKind.UNAUTHORIZED,
                "Unauthorized: this management route requires the admin API key (Authorization: Bearer)",
            )
        if self._user is not None:
            if matches(token, self._user):
                return None
            return APIError(
                ErrorKind.UNAUTHORIZED, "Unauthorized: a valid API key is required (Authorization: Bearer)"
            )
        if self._local:
            return None
        return APIError(
            ErrorKind.FORBIDDEN,
            "management routes are disabled: the server has no --admin-api-key (or --api-key) and "
            "listens beyond loopback",
        )
