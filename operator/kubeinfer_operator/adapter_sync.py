"""Brings the adapters served by running pods in line with `spec.adapters`, through the server's run-time
routes (vLLM's): `GET /v1/models` (adapters are the entries with a `parent`), `POST /v1/load_lora_adapter`
`{"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter` `{"lora_name"}`. The only module that
talks HTTP to pods; the client is injectable (`PodHTTP`) so tests point it at a real local server.

Only ready pods started with `--allow-runtime-lora-updating` are touched: a pod of an older template
(e.g. still without LoRA during the rolling update that enables it) gets the list from the ConfigMap
when it is replaced. What each pod serves afterwards is read back from its `/v1/models`.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Protocol

from .adapters import desired_adapters, runtime_updates
from .common import CONTAINER_NAME, SERVER_PORT
from .spec import InferenceModel

RUNTIME_FLAG = "--allow-runtime-lora-updating"
TIMEOUT_SECONDS = 10.0
# a load reads the adapter (and may fetch it from the hub) before answering; a timeout is no failure:
# the pod finishes the load and the next status refresh reads it back
LOAD_TIMEOUT_SECONDS = 60.0
POD_PORT = SERVER_PORT  # the server's port on each pod IP (tests point it at a local stand-in)
# /v1/models of a pod with many adapters fits; a pod cannot make the operator read more
MAX_REPLY_BYTES = 1 << 20
# what of a pod's answer reaches an error line (a log line, then an Event on the InferenceModel)
MAX_EXCERPT_CHARS = 120


@dataclass(frozen=True)
class HTTPReply:
    status: int  # 0 = no answer (connection refused, timeout)
    body: Any  # parsed JSON, the text when not JSON, or the error when no answer


class PodHTTP(Protocol):
    def get(self, url: str, timeout: float) -> HTTPReply: ...

    def post(self, url: str, body: dict[str, Any], timeout: float) -> HTTPReply: ...


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is an answer, never followed: a pod (anyone who can run one at that IP) must not
    send the operator to another address, such as a cloud metadata service."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


class UrllibPodHTTP:
    """The default client (the standard library: the operator image needs nothing more). Sends the
    model's admin API key (credentials.py) when given; follows no redirect and reads at most
    MAX_REPLY_BYTES of an answer."""

    def __init__(self, token: str | None = None) -> None:
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._opener = urllib.request.build_opener(_NoRedirect())

    def _send(self, req: urllib.request.Request, timeout: float) -> HTTPReply:
        for name, value in self._headers.items():
            req.add_header(name, value)
        try:
            with self._opener.open(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read(MAX_REPLY_BYTES)
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read(MAX_REPLY_BYTES)
        except (OSError, ValueError) as e:
            return HTTPReply(0, str(e))
        text = raw.decode("utf-8", "replace")
        try:
            return HTTPReply(status, json.loads(text))
        except ValueError:
            return HTTPReply(status, text)

    def get(self, url: str, timeout: float) -> HTTPReply:
        return self._send(urllib.request.Request(url, method="GET"), timeout)

    def post(self, url: str, body: dict[str, Any], timeout: float) -> HTTPReply:
        data = json.dumps(body).encode()
        req = urllib.request.Request(
            url, data=data, method="POST", headers={"Content-Type": "application/json"}
        )
        return self._send(req, timeout)


@dataclass(frozen=True)
class PodAdapters:
    pod: str
    served: tuple[str, ...]  # what /v1/models lists after the sync, sorted
    loaded: tuple[str, ...] = ()
    unloaded: tuple[str, ...] = ()


@dataclass
class AdapterSyncResult:
    pods: list[PodAdapters] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one line per failed call, with the pod's name

    @property
    def served(self) -> list[str]:
        """Adapters every synced pod serves (what a client can count on), sorted."""
        if not self.pods:
            return []
        common = set(self.pods[0].served)
        for p in self.pods[1:]:
            common &= set(p.served)
        return sorted(common)


def _ready(pod: dict[str, Any]) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def _runtime_enabled(pod: dict[str, Any]) -> bool:
    for c in (pod.get("spec") or {}).get("containers") or []:
        if c.get("name") == CONTAINER_NAME:
            return RUNTIME_FLAG in (c.get("args") or [])
    return False


def syncable_pods(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ready, not terminating, with an IP, and started with the run-time routes."""
    return [
        p
        for p in pods
        if not (p.get("metadata") or {}).get("deletionTimestamp")
        and (p.get("status") or {}).get("podIP")
        and _ready(p)
        and _runtime_enabled(p)
    ]


