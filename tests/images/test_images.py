"""The images `make images` built, run as a user's cluster runs them (issue 26).

- The CPU server image serves POST /generate to 20 concurrent clients with the args, env, user,
  read-only root filesystem and volumes the operator renders for the CPU example's pod
  (examples/cpu-smollm2.yaml), in a network namespace of its own, with its C++ kernels prebuilt for
  this CPU's x86-64 level and nothing compiled or downloaded.
- The router image, as a second container in that pod's network, routes a request to that server.
- The operator image runs `kubeinfer-operator` (its own ENTRYPOINT and CMD) against the test API server
  (kmock) and applies the CPU example's Deployment, naming the CPU server image.
Each skips, saying why, where buildah (or root) is missing or the image was not built (`make images`).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
import oci_run
from kubeinfer_operator import common, render
from kubeinfer_operator.defaults import ClusterDefaults
from kubeinfer_operator.routing import router_args
from kubeinfer_operator.spec import (
    DEFAULT_ROUTER_IMAGE,
    DEFAULT_SERVER_CPU_IMAGE,
    OPERATOR_IMAGE,
    InferenceModel,
)
from serving import free_port

from server import native

# Each test copies its image into a working container first (vfs: a full copy, minutes under load).
pytestmark = [pytest.mark.images, pytest.mark.slow, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]
CPU_EXAMPLE = REPO / "examples" / "cpu-smollm2.yaml"
CLIENT = [sys.executable, str(Path(__file__).with_name("http_client.py"))]
CONCURRENT_CLIENTS = 20
GENERATE = {"inputs": "What is Kubernetes?", "parameters": {"max_new_tokens": 16}}


def require_image(ref: str) -> None:
    if (why := oci_run.missing_prerequisite()) is not None:
        pytest.skip(why)
    if not oci_run.image_exists(ref):
        pytest.skip(f"image {ref} not built (make images)")


def cpu_model() -> InferenceModel:
    return InferenceModel.from_manifest(yaml.safe_load(CPU_EXAMPLE.read_text()))


def rendered_server_pod() -> tuple[dict[str, Any], dict[str, Any]]:
    """The CPU example's pod spec and server container, as the operator renders them."""
    pod = render.render_deployment(cpu_model(), ClusterDefaults())["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def pod_user(pod: dict[str, Any]) -> tuple[int, int]:
    sc = pod["securityContext"]
    return int(sc["runAsUser"]), int(sc["runAsGroup"])


def wait_in(container: oci_run.Container, url: str, timeout: float) -> None:
    done = oci_run.in_netns(container, [*CLIENT, "wait", url, str(timeout)], timeout + 30)
    assert done.returncode == 0, f"{done.stderr}\n--- container log:\n{container.log()[-4000:]}"


def post_in(container: oci_run.Container, url: str, body: object, n: int) -> list[dict[str, Any]]:
    done = oci_run.in_netns(container, [*CLIENT, "post", url, json.dumps(body), str(n)], 900)
    assert done.returncode == 0, f"{done.stderr}\n--- container log:\n{container.log()[-4000:]}"
    return list(json.loads(done.stdout))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[oci_run.Container]:
    pod, container = rendered_server_pod()
    require_image(container["image"])
    log = tmp_path_factory.mktemp("server") / "server.log"
    run = oci_run.run_container(
        container["image"], container, oci_run.pod_mounts(pod, container), log, run_as=pod_user(pod)
    )
    try:
        port = container["ports"][0]["containerPort"]
        wait_in(run, f"http://127.0.0.1:{port}{container['readinessProbe']['httpGet']['path']}", 420)
        yield run
    finally:
        run.stop()


def test_the_operator_renders_the_cpu_image_for_a_model_without_gpus() -> None:
    _, container = rendered_server_pod()
    assert container["image"] == DEFAULT_SERVER_CPU_IMAGE
    assert "nvidia.com/gpu" not in json.dumps(container["resources"])
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False


def test_cpu_server_image_serves_concurrent_generate_as_the_operator_runs_it(
    server: oci_run.Container,
) -> None:
    _, container = rendered_server_pod()
    port = container["ports"][0]["containerPort"]
    results = post_in(server, f"http://127.0.0.1:{port}/generate", GENERATE, CONCURRENT_CLIENTS)
    assert [r["status"] for r in results] == [200] * CONCURRENT_CLIENTS, results
    texts = [r["body"]["generated_text"] for r in results]
    assert all(isinstance(t, str) and t.strip() for t in texts), texts
    # Greedy decoding of one prompt: every client gets the same text, batched or not.
    assert len(set(texts)) == 1, texts
    assert server.running(), server.log()[-4000:]

    # Structured output on CPU (xgrammar), in the image built without triton (PRUNE_PACKAGES).
    constrained = {
        "inputs": "Is water wet?",
        "parameters": {"max_new_tokens": 8, "grammar": {"type": "regex", "value": "(yes|no)"}},
    }
    [result] = post_in(server, f"http://127.0.0.1:{port}/generate", constrained, 1)
    assert result["status"] == 200 and result["body"]["generated_text"] in ("yes", "no"), result

    # Run-time dispatch: the kernels prebuilt for this CPU's x86-64 level were loaded (the image has no
    # compiler), and nothing was compiled into the cache.
    log = server.log()
    level = next(v.march for v in native.VARIANTS if v.cpu_flags <= native.cpu_flags())
    for kernel in ("paged_decode", "cpu_fused", "qlinear"):
        assert f"/opt/kubeinfer/kernels/{level}/{kernel}-" in log, (kernel, level, log[-4000:])
    assert "building the" not in log, log[-4000:]


def test_router_image_routes_a_request_to_the_server(server: oci_run.Container, tmp_path: Path) -> None:
    require_image(DEFAULT_ROUTER_IMAGE)
    _, server_container = rendered_server_pod()
    server_port = server_container["ports"][0]["containerPort"]
    # The operator's router flags, with the pod-discovery ones replaced by the one server's address:
    # there is no Kubernetes API to discover pods from here.
    args = without_flags(
        router_args(cpu_model()),
        {"--service-discovery", "--selector", "--service-discovery-port", "--service-discovery-namespace"},
    )
    args += ["--worker-urls", f"http://127.0.0.1:{server_port}"]
    router_port = int(args[args.index("--port") + 1])
    container = {
        "name": "router",
        "args": args,
        "securityContext": common.restricted_container_security_context(),
    }
    run = oci_run.run_container(
        DEFAULT_ROUTER_IMAGE,
        container,
        [oci_run.Mount("/tmp", "emptyDir")],
        tmp_path / "router.log",
        network=server.netns,
    )
    try:
        wait_in(run, f"http://127.0.0.1:{router_port}/readiness", 300)
        body = {"model": "smollm2", "prompt": "Hello", "max_tokens": 8, "temperature": 0}
        [result] = post_in(run, f"http://127.0.0.1:{router_port}/v1/completions", body, 1)
        assert result["status"] == 200, (result, run.log()[-4000:])
        assert result["body"]["model"] == "smollm2"
        assert result["body"]["choices"][0]["text"], result
    finally:
        run.stop()


def without_flags(args: list[str], flags: set[str]) -> list[str]:
    """`args` less each flag in `flags` and the values that follow it (up to the next --flag)."""
    out: list[str] = []
    skipping = False
    for arg in args:
        if arg.startswith("--"):
            skipping = arg in flags
        if not skipping:
            out.append(arg)
    return out


def test_operator_image_reconciles_a_model_against_the_test_api_server(tmp_path: Path) -> None:
    require_image(OPERATOR_IMAGE)
    from op_cluster import BASE_RESOURCES, MONITORING, MockCluster, wait_for

    cluster = MockCluster(resources=dict(BASE_RESOURCES) | MONITORING).start()
    try:
        kube = tmp_path / "kube"
        kube.mkdir()
        cluster.write_kubeconfig(kube / "config")
        kube.chmod(0o755)
        (kube / "config").chmod(0o644)
        config = oci_run.image_config(OPERATOR_IMAGE)
        # The image's own CMD, with the liveness endpoint moved off 8080: the operator shares the host's
        # network here (to reach the test API server on 127.0.0.1), where 8080 may be taken.
        health = free_port()
        args = [
            f"--liveness=http://127.0.0.1:{health}/healthz" if a.startswith("--liveness=") else a
            for a in config["Cmd"]
        ]
        container = {
            "name": "operator",
            "args": args,
            "env": [{"name": "KUBECONFIG", "value": "/kube/config"}],
            "securityContext": common.restricted_container_security_context(),
        }
        mounts = [
            oci_run.Mount("/tmp", "emptyDir"),
            oci_run.Mount("/kube", "bind", source=kube, read_only=True),
        ]
        run = oci_run.run_container(OPERATOR_IMAGE, container, mounts, tmp_path / "op.log", network="host")
        try:
            doc = yaml.safe_load(CPU_EXAMPLE.read_text())
            doc["metadata"]["namespace"] = "default"
            cluster.create("InferenceModel", doc)
            name = doc["metadata"]["name"]
            deadline = time.monotonic() + 300  # the operator image starts slowly on a loaded machine
            dep = None
            while dep is None and time.monotonic() < deadline and run.running():
                dep = cluster.get("Deployment", name)
                time.sleep(0.5)
            assert dep is not None, run.log()[-4000:]
            pod = dep["spec"]["template"]["spec"]
            assert pod["containers"][0]["image"] == DEFAULT_SERVER_CPU_IMAGE
            assert pod["containers"][0]["args"] == rendered_server_pod()[1]["args"]
            wait_for(lambda: cluster.get("Service", name), what="Service", timeout=180)
            status = wait_for(
                lambda: (cluster.get("InferenceModel", name) or {}).get("status"), what="status", timeout=180
            )
            assert status["phase"] == "Pending", status
        finally:
            code = run.stop()
        # kopf stops cleanly on SIGTERM.
        assert code == 0, run.log()[-4000:]
    finally:
        cluster.stop()
