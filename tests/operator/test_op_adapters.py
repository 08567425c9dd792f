"""spec.adapters changes reach running pods without a rollout: the operator calls the server's run-time
LoRA routes on each ready pod (a real HTTP server on a local port stands in for the pod, speaking
vLLM's /v1/models, /v1/load_lora_adapter and /v1/unload_lora_adapter), the pod template stays the same,
and status.adapters lists what the pods serve."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from kubeinfer_operator import adapter_sync
from kubeinfer_operator.adapter_sync import AdapterSyncResult, PodAdapters, sync_pods
from kubeinfer_operator.credentials import ADMIN_KEY_ENV as ADMIN_ENV
from kubeinfer_operator.render import MODEL_ANNOTATION
from kubeinfer_operator.spec import InferenceModel
from op_cluster import MockCluster, wait_for
from op_testlib import inference_model

NAME = "llm"
HF = {"uri": "hf://org/model"}


class FakePod:
    """The server's LoRA routes as vLLM answers them, on a real port; adapters start from LORA_MODULES."""

    def __init__(self, lora_modules: str = "", missing: frozenset[str] = frozenset()) -> None:
        self.adapters: dict[str, str] = dict(m.split("=", 1) for m in lora_modules.split())
        self.missing = missing  # paths with no adapter (the server answers 404)
        self.missing_message: str | None = None  # that 404's message, if not vLLM's
        self.calls: list[tuple[str, str]] = []
        self.token: str | None = None  # the admin API key the pod requires (None: none)
        self.authorizations: list[str | None] = []  # the Authorization header of each request
        pod = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, status: int, body: Any) -> None:
                raw = (json.dumps(body) if not isinstance(body, str) else body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _refused(self) -> bool:
                auth = self.headers.get("Authorization")
                pod.authorizations.append(auth)
                if pod.token is not None and auth != f"Bearer {pod.token}":
                    self._reply(401, {"error": {"message": "Unauthorized"}})
                    return True
                return False

            def do_GET(self) -> None:
                if self._refused():
                    return
                if self.path != "/v1/models":
                    return self._reply(404, {"error": {"message": "not found"}})
                base = {"object": "model", "id": "org/model", "root": "org/model", "parent": None}
                data = [base] + [
                    {"object": "model", "id": n, "root": p, "parent": "org/model"}
                    for n, p in pod.adapters.items()
                ]
                self._reply(200, {"object": "list", "data": data})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self._refused():
                    return
                name = body.get("lora_name")
                pod.calls.append((self.path, name))
                if self.path == "/v1/load_lora_adapter":
                    if name in pod.adapters:
                        return self._reply(
                            400, {"error": {"message": f"The lora adapter '{name}' has already been loaded."}}
                        )
                    if body["lora_path"] in pod.missing:
                        message = pod.missing_message or f"No adapter found for {body['lora_path']}"
                        return self._reply(404, {"error": {"message": message}})
                    pod.adapters[name] = body["lora_path"]
                    return self._reply(200, f"Success: LoRA adapter '{name}' added successfully.")
                if self.path == "/v1/unload_lora_adapter":
                    if pod.adapters.pop(name, None) is None:
                        return self._reply(
                            404, {"error": {"message": f"The lora adapter '{name}' cannot be found."}}
                        )
                    return self._reply(200, f"Success: LoRA adapter '{name}' removed successfully.")
                self._reply(404, {"error": {"message": "not found"}})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_pod(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakePod]:
    pod = FakePod()
    monkeypatch.setattr(adapter_sync, "POD_PORT", pod.port)
    yield pod
    pod.close()


def pod_from(deployment: dict[str, Any], name: str = "llm-7d4b9-x2x4q", ready: bool = True) -> dict[str, Any]:
    """Play the ReplicaSet controller and the kubelet: a running pod of the Deployment's template."""
    template = deployment["spec"]["template"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": dict(template["metadata"]["labels"]),
            "annotations": dict(template["metadata"]["annotations"]),
        },
        "spec": template["spec"],
        "status": {
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def adapters(*names: str) -> list[dict[str, str]]:
    return [{"name": n, "uri": f"/adapters/{n}"} for n in names]


# ---------------------------------------------------------------- sync against one pod


def test_sync_loads_unloads_and_reads_back(fake_pod: FakePod) -> None:
    fake_pod.adapters = {"a": "/adapters/a", "old": "/adapters/old", "moved": "/adapters/elsewhere"}
    doc = inference_model(
        {"model": HF, "adapters": [*adapters("a", "b"), {"name": "moved", "uri": "/adapters/moved"}]}
    )
    im = InferenceModel.from_manifest(doc)
    from kubeinfer_operator.render import render_deployment

    pod = pod_from(render_deployment(im))
    result = sync_pods(im, [pod])
    assert result.errors == []
    assert result.pods == [
        PodAdapters("llm-7d4b9-x2x4q", ("a", "b", "moved"), ("b", "moved"), ("old", "moved"))
    ]
    assert fake_pod.adapters == {"a": "/adapters/a", "b": "/adapters/b", "moved": "/adapters/moved"}
    # in line now: only /v1/models is read
    fake_pod.calls.clear()
    assert sync_pods(im, [pod]).served == ["a", "b", "moved"] and fake_pod.calls == []
    # a pod not ready, or of a template without the run-time routes, is left alone
    assert sync_pods(im, [pod_from(render_deployment(im), ready=False)]).pods == []
    keyed = InferenceModel.from_manifest(
        inference_model({**doc["spec"], "engine": {"apiKeySecretRef": {"name": "k", "key": "v"}}})
    )
    assert sync_pods(keyed, [pod]) == AdapterSyncResult()


def test_sync_reports_a_bad_adapter_and_serves_the_rest(fake_pod: FakePod) -> None:
    fake_pod.missing = frozenset({"/adapters/gone"})
    im = InferenceModel.from_manifest(inference_model({"model": HF, "adapters": adapters("a", "gone")}))
    from kubeinfer_operator.render import render_deployment

    result = sync_pods(im, [pod_from(render_deployment(im))])
    assert result.served == ["a"]
    (error,) = result.errors
    assert "loading adapter gone from /adapters/gone: HTTP 404: No adapter found" in error


def test_hub_adapters_match_their_cache_snapshot(fake_pod: FakePod) -> None:
    snapshot = "/var/cache/kubeinfer/hub/models--org--sql-lora/snapshots/0123abcd"
    fake_pod.adapters = {"sql": snapshot}
    im = InferenceModel.from_manifest(
        inference_model({"model": HF, "adapters": [{"name": "sql", "uri": "hf://org/sql-lora"}]})
    )
    from kubeinfer_operator.render import render_deployment

    assert sync_pods(im, [pod_from(render_deployment(im))]).served == ["sql"]
    assert fake_pod.calls == []  # the same repo: not reloaded


def test_unreachable_pod_is_an_error_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    pod = FakePod()
    pod.close()  # nothing listens on that port any more
    monkeypatch.setattr(adapter_sync, "POD_PORT", pod.port)
    im = InferenceModel.from_manifest(inference_model({"model": HF, "adapters": adapters("a")}))
    from kubeinfer_operator.render import render_deployment

    result = sync_pods(im, [pod_from(render_deployment(im))])
    assert result.pods == [] and "GET /v1/models: no answer" in result.errors[0]


class Redirector:
    """A pod that answers every request with a redirect to `target`, and a "metadata service"
    stand-in at `target` that records every request and answers with something secret."""

    SECRET = "AKIA-SECRET-CREDENTIAL-" + "x" * 500

    def __init__(self, status: int = 302) -> None:
        self.metadata_hits: list[str] = []
        outer = self

        class Metadata(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self) -> None:
                outer.metadata_hits.append(self.path)
                raw = json.dumps({"data": [], "error": outer.SECRET}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            do_GET = do_POST = _answer

        self.metadata = ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
        target = f"http://127.0.0.1:{self.metadata.server_address[1]}/latest/meta-data/iam"

        class Pod(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _redirect(self) -> None:
                raw = f"moved to {target} {outer.SECRET}".encode()
                self.send_response(status)
                self.send_header("Location", target)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            do_GET = do_POST = _redirect

        self.pod = ThreadingHTTPServer(("127.0.0.1", 0), Pod)
        self.port = self.pod.server_address[1]
        for s in (self.metadata, self.pod):
            threading.Thread(target=s.serve_forever, daemon=True).start()

    def close(self) -> None:
        for s in (self.metadata, self.pod):
            s.shutdown()
            s.server_close()


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_sync_follows_no_redirect_and_repeats_none_of_it(
    monkeypatch: pytest.MonkeyPatch, status: int
) -> None:
    redirector = Redirector(status)
    monkeypatch.setattr(adapter_sync, "POD_PORT", redirector.port)
    try:
        im = InferenceModel.from_manifest(inference_model({"model": HF, "adapters": adapters("a")}))
        from kubeinfer_operator.render import render_deployment

        result = sync_pods(im, [pod_from(render_deployment(im))])
    finally:
        redirector.close()
    assert redirector.metadata_hits == []
    assert result.pods == [] and len(result.errors) == 1
    (error,) = result.errors
    assert f"HTTP {status}: a redirect, refused" in error
    assert "SECRET" not in error and "meta-data" not in error


def test_sync_error_lines_are_short_and_printable(fake_pod: FakePod) -> None:
    """A pod's answer reaches an Event through these lines: a bounded, printable excerpt only."""
    fake_pod.missing = frozenset({"/adapters/a"})
    fake_pod.missing_message = "\x1b[31mred\x00\u202e" + "y" * 10_000
    im = InferenceModel.from_manifest(inference_model({"model": HF, "adapters": adapters("a")}))
    from kubeinfer_operator.render import render_deployment

    (error,) = sync_pods(im, [pod_from(render_deployment(im))]).errors
    reply = error.split("HTTP 404: ", 1)[1]
    assert len(reply) <= adapter_sync.MAX_EXCERPT_CHARS and reply.endswith("...")
    assert all(" " <= c <= "~" for c in error), error


def test_sync_sends_the_models_admin_key(fake_pod: FakePod) -> None:
    fake_pod.token = "the-admin-key"
    im = InferenceModel.from_manifest(inference_model({"model": HF, "adapters": adapters("a")}))
    from kubeinfer_operator.render import render_deployment

    pod = pod_from(render_deployment(im))
    refused = sync_pods(im, [pod])
    assert refused.pods == [] and "HTTP 401" in refused.errors[0]
    result = sync_pods(im, [pod], token="the-admin-key")
    assert result.errors == [] and result.served == ["a"]
    assert set(fake_pod.authorizations[1:]) == {"Bearer the-admin-key"}


# ---------------------------------------------------------------- the operator against kmock


def test_adapter_changes_reach_running_pods_without_a_rollout(
    cluster: MockCluster, operator: Any, fake_pod: FakePod
) -> None:
    cluster.create(
        "InferenceModel", inference_model({"model": HF, "adapters": adapters("a", "b")}, name=NAME)
    )
    dep = wait_for(lambda: cluster.get("Deployment", NAME), what="Deployment")
    cm = wait_for(lambda: cluster.get("ConfigMap", f"{NAME}-adapters"), what="ConfigMap")
    assert cm["data"]["LORA_MODULES"] == "a=/adapters/a b=/adapters/b"
    # the pod starts with the list the kubelet resolves from the ConfigMap, and requires the admin
    # key the kubelet resolves from the Secret the operator created
    fake_pod.adapters = dict(m.split("=", 1) for m in cm["data"]["LORA_MODULES"].split())
    (admin,) = [e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"] if e["name"] == ADMIN_ENV]
    ref = admin["valueFrom"]["secretKeyRef"]
    secret = cluster.get("Secret", ref["name"])
    assert secret is not None and secret["metadata"]["ownerReferences"][0]["name"] == NAME
    fake_pod.token = base64.b64decode(secret["data"][ref["key"]]).decode()
    assert len(fake_pod.token) == 64
    pod = pod_from(dep)
    pod["metadata"]["annotations"][MODEL_ANNOTATION] = NAME
    cluster.create("Pod", pod)

    def status() -> dict[str, Any]:
        return dict((cluster.get("InferenceModel", NAME) or {}).get("status") or {})

    wait_for(lambda: status().get("adapters") == ["a", "b"], what="status.adapters [a, b]")
    assert status()["adapterCount"] == 2 and fake_pod.calls == []
    template_before = cluster.get("Deployment", NAME)["spec"]["template"]  # type: ignore[index]

    cluster.patch("InferenceModel", NAME, {"spec": {"adapters": adapters("a", "c")}})
    wait_for(lambda: status().get("adapters") == ["a", "c"], what="status.adapters [a, c]")
    assert ("/v1/unload_lora_adapter", "b") in fake_pod.calls and (
        "/v1/load_lora_adapter",
        "c",
    ) in fake_pod.calls
    assert fake_pod.adapters == {"a": "/adapters/a", "c": "/adapters/c"}
    wait_for(
        lambda: (
            (cluster.get("ConfigMap", f"{NAME}-adapters") or {}).get("data", {}).get("LORA_MODULES")
            == "a=/adapters/a c=/adapters/c"
        ),
        what="ConfigMap [a, c]",
    )
    # no rollout: every stored version of the Deployment has the same pod template
    assert all(v["spec"]["template"] == template_before for v in cluster.history("Deployment", NAME))

    # the last adapter removed: LoRA off again, which is a rollout, and the ConfigMap goes
    cluster.patch("InferenceModel", NAME, {"spec": {"adapters": []}})
    wait_for(lambda: cluster.get("ConfigMap", f"{NAME}-adapters") is None, what="ConfigMap deleted")
    dep = wait_for(
        lambda: (
            (d := cluster.get("Deployment", NAME))
            and "--enable-lora" not in d["spec"]["template"]["spec"]["containers"][0]["args"]
            and d
        ),
        what="Deployment without LoRA",
    )
    wait_for(lambda: status().get("adapterCount") == 0, what="adapterCount 0")


def test_rendered_documents_carry_the_admin_secret_the_pods_read() -> None:
    """`kubeinfer-operator render` output is complete: the Secret the pods' admin key comes from."""
    from kubeinfer_operator.__main__ import render_documents
    from kubeinfer_operator.render import Capabilities

    doc = inference_model({"model": HF, "adapters": adapters("a")}, name=NAME)
    doc["metadata"]["uid"] = "0c7d5e4a-1111-4222-8333-944445555666"
    objects = render_documents([doc], Capabilities())
    (secret,) = [o for o in objects if o["kind"] == "Secret"]
    (dep,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == NAME]
    (env,) = [e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"] if e["name"] == ADMIN_ENV]
    assert env["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]
    assert secret["immutable"] is True and secret["metadata"]["ownerReferences"][0]["name"] == NAME
    # a model without adapters gets no key: its management routes stay closed (403)
    plain = render_documents([inference_model({"model": HF}, name=NAME)], Capabilities())
    assert not [o for o in plain if o["kind"] == "Secret"]