def _same_source(root: str, path: str) -> bool:
    """Whether a served adapter (its /v1/models `root`: the folder the server read) came from `path`:
    the same folder, or the hub cache's snapshot of the repo `path` names (`models--org--name`)."""
    if root == path:
        return True
    if re.fullmatch(r"[\w.-]+/[\w.-]+", path) and not path.startswith((".", "/")):
        return f"/models--{path.replace('/', '--')}/" in root
    return False


def _served(http: PodHTTP, base_url: str) -> dict[str, str] | HTTPReply:
    reply = http.get(f"{base_url}/v1/models", TIMEOUT_SECONDS)
    data = reply.body.get("data") if reply.status == 200 and isinstance(reply.body, dict) else None
    if not isinstance(data, list):
        return reply
    return {
        str(m.get("id")): str(m.get("root") or "") for m in data if isinstance(m, dict) and m.get("parent")
    }


def excerpt(value: Any, limit: int = MAX_EXCERPT_CHARS) -> str:
    """At most `limit` printable ASCII characters of `value` (others become '?', runs of whitespace
    one space), with "..." when cut: what a pod answers may be anything."""
    text = " ".join(str(value).split())
    text = "".join(c if " " <= c <= "~" else "?" for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(reply: HTTPReply) -> str:
    if 300 <= reply.status < 400:
        # the body and Location are the redirecting party's words: none of them is repeated
        return f"HTTP {reply.status}: a redirect, refused (the operator follows none)"
    body = reply.body
    if isinstance(body, dict):
        err = body.get("error")
        body = err.get("message") if isinstance(err, dict) else err or body.get("message") or body
    text = excerpt(body)
    return f"HTTP {reply.status}: {text}" if reply.status else f"no answer: {text}"


def sync_pods(
    im: InferenceModel,
    pods: list[dict[str, Any]],
    http: PodHTTP | None = None,
    token: str | None = None,
) -> AdapterSyncResult:
    """Load what each syncable pod lacks, unload what the spec no longer has (or has under another uri).
    `token`: the model's admin API key, sent by the default client."""
    result = AdapterSyncResult()
    if not runtime_updates(im):
        return result
    http = http or UrllibPodHTTP(token)
    want = desired_adapters(im)
    for pod in syncable_pods(pods):
        name = str((pod.get("metadata") or {}).get("name") or "?")
        url = f"http://{pod['status']['podIP']}:{POD_PORT}"
        before = _served(http, url)
        if isinstance(before, HTTPReply):
            result.errors.append(f"pod {name}: GET /v1/models: {_describe(before)}")
            continue
        stale = [n for n, root in before.items() if n not in want or not _same_source(root, want[n])]
        unloaded, loaded = [], []
        for n in stale:
            reply = http.post(f"{url}/v1/unload_lora_adapter", {"lora_name": n}, TIMEOUT_SECONDS)
            if reply.status in (200, 404):  # 404: gone already
                unloaded.append(n)
            else:
                result.errors.append(f"pod {name}: unloading adapter {n}: {_describe(reply)}")
        for n, path in want.items():
            if n in before and n not in unloaded:
                continue
            reply = http.post(
                f"{url}/v1/load_lora_adapter", {"lora_name": n, "lora_path": path}, LOAD_TIMEOUT_SECONDS
            )
            if reply.status == 200:
                loaded.append(n)
            else:
                result.errors.append(
                    f"pod {name}: loading adapter {n} from {excerpt(path)}: {_describe(reply)}"
                )
        after = _served(http, url) if (loaded or unloaded) else before
        if isinstance(after, HTTPReply):
            result.errors.append(f"pod {name}: GET /v1/models: {_describe(after)}")
            continue
        result.pods.append(PodAdapters(name, tuple(sorted(after)), tuple(loaded), tuple(unloaded)))
    return result
