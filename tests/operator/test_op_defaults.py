"""The installation's default images and pull secrets (defaults.py): read from the operator's
environment, validated, and used by the renderers when an InferenceModel sets no image of its own;
`render` reads the same variables. Also the `run --leader-elect` flags that cannot work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubeinfer_operator.__main__ import main
from kubeinfer_operator.defaults import ClusterDefaults
from kubeinfer_operator.render import Capabilities, render_all
from kubeinfer_operator.spec import DEFAULT_ROUTER_IMAGE, DEFAULT_SERVER_IMAGE, InferenceModel
from op_testlib import REPO, apply_defaults, crd_schema, inference_model

MIRROR = {
    "KUBEINFER_DEFAULT_SERVER_IMAGE": "mirror.local:5000/kubeinfer/server:0.1.0",
    "KUBEINFER_DEFAULT_ROUTER_IMAGE": "mirror.local:5000/kubeinfer/router:0.1.17",
    "KUBEINFER_DEFAULT_IMAGE_PULL_SECRETS": " mirror , other,mirror,",
}


def pod_specs(doc: dict[str, Any], defaults: ClusterDefaults) -> dict[str, dict[str, Any]]:
    im = InferenceModel.from_manifest({**doc, "metadata": {**doc["metadata"], "uid": "u"}})
    objects = render_all(im, Capabilities(defaults=defaults)).objects
    return {
        o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objects if o["kind"] == "Deployment"
    }


def test_environment_gives_the_defaults() -> None:
    d = ClusterDefaults.from_environment(MIRROR)
    assert d.server_image == MIRROR["KUBEINFER_DEFAULT_SERVER_IMAGE"]
    assert d.router_image == MIRROR["KUBEINFER_DEFAULT_ROUTER_IMAGE"]
    assert d.image_pull_secrets == ("mirror", "other")  # trimmed, each once, empty items dropped
    empty = ClusterDefaults.from_environment({"KUBEINFER_DEFAULT_SERVER_IMAGE": ""})
    assert empty == ClusterDefaults() and empty.server_image == DEFAULT_SERVER_IMAGE
    assert empty.router_image == DEFAULT_ROUTER_IMAGE and empty.image_pull_secrets == ()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KUBEINFER_DEFAULT_SERVER_IMAGE": "Mirror/Server:1"}, "KUBEINFER_DEFAULT_SERVER_IMAGE"),
        ({"KUBEINFER_DEFAULT_ROUTER_IMAGE": "router image"}, "KUBEINFER_DEFAULT_ROUTER_IMAGE"),
        ({"KUBEINFER_DEFAULT_IMAGE_PULL_SECRETS": "ok,Not_A_Name"}, "not a Secret name"),
    ],
)
def test_defaults_the_kubelet_would_refuse_are_refused(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClusterDefaults.from_environment(env)


def test_render_uses_the_defaults_only_where_the_model_sets_nothing() -> None:
    defaults = ClusterDefaults.from_environment(MIRROR)
    doc = inference_model(
        {
            "model": {"uri": "hf://org/model"},
            "resources": {"gpu": {"count": 1}},  # the CUDA image's default (CPU: the test below)
            "routing": {"enabled": True},
            "pod": {"imagePullSecrets": [{"name": "own"}, {"name": "mirror"}]},
        }
    )
    pods = pod_specs(doc, defaults)
    assert pods["m"]["containers"][0]["image"] == MIRROR["KUBEINFER_DEFAULT_SERVER_IMAGE"]
    assert pods["m"]["imagePullSecrets"] == [{"name": "own"}, {"name": "mirror"}, {"name": "other"}]
    assert pods["m-router"]["containers"][0]["image"] == MIRROR["KUBEINFER_DEFAULT_ROUTER_IMAGE"]
    assert pods["m-router"]["imagePullSecrets"] == [{"name": "mirror"}, {"name": "other"}]
    doc["spec"]["engine"] = {"image": "example.org/own/server:2"}
    doc["spec"]["routing"]["image"] = "example.org/own/router:2"
    own = pod_specs(doc, defaults)
    assert own["m"]["containers"][0]["image"] == "example.org/own/server:2"
    assert own["m-router"]["containers"][0]["image"] == "example.org/own/router:2"
    # Without defaults nothing changes: the built-in images, no pull secrets on the router.
    plain = pod_specs(
        inference_model(
            {
                "model": {"uri": "hf://org/model"},
                "resources": {"gpu": {"count": 1}},
                "routing": {"enabled": True},
            }
        ),
        ClusterDefaults(),
    )
    assert (
        plain["m"]["containers"][0]["image"] == DEFAULT_SERVER_IMAGE and "imagePullSecrets" not in plain["m"]
    )
    assert "imagePullSecrets" not in plain["m-router"]


def test_render_command_reads_the_same_environment(tmp_path: Path) -> None:
    manifest = tmp_path / "m.yaml"
    gpu_model = inference_model({"model": {"uri": "hf://org/model"}, "resources": {"gpu": {"count": 1}}})
    manifest.write_text(yaml.safe_dump(gpu_model))
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{REPO}:{REPO / 'operator'}", **MIRROR}
    out = subprocess.run(
        [sys.executable, "-m", "kubeinfer_operator", "render", "-f", str(manifest)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    dep = next(d for d in yaml.safe_load_all(out) if d["kind"] == "Deployment")
    assert (
        dep["spec"]["template"]["spec"]["containers"][0]["image"] == MIRROR["KUBEINFER_DEFAULT_SERVER_IMAGE"]
    )
    bad = subprocess.run(
        [sys.executable, "-m", "kubeinfer_operator", "render", "-f", str(manifest)],
        env={**env, "KUBEINFER_DEFAULT_SERVER_IMAGE": "Bad Image"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 1 and "KUBEINFER_DEFAULT_SERVER_IMAGE" in bad.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--leader-elect-renew-deadline=20s"], "greater than the renew deadline"),
        (["--leader-elect-retry-period=9s"], "1.2 x the retry period"),
        (["--leader-elect-lease-duration=fifteen"], "not a duration"),
        (["--leader-elect-resource-name=Not_A_Name"], "DNS-1123"),
    ],
)
def test_leader_election_flags_that_cannot_work_are_refused(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POD_NAMESPACE", "ops")
    assert main(["run", "-A", "--leader-elect", *flags]) == 2
    assert message in capsys.readouterr().err


def test_leader_election_needs_a_namespace_outside_a_cluster(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    monkeypatch.setattr("kubeinfer_operator.__main__.SERVICE_ACCOUNT_NAMESPACE", "/nonexistent/namespace")
    assert main(["run", "-A", "--leader-elect"]) == 2
    assert "--leader-elect-resource-namespace" in capsys.readouterr().err
    assert main(["run", "-A", "--leader-elect", "--peering=x"]) == 2
    assert "either --leader-elect or --peering" in capsys.readouterr().err


def test_a_model_without_gpus_gets_the_cpu_server_image() -> None:
    """resources.gpu.count 0, the default, runs the CPU build of Dockerfile.server
    (KUBEINFER_DEFAULT_SERVER_CPU_IMAGE, chart value server.cpuImage); a GPU model keeps the CUDA image;
    the model's own image wins."""
    cpu_mirror = "mirror.local:5000/kubeinfer/server:0.1.0-cpu"
    defaults = ClusterDefaults.from_environment({**MIRROR, "KUBEINFER_DEFAULT_SERVER_CPU_IMAGE": cpu_mirror})
    cpu = {"model": {"uri": "hf://org/model"}, "resources": {"gpu": {"count": 0}}}
    assert pod_specs(inference_model(cpu), defaults)["m"]["containers"][0]["image"] == cpu_mirror
    assert pod_specs(inference_model(cpu), ClusterDefaults())["m"]["containers"][0]["image"] == (
        DEFAULT_SERVER_IMAGE + "-cpu"
    )
    gpu = {"model": {"uri": "hf://org/model"}, "resources": {"gpu": {"count": 1}}}
    assert (
        pod_specs(inference_model(gpu), defaults)["m"]["containers"][0]["image"]
        == (MIRROR["KUBEINFER_DEFAULT_SERVER_IMAGE"])
    )
    own = {**cpu, "engine": {"image": "example.com/own:1"}}
    assert pod_specs(inference_model(own), defaults)["m"]["containers"][0]["image"] == "example.com/own:1"
    with pytest.raises(ValueError, match="KUBEINFER_DEFAULT_SERVER_CPU_IMAGE"):
        ClusterDefaults.from_environment({"KUBEINFER_DEFAULT_SERVER_CPU_IMAGE": "Bad Image"})


def test_a_model_that_names_no_gpu_runs_on_cpu() -> None:
    """The CRD defaults resources.gpu.count to 0 (issue 44: a model meant for a CPU node got a Pending
    pod), and the operator's own default (what `render` uses on a manifest the API server never
    defaulted) agrees: the CPU image, no GPU request, no GPU node selector or toleration."""
    bare = inference_model({"model": {"uri": "hf://org/model"}})
    assert apply_defaults(crd_schema(), bare)["spec"]["resources"]["gpu"]["count"] == 0
    for doc in (bare, apply_defaults(crd_schema(), bare)):
        pod = pod_specs(doc, ClusterDefaults())["m"]
        container = pod["containers"][0]
        assert container["image"] == DEFAULT_SERVER_IMAGE + "-cpu"
        requested = {**container["resources"].get("requests", {}), **container["resources"].get("limits", {})}
        assert "nvidia.com/gpu" not in requested
        assert "nvidia.com/gpu.product" not in (pod.get("nodeSelector") or {})
